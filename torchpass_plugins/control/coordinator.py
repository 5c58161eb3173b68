"""The coordinator: decides rosters. It runs as a thread of node 0's agent, never in a training worker.

Inputs arrive on one store queue, the inbox: workers announce themselves (``join``); agents report every
worker exit (``exit``, at once, faster than any heartbeat). The coordinator blocks on the inbox, so an
idle job costs it nothing: no polling next to the training processes. Outputs are rosters (``roster/{gen}``) and
assignments (``assign/{worker}``). One failure costs O(world size) small keys.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from torchpass_plugins.control.membership import (
    ABORT_KEY,
    CONFIG_ERROR_EXIT,
    DONE_KEY,
    DRAIN_KEY,
    INBOX,
    RESTART_KEY,
    TRAINED_KEY,
    UNRECOVERABLE_EXIT,
    Roster,
    abort_request_key,
    assign_key,
    evict_key,
    roster_key,
    watch_key,
)
from torchpass_plugins.observe.events import EventLog

_FOREVER = timedelta(days=365)  # the inbox wait has no deadline: the agent ends it with a stop message


def slot_order(worker_id: str) -> tuple[int, int, int]:
    """Workers are named ``n{node}-s{slot}-i{incarnation}``; initial ranks follow (node, slot)."""
    node, slot, inc = (int(part[1:]) for part in worker_id.split("-"))
    return node, slot, inc


@dataclass(frozen=True)
class Move:
    """A planned migration: ``worker`` hands logical rank ``rank`` to the reserved ``spare``."""

    rank: int
    worker: str
    spare: str
    why: str


@dataclass
class Coordinator:
    store: dist.Store
    token: str
    processes: int
    world_size: int
    events: EventLog
    gen: int = -1
    ranks: list[str] = field(default_factory=list)
    spares: deque = field(default_factory=deque)
    finished: set[int] = field(default_factory=set)
    outcome: str | None = None  # "done" or the abort message
    ranks_before: list[str] | None = None  # the last published roster's workers
    restarts_left: int = 0  # a failure no spare can fix restarts the job this many more times
    moving: Move | None = None  # the planned migration in progress
    _moves: int = 0
    _left: set[str] = field(default_factory=set)  # left for a migration that could not happen
    _waiting: list[str] = field(default_factory=list)
    # the workers whose collective timed out, per generation, until the verdict on who stalled them
    _stalled: dict[int, set[str]] = field(default_factory=dict)
    timer_store: dist.Store | None = None  # a connection of its own for delayed messages (default: ``store``)
    # More ranks lost than spares free: wait this long for refilled workers to join the pool before
    # restarting (0: restart at once; agents refill failed slots unless --no-refill)
    spare_wait_s: float = 0.0
    _short: list[int] = field(default_factory=list)  # lost ranks that wait for a spare

    def run(self) -> None:
        """Handle messages as they arrive, until a ``stop`` message (pushed by the hosting agent)."""
        self.store.set_timeout(_FOREVER)
        while True:
            first = self.store.queue_pop(INBOX, block=True)
            if not self.handle([first, *self._pop_all()]):
                return

    def poll(self) -> None:
        """Handle the messages waiting now (tests drive the coordinator this way)."""
        self.handle(self._pop_all())

    def handle(self, raw: list[bytes]) -> bool:
        """Joins first, then exits; the ranks lost in one batch are replaced by one roster. False on ``stop``."""
        messages = [json.loads(m) for m in raw]
        for m in messages:
            if "join" in m:
                self._on_join(m["join"])
        for m in messages:  # a moving worker's "drained" precedes its exit, which is then no failure
            if "migrate" in m:
                self._on_migrate(m["migrate"], m.get("why", ""))
            elif "drained" in m:
                self._on_drained(m["drained"])
        lost: list[int] = []
        for m in messages:
            if "stalled" in m:
                self._on_stalled(m["stalled"], m["gen"], m["grace_s"])
            elif "stall_verdict" in m:
                self._on_stall_verdict(m["stall_verdict"], lost)
            elif "spare_deadline" in m:
                self._on_spare_deadline(m["spare_deadline"])
            elif "exit" in m:
                self._on_exit(m["exit"], m["code"], m.get("why", ""), lost)
            elif "node_lost" in m:  # its agent is gone: each of its workers still at work counts as exited
                working = [w for r, w in enumerate(self.ranks) if r not in self.finished]
                on_node = [w for w in {*working, *self.spares} if slot_order(w)[0] == m["node_lost"]]
                for worker_id in sorted(on_node, key=slot_order):
                    self._on_exit(worker_id, -9, m["why"], lost)
        if (lost or self._short) and self.outcome is None:
            self._replace(self._short + lost)
        return not any("stop" in m for m in messages)

    def _pop_all(self) -> list[bytes]:
        items = []
        while self.store.queue_len(INBOX) > 0:
            items.append(self.store.queue_pop(INBOX, block=False))
        return items

    def _on_join(self, worker_id: str) -> None:
        if self.store.get(f"join/{worker_id}").decode() != self.token:
            self.store.set(assign_key(worker_id), json.dumps({"reject": "wrong join token"}))
            self.events.emit("join_rejected", worker=worker_id)
            return
        if self.gen < 0:
            self._waiting.append(worker_id)
            if len(self._waiting) == self.processes:
                ordered = sorted(self._waiting, key=slot_order)
                self.ranks = ordered[: self.world_size]
                self.spares.extend(ordered[self.world_size :])
                self._publish(Roster(0, tuple(self.ranks), reason="start"), {w: r for r, w in enumerate(self.ranks)})
        elif self.outcome is None:
            self.spares.append(worker_id)
            self.events.emit("spare_joined", worker=worker_id, spares=len(self.spares))
        else:
            self.store.set(assign_key(worker_id), json.dumps({"exit": self.outcome}))

    def _on_migrate(self, worker_id: str, why: str) -> None:
        """A health warning or a straggler verdict: move the worker's rank to a spare at a step boundary
        (the ranks agree on which one); a spare on a suspect device just leaves the pool."""
        if self.outcome is not None:
            return
        if worker_id in self.spares:
            self.spares.remove(worker_id)
            self.store.set(assign_key(worker_id), json.dumps({"exit": f"retired: {why}"}))
            self.events.emit("spare_retired", worker=worker_id, why=why, spares=len(self.spares))
            return
        if worker_id not in self.ranks:
            return
        rank = self.ranks.index(worker_id)
        if self.moving is not None or not self.spares:
            reason = "another migration is in progress" if self.moving else "no spare left"
            self.events.emit("migration_refused", worker=worker_id, rank=rank, why=why, reason=reason)
            return
        self.moving = Move(rank, worker_id, self.spares.popleft(), why)
        self._moves += 1
        self.store.set(DRAIN_KEY, json.dumps({"id": self._moves, "rank": rank, "worker": worker_id, "why": why}))
        self.events.emit("migration_requested", worker=worker_id, rank=rank, spare=self.moving.spare, why=why)

    def _on_drained(self, worker_id: str) -> None:
        """The moving worker left at the agreed boundary: promote the reserved spare to its rank."""
        move = self.moving
        if move is None or move.worker != worker_id or self.outcome is not None:
            self._left.add(worker_id)  # its spare was lost meanwhile: its exit is a loss like any other
            return
        self.moving = None
        self.ranks[move.rank] = move.spare
        self._publish(Roster(self.gen + 1, tuple(self.ranks), reason=f"migrate rank {move.rank}: {move.why}"),
                      {move.spare: move.rank})

    def _on_exit(self, worker_id: str, code: int, why: str, lost: list[int]) -> None:
        if self.moving is not None and worker_id in (self.moving.worker, self.moving.spare):
            if worker_id == self.moving.worker:
                self.spares.appendleft(self.moving.spare)  # a failure before the boundary: no move
            self.moving = None
        if worker_id in self.spares:
            self.spares.remove(worker_id)
            self.events.emit("spare_lost", worker=worker_id, code=code, spares=len(self.spares))
            return
        if worker_id not in self.ranks:
            return
        rank = self.ranks.index(worker_id)
        if rank in self._short:
            return  # known lost, its replacement awaited
        if code == CONFIG_ERROR_EXIT:  # a mistake every worker would repeat: no spare, no restart
            key = abort_request_key(worker_id)
            self._abort(self.store.get(key).decode() if self.store.check([key]) else
                        f"worker {worker_id} (logical rank {rank}) stopped on a configuration error; see its output")
            return
        if code == UNRECOVERABLE_EXIT:
            self._abort(self.store.get(abort_request_key(worker_id)).decode(), restartable=True)
            return
        if code == 0 and worker_id not in self._left:
            self.finished.add(rank)
            if len(self.finished) == self.world_size:
                self._finish("done")
            return
        self.events.emit("failure_detected", worker=worker_id, rank=rank, code=code, why=why, gen=self.gen)
        lost.append(rank)

    def _on_stalled(self, worker_id: str, gen: int, grace_s: float) -> None:
        """A collective of ``worker_id`` timed out in generation ``gen``. Unless a new roster comes first (a
        lost peer is reported by its agent within moments), the workers of ``gen`` that did not time out
        too after ``grace_s`` are the ones the others wait for: alive (they beat) but not in the collective."""
        if self.outcome is not None or gen != self.gen:
            return
        if gen not in self._stalled:
            self._stalled[gen] = set()
            self._later(grace_s, {"stall_verdict": gen})
        self._stalled[gen].add(worker_id)

    def _later(self, seconds: float, message: dict) -> None:
        """Push ``message`` to the inbox after ``seconds`` (on a connection of its own)."""
        store = self.timer_store or self.store
        timer = threading.Timer(seconds, lambda: store.queue_push(INBOX, json.dumps(message)))
        timer.daemon = True
        timer.start()

    def _on_spare_deadline(self, gen: int) -> None:
        """No refilled spare joined in time for the ranks lost in generation ``gen``."""
        if gen == self.gen and self._short and self.outcome is None:
            self._too_few_spares(self._short)

    def _too_few_spares(self, lost: list[int]) -> None:
        waited = f" (none joined within {self.spare_wait_s:g} s)" if self.spare_wait_s > 0 else ""
        self._abort(
            f"{len(lost)} worker(s) lost (logical rank(s) {lost}) but {len(self.spares)} spare(s) left{waited}: "
            "the job cannot continue without recomputation. Relaunch with more --spares, or resume "
            "from the newest snapshot.",
            restartable=True,
        )

    def _on_stall_verdict(self, gen: int, lost: list[int]) -> None:
        timed_out = self._stalled.pop(gen, set())
        if self.outcome is not None or gen != self.gen:
            return
        silent = [w for r, w in enumerate(self.ranks) if w not in timed_out and r not in self.finished]
        if not silent:
            self._abort(f"every rank's collective timed out in generation {gen}, none of them was lost: a "
                        "collective that not all ranks issue, or a network fault", restartable=True)
            return
        why = f"stalled the collectives of generation {gen}: alive, but not in them when the others timed out"
        self.events.emit("collective_stalled", gen=gen, workers=silent, timed_out=sorted(timed_out))
        for worker_id in silent:
            self.store.set(evict_key(worker_id), why)
            self._on_exit(worker_id, -9, why, lost)

    def _replace(self, lost: list[int]) -> None:
        if self.finished or self.store.check([TRAINED_KEY]):
            # Every rank had passed the barrier that ends training: nothing to recover, nothing to
            # recompute, but what the lost worker's script had left to do after ``fit`` is lost.
            self._abort(f"rank(s) {lost} failed after training had completed on every rank (in the script's "
                        "code after fit, or at exit); the job is not restarted")
            return
        if len(lost) > len(self.spares):
            if self.spare_wait_s <= 0:
                self._too_few_spares(lost)
            elif not self._short:
                self.events.emit("spare_awaited", ranks=lost, spares=len(self.spares), wait_s=self.spare_wait_s)
                self._later(self.spare_wait_s, {"spare_deadline": self.gen})
            self._short = lost
            return
        self._short = []
        assignments = {}
        for rank in lost:
            spare = self.spares.popleft()
            self.ranks[rank] = spare
            assignments[spare] = rank
        self._publish(Roster(self.gen + 1, tuple(self.ranks), reason=f"replace rank(s) {lost}"), assignments)

    def _publish(self, roster: Roster, assignments: dict[str, int]) -> None:
        self._set_roster(roster)
        for worker_id, rank in assignments.items():
            self.store.set(assign_key(worker_id), json.dumps({"gen": roster.gen, "rank": rank}))
        self.events.emit(
            "roster_published",
            gen=roster.gen,
            ranks=list(roster.ranks),
            promoted=assignments,
            spares=len(self.spares),
            reason=roster.reason,
        )

    def _set_roster(self, roster: Roster) -> None:
        """Write the roster, then wake the roster watch of every worker of the previous one."""
        previous = self.ranks_before or []
        self.store.set(roster_key(roster.gen), roster.to_json())
        for worker_id in set(previous) | set(roster.ranks):
            self.store.set(watch_key(worker_id, roster.gen), b"1")
        self.gen = roster.gen
        self.ranks_before = list(roster.ranks)

    def _finish(self, outcome: str) -> None:
        self.outcome = outcome
        self._release_spares(outcome)
        self.store.set(DONE_KEY, outcome)
        self.events.emit("job_finished", outcome=outcome)

    def _release_spares(self, outcome: str) -> None:
        if self.moving is not None:  # the job ended before the move
            self.spares.append(self.moving.spare)
            self.moving = None
        for spare in self.spares:
            self.store.set(assign_key(spare), json.dumps({"exit": outcome}))

    def _abort(self, message: str, restartable: bool = False) -> None:
        """Stop the job with ``message``; a failure that a restart can get past restarts it instead, while
        restarts are left (every agent restarts its workers, which resume from the newest snapshot)."""
        if self.outcome is not None:
            return
        restart = restartable and self.restarts_left > 0
        self._set_roster(Roster(self.gen + 1, tuple(self.ranks), abort=message))
        self.store.set(RESTART_KEY if restart else ABORT_KEY, message)
        self.events.emit("job_restart" if restart else "job_aborted", message=message,
                         restarts_left=self.restarts_left - restart)
        if restart:
            self.outcome = message
            self._release_spares(message)
        else:
            self._finish(message)
