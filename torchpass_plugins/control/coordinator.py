"""The coordinator: keeps the roster. It runs as a thread of one agent (``leadership`` says which), never in a
training worker.

Inputs arrive on one store queue, the inbox (``protocol``'s messages): workers announce themselves
(``Join``); agents report every worker exit (``Exit``, at once, faster than any heartbeat). With a TCPStore
the coordinator blocks on the inbox; with etcd it looks at most ten times a second, in its agent, never
next to the training processes. What to do about each observation is its ``Policy``'s decision; the
coordinator carries it out, deterministically (a successor handling the same batch from the same ``state``
writes the same keys). Outputs are rosters (``roster/{gen}``) and assignments (``assign/{worker}``). One
failure costs O(world size) small keys.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, replace

import torch.distributed as dist

from torchpass_plugins.control.leadership import JournaledInbox, QueueInbox
from torchpass_plugins.control.policy import Action, Decision, Policy
from torchpass_plugins.control.protocol import (
    ABORT_KEY,
    DONE_KEY,
    RESTART_KEY,
    Exit,
    ExitCode,
    Join,
    LeftForMigration,
    LinkDown,
    Message,
    Migrate,
    NodeLost,
    Roster,
    SpareDeadline,
    Stalled,
    StallVerdict,
    Stop,
    Straggler,
    abort_request_key,
    assign_key,
    borrowed_key,
    decode,
    evict_key,
    join_key,
    node_paths_key,
    roster_change_key,
    roster_key,
    send,
    slot_order,
    watch_key,
)
from torchpass_plugins.control.spare_pool import Move, SparePool
from torchpass_plugins.observe.events import EventLog, HeldEvents

# The order in which one batch of messages is handled (arrival order within each): joins first; a moving
# worker's ``LeftForMigration`` before its ``Exit``, which is then no failure; the ranks lost in one batch are
# replaced by one roster.
_PHASE = {Join: 0, Migrate: 1, Straggler: 1, LeftForMigration: 1, Stalled: 2, StallVerdict: 2, SpareDeadline: 2,
          Exit: 2, NodeLost: 2, LinkDown: 2, Stop: 3}


_WRONG_TOKEN = "wrong join token: set the same TORCHPASS_JOIN_TOKEN on every node of the job"


@dataclass
class Coordinator(SparePool):
    store: dist.Store
    token: str
    processes: int
    world_size: int
    events: EventLog
    policy: Policy = field(default_factory=Policy)
    gen: int = -1
    ranks: list[str] = field(default_factory=list)
    spares: deque = field(default_factory=deque)
    finished: set[int] = field(default_factory=set)
    outcome: str | None = None  # "done" or the abort message
    ranks_before: list[str] | None = None  # the last published roster's workers
    moving: Move | None = None  # the planned migration in progress
    _moves: int = 0
    _left: set[str] = field(default_factory=set)  # left for a migration that could not happen
    _waiting: list[str] = field(default_factory=list)
    # the workers whose collective timed out, per generation, until the verdict on who stalled them
    _stalled: dict[int, set[str]] = field(default_factory=dict)
    timer_store: dist.Store | None = None  # a connection of its own for delayed messages (default: ``store``)
    _short: list[int] = field(default_factory=list)  # lost ranks that wait for a spare
    _borrowed_for: set[int] = field(default_factory=set)  # of those, the ranks a device was asked to borrow for
    _on_loan: set[str] = field(default_factory=set)  # workers on devices borrowed from a lending job
    path: int = 0  # the network path every roster's groups are built on
    failed_paths: set[int] = field(default_factory=set)

    def run(self, inbox: QueueInbox | JournaledInbox) -> None:
        """Handle messages as they arrive, until a ``Stop``; the inbox saves the state after each batch, and
        the batch's events are logged once it is saved (``HeldEvents``)."""
        self.events = HeldEvents(self.events)
        while True:
            go_on = self.handle(inbox.take())
            inbox.handled(self.state())
            self.events.release()
            if not go_on:
                return

    def poll(self) -> None:
        """Handle the messages waiting now (tests drive the coordinator this way)."""
        self.handle(QueueInbox(self.store).waiting())

    def state(self) -> dict:
        """What a successor needs to go on where this coordinator stopped (see ``leadership``)."""
        return {"gen": self.gen, "ranks": self.ranks, "spares": list(self.spares), "finished": sorted(self.finished),
                "outcome": self.outcome, "ranks_before": self.ranks_before, "moves": self._moves,
                "moving": None if self.moving is None else asdict(self.moving), "left": sorted(self._left),
                "waiting": self._waiting, "stalled": {g: sorted(w) for g, w in self._stalled.items()},
                "short": self._short, "path": self.path, "failed_paths": sorted(self.failed_paths)}

    def restore(self, state: dict) -> None:
        """Take over from a coordinator whose last state was ``state``; its pending timers are armed again."""
        self.gen, self.ranks, self.spares = state["gen"], state["ranks"], deque(state["spares"])
        self.finished, self.outcome, self.ranks_before = set(state["finished"]), state["outcome"], state["ranks_before"]
        self._moves, self.moving = state["moves"], None if state["moving"] is None else Move(**state["moving"])
        self._left, self._waiting, self._short = set(state["left"]), state["waiting"], state["short"]
        self._stalled = {int(g): set(w) for g, w in state["stalled"].items()}
        self.path, self.failed_paths = state["path"], set(state["failed_paths"])
        if self._short:
            self._later(self.policy.spare_wait_s, SpareDeadline(self.gen))
        for gen in self._stalled:
            self._later(self.policy.heartbeat_timeout, StallVerdict(gen))

    def handle(self, raw: list[bytes]) -> bool:
        """Handle one batch of messages in ``_PHASE`` order. False on ``Stop``."""
        lost: list[int] = []
        stop = False
        for m in sorted((decode(r) for r in raw), key=lambda m: _PHASE[type(m)]):
            match m:
                case Join(worker):
                    self._on_join(worker)
                case Migrate(worker, why):
                    self._on_migrate(worker, why)
                case Straggler(worker, why):
                    if self.policy.straggler(why).action is Action.MIGRATE:
                        self._on_migrate(worker, why)
                case LeftForMigration(worker):
                    self._on_drained(worker)
                case Stalled(worker, gen, grace_s):
                    self._on_stalled(worker, gen, grace_s)
                case StallVerdict(gen):
                    self._on_stall_verdict(gen, lost)
                case SpareDeadline(gen):
                    if gen == self.gen and self._short and self.outcome is None:
                        decision = self.policy.spares_not_refilled(self._short, len(self.spares),
                                                                   borrowed=bool(self._borrowed_for))
                        if decision.action is Action.BORROW:
                            self._borrow(self._short)
                        else:
                            self._stop_job(decision)
                case Exit(worker, code, why):
                    self._on_exit(worker, code, why, lost)
                case NodeLost(node, why):  # its agent is gone: each of its workers still at work counts as exited
                    working = [w for r, w in enumerate(self.ranks) if r not in self.finished]
                    on_node = [w for w in {*working, *self.spares} if slot_order(w)[0] == node]
                    for worker_id in sorted(on_node, key=slot_order):
                        self._on_exit(worker_id, ExitCode.KILLED, why, lost)
                case LinkDown():
                    self._on_link_down(m, lost)
                case Stop():
                    stop = True
        if (lost or self._short) and self.outcome is None:
            self._replace(self._short + lost)
        return not stop

    def _on_join(self, worker_id: str) -> None:
        if self.store.get(join_key(worker_id)).decode() != self.token:
            self.store.set(assign_key(worker_id), json.dumps({"reject": _WRONG_TOKEN}))
            self.events.emit("join_rejected", worker=worker_id)
            return
        if self._refused_for_its_paths(worker_id):
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
            if self.policy.borrow and self.store.check([borrowed_key(worker_id)]):
                self._on_loan.add(worker_id)
            if self._on_loan and not self._short:  # (a spare that joins while ranks wait for one takes a rank)
                self._give_back_borrowed()
        else:
            self.store.set(assign_key(worker_id), json.dumps({"exit": self.outcome}))

    def _refused_for_its_paths(self, worker_id: str) -> bool:
        """A worker whose node has another number of network paths than this one: the job stops before it
        starts, or the worker, a later spare, is refused."""
        node = slot_order(worker_id)[0]
        if not self.store.check([node_paths_key(node)]):
            return False  # (an agent that has not said: in-process tests)
        decision = self.policy.node_paths(node, int(self.store.get(node_paths_key(node))), started=self.gen >= 0)
        if decision.action is Action.ABORT:
            self._stop_job(decision)
        elif decision.action is Action.REFUSE:
            self.store.set(assign_key(worker_id), json.dumps({"reject": decision.why}))
            self.events.emit("join_rejected", worker=worker_id, why=decision.why)
        return decision.action is not Action.NOTHING

    def _on_exit(self, worker_id: str, code: int, why: str, lost: list[int]) -> None:
        if self.moving is not None and worker_id in (self.moving.worker, self.moving.spare):
            if worker_id == self.moving.worker:
                self.spares.appendleft(self.moving.spare)  # a failure before the boundary: no move
            self.moving = None
        if worker_id in self.spares:
            self.spares.remove(worker_id)
            self.events.emit("spare_lost", worker=worker_id, code=code, spares=len(self.spares))
            return
        if worker_id not in self.ranks:  # before it joined: nothing to replace, unless no worker could start
            decision = self.policy.unjoined_exited(code, worker_id, started=self.gen >= 0)
            if decision.action is Action.ABORT:
                self._stop_job(decision)
            return
        rank = self.ranks.index(worker_id)
        if rank in self._short:
            return  # known lost, its replacement awaited
        key = abort_request_key(worker_id)
        request = self.store.get(key).decode() if self.store.check([key]) else None
        decision = self.policy.rank_exited(code, worker_id, rank, migrating=worker_id in self._left, request=request)
        if decision.action is Action.FINISHED:
            self.finished.add(rank)
            if len(self.finished) == self.world_size:
                self._finish("done")
        elif decision.action is Action.REPLACE:
            self.events.emit("failure_detected", worker=worker_id, rank=rank, code=code, why=why, gen=self.gen)
            lost.append(rank)
        else:
            self._stop_job(decision)

    def _on_stalled(self, worker_id: str, gen: int, grace_s: float) -> None:
        """A collective of ``worker_id`` timed out in generation ``gen``. Unless a new roster comes first (a
        lost peer is reported by its agent within moments), the workers of ``gen`` that did not time out
        too after ``grace_s`` are the ones the others wait for: alive (they beat) but not in the collective."""
        if self.outcome is not None or gen != self.gen:
            return
        if gen not in self._stalled:
            self._stalled[gen] = set()
            self._later(grace_s, StallVerdict(gen))
        self._stalled[gen].add(worker_id)

    def _later(self, seconds: float, message: Message) -> None:
        """Send ``message`` to the inbox after ``seconds`` (on a connection of its own)."""
        timer = threading.Timer(seconds, send, (self.timer_store or self.store, message))
        timer.daemon = True
        timer.start()

    def _on_stall_verdict(self, gen: int, lost: list[int]) -> None:
        timed_out = self._stalled.pop(gen, set())
        if self.outcome is not None or gen != self.gen:
            return
        silent = [w for r, w in enumerate(self.ranks) if w not in timed_out and r not in self.finished]
        decision = self.policy.stall_verdict(gen, silent)
        if decision.action is not Action.EVICT:
            self._stop_job(decision)
            return
        self.events.emit("collective_stalled", gen=gen, workers=silent, timed_out=sorted(timed_out))
        for worker_id in silent:
            self.store.set(evict_key(worker_id), decision.why)
            self._on_exit(worker_id, ExitCode.KILLED, decision.why, lost)

    def _on_link_down(self, report: LinkDown, lost: list[int]) -> None:
        """Leave a failed path: the same members build their groups on another, at once unless a roster with
        other members is due (ranks lost or awaited, a migration, none yet), which is then the first on it."""
        decision = self.policy.link_down(report.path, self.path, self.failed_paths)
        where = {"node": report.node, "peer": report.peer}
        if self.outcome is not None or decision.action is not Action.REROUTE:
            if self.outcome is None and decision.why:  # (no why: a path no longer used)
                self.events.emit("reroute_impossible", **where, path=report.path, why=decision.why)
            return
        self.failed_paths.add(report.path)
        self.path = decision.path
        self.events.emit("rerouted", gen=self.gen + 1, **where, seconds=report.seconds, to=self.path,
                         **{"from": report.path})
        if self.gen >= 0 and not (lost or self._short or self.moving):
            self._publish(Roster(self.gen + 1, tuple(self.ranks), reason=f"reroute: {decision.why}"), {})

    def _publish(self, roster: Roster, assignments: dict[str, int]) -> None:
        self._set_roster(roster)
        self.store.multi_set([assign_key(worker_id) for worker_id in assignments],
                             [json.dumps({"gen": roster.gen, "rank": rank}) for rank in assignments.values()])
        self.events.emit(
            "roster_published",
            gen=roster.gen,
            ranks=list(roster.ranks),
            promoted=assignments,
            spares=len(self.spares),
            reason=roster.reason,
        )

    def _set_roster(self, roster: Roster) -> None:
        """Write the roster and its change from the previous one (what workers read), then wake the roster
        watch of every worker of the previous and the new one (in one request to a TCPStore, one per 128
        workers to etcd)."""
        roster = replace(roster, path=self.path)
        before = Roster(self.gen, tuple(self.ranks_before)) if self.ranks_before is not None else None
        self.store.multi_set([roster_key(roster.gen), roster_change_key(roster.gen)],
                             [roster.to_json(), roster.change_from(before).to_json()])
        woken = sorted(set(self.ranks_before or []) | set(roster.ranks))
        self.store.multi_set([watch_key(worker_id, roster.gen) for worker_id in woken], [b"1"] * len(woken))
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
        told = json.dumps({"exit": outcome})
        self.store.multi_set([assign_key(spare) for spare in self.spares], [told] * len(self.spares))

    def _stop_job(self, decision: Decision) -> None:
        """Carry out ``ABORT`` (stop the job with the decision's message) or ``RESTART`` (every agent restarts
        its workers, which resume from the newest snapshot)."""
        if self.outcome is not None:
            return
        restart = decision.action is Action.RESTART
        self._set_roster(Roster(self.gen + 1, tuple(self.ranks), abort=decision.why))
        self.store.set(RESTART_KEY if restart else ABORT_KEY, decision.why)
        self.events.emit("job_restart" if restart else "job_aborted", message=decision.why,
                         restarts_left=self.policy.restarts_left - restart)
        if restart:
            self.outcome = decision.why
            self._release_spares(decision.why)
        else:
            self._finish(decision.why)
