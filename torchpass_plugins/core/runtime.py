"""The recovery protocol, independent of any training framework.

Each rank tracks its *position* ``(step, count)``: the optimizer step whose boundary it last passed and
the number of collectives it issued since. Every collective goes through :meth:`Runtime.collective`.
When one fails (a peer died, or the coordinator published a newer roster), the members of the newest
roster rebuild the group, agree on the commit state and on a *target* position, the donor sends the full
state to each spare, and everyone continues: members behind the target skip (locally) the collectives
the others already completed; those at the target retry theirs. See ``docs/architecture.md``.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from torchpass_plugins.control.membership import (
    INBOX,
    LANDING_KEY,
    TRAINED_KEY,
    JobAborted,
    JoinRejected,
    Member,
    WorkerEnv,
    lost_after_the_step,
    reached_key,
)
from torchpass_plugins.core import rng
from torchpass_plugins.core.buffer_sync import BufferSync
from torchpass_plugins.core.collective_log import CollectiveLog, Position
from torchpass_plugins.core.grad_buckets import GradientBuckets
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.core.rank_state import RankStateRing
from torchpass_plugins.core.replicated_recovery import Agreement, MemberState
from torchpass_plugins.core.state_transfer import Landing, recv_state, send_state
from torchpass_plugins.health.stragglers import StepTimer, stragglers
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing import faults

T = TypeVar("T")
_BEFORE_LOOP = (-1, -1)
_SPARE_ERROR = "torchpass/spare_error/"  # + rank: the error of the last spare that failed before its first step
PROGRESS_EVERY_S = 0.5  # a ``progress`` event per rank at most this often: a timeline, not a firehose


class SpareReleased(SystemExit):
    """The job ended while this worker waited as a spare: exit cleanly."""


class Drained(SystemExit):
    """This worker handed its logical rank to a spare (a planned migration): exit cleanly."""


class Adapter(Protocol):
    """What the protocol needs from the training framework."""

    def applied_steps(self) -> int:
        """Optimizer steps applied so far."""

    def boundary_state(self, snapshot: Any) -> Any:
        """The full state a spare needs to enter at the last step boundary (``snapshot`` taken there)."""

    def boundary_snapshot(self) -> Any:
        """Cheap per-boundary record of what changes within a step (e.g. loop progress)."""

    def load_state(self, state: Any) -> None:
        """Spare side: adopt ``state`` received from the donor."""

    def state_tensors(self) -> list[torch.Tensor]:
        """The large tensors of ``boundary_state`` (weights, optimizer state) without building it: what a
        spare prepares a :class:`Landing` for (empty where no full state is handed over)."""

    def rank_state(self) -> Any:
        """What this rank holds that its peers do not (metric states, logged values), as plain data."""

    def load_rank_state(self, state: Any) -> None:
        """Spare side: adopt the lost rank's :meth:`rank_state`, at the first step boundary."""


class RecoveryPlan(Protocol):
    """How one strategy recovers, run by :meth:`Runtime.recover` in each new generation until it succeeds."""

    def prepare(self) -> None:
        """Before the new generation's groups are built: end work still bound to the old ones."""

    def row(self) -> torch.Tensor:
        """This member's row of the agreement (one int64 tensor, the same shape on every member)."""

    def decide(self, rows: list[torch.Tensor]) -> Any:
        """The decision every member derives from the same rows (pure)."""

    def describe(self, decision: Any) -> dict[str, Any]:
        """The decision's fields for the ``transport_rebuilt`` event."""

    def exchange(self, decision: Any) -> None:
        """Move state between members as decided (``PeerFailure``: the loop starts over)."""

    def finish(self, decision: Any) -> tuple[Any, dict[str, Any]]:
        """Apply the decision locally, once the exchange succeeded: (what ``recover`` returns, the fields of
        the ``recovered`` event)."""


class Runtime:
    """One rank's side of the protocol: positions, collectives with recovery, commits, state hand-over."""

    def __init__(self, env: WorkerEnv, timeout: timedelta) -> None:
        self.env = env
        self.member = Member(env)
        atexit.register(self.close)
        self.transport = ReconfigurableGroup(self.member, timeout)
        self.side_transports: list[ReconfigurableGroup] = []  # other groups of this process (e.g. shard replication)
        self.events = EventLog(Path(env.run_dir) / "events.jsonl", source=env.worker_id)
        self._progress_logged = -float("inf")  # when the last ``progress`` event was written
        self.adapter: Adapter | None = None
        self.is_spare = False
        # a promoted spare until it has completed a step: an error before that would recur on every spare
        self.unproven_spare = False
        self._entered_at: int | None = None
        self.step, self.count = _BEFORE_LOOP
        self.last_boundary = -1
        self._voted = -1  # applied steps when this rank last finished a commit vote
        self.target: tuple[int, int] | None = None
        self.log = CollectiveLog()
        self._replay: dict[Position, Any] = {}  # results handed over by the member ahead, by position
        self._replay_from: Position = _BEFORE_LOOP  # a spare's collectives before this are superseded
        self.buffer_sync: BufferSync | None = None  # module buffers every rank takes from rank 0 (DDP)
        # copies of the ring predecessor's rank-local state (None: the strategy carries that state itself)
        self.rank_state: RankStateRing | None = RankStateRing()
        self._entering_rank_state: Any = None  # a spare's: the lost rank's, adopted at the first boundary
        self._pending: tuple[int, list[int]] | None = None
        self.boundary_record: Any = None  # the adapter's snapshot at the last boundary
        self.seed_override: int | None = None
        self.leave_hooks: list[Callable[[], None]] = []  # run before leaving the job (aborted, or migrated)
        self.timer = StepTimer(env.straggler_window)
        self.drain: tuple[int, int, str] | None = None  # agreed planned migration: (boundary, rank, its worker)
        self._judged = -1  # the step of the last straggler verdict
        self._asked_to_move = False
        self._stall_reported = -1  # the generation of this rank's last stall report
        # run before the live training state is overwritten in memory (a rollback): e.g. a snapshot's
        # background copy of that state must finish first
        self.rollback_hooks: list[Callable[[], object]] = []
        self.landing: Landing | None = None  # a spare's, prepared while it waits
        self._landing_announced = False

    @property
    def seed(self) -> int:
        """The resumed snapshot's seed; else ``seed_everything``'s seed when the script set one; else the job's."""
        if self.seed_override is not None:
            return self.seed_override
        return int(os.environ.get("PL_GLOBAL_SEED", self.env.seed))

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    # -- start --------------------------------------------------------------------------------------------
    def join(self) -> None:
        """Register and wait for a logical rank; spares block here until promoted or released."""
        self.member.join()
        assignment = self.member.wait_assignment(idle=self._prepare_landing)
        if "exit" in assignment:
            self.member.close()
            raise SpareReleased(0)
        if "reject" in assignment:
            raise JoinRejected(f"torchpass: the coordinator refused this worker: {assignment['reject']}")
        gen, rank = assignment["gen"], assignment["rank"]
        self.member.watch_from(gen)
        self.transport.rank = rank
        faults.at(rank, -1)
        self.is_spare = self.unproven_spare = gen > 0
        if not self.is_spare:
            try:
                self.transport.configure(gen, rank)
            except PeerFailure:
                pass  # a failure before the first step: the first collective recovers

    def _prepare_landing(self) -> None:
        """While waiting as a spare: once rank 0 announced the state's shapes, allocate and touch them."""
        if self.landing is not None or not self.member.store.check([LANDING_KEY]):
            return
        t0 = time.perf_counter()
        try:
            self.landing = Landing.from_description(self.member.store.get(LANDING_KEY))
        except (RuntimeError, MemoryError) as exc:  # no room: receive into fresh memory when promoted
            self.landing = Landing(())
            self.events.emit("landing_skipped", why=str(exc))
            return
        self.events.emit("landing_prepared", bytes=self.landing.nbytes, seconds=time.perf_counter() - t0)

    def _announce_landing(self) -> None:
        """Once, at the first boundary after an optimizer step (its state exists now): the state's shapes."""
        self._landing_announced = True
        tensors = self.adapter.state_tensors()
        if tensors:
            self.member.store.set(LANDING_KEY, Landing.describe(tensors))

    def error_repeats(self, error: str) -> bool:
        """An unproven spare failed with ``error``: True when this rank's previous spare failed the same way
        (every spare would: the job must stop), else it is noted for the next one."""
        key = f"{_SPARE_ERROR}{self.rank}"
        store = self.member.store
        if store.check([key]) and store.get(key).decode() == error:
            return True
        store.set(key, error)
        return False

    def enter_as_spare(self) -> None:
        """Spare side of a recovery: join the group and receive the state (called once ``adapter`` is set)."""
        self.events.emit("spare_promoted", rank=self.rank, gen=self.member.latest_gen)
        self._recover(_BEFORE_LOOP, reduced=False)

    # -- collectives --------------------------------------------------------------------------------------
    def collective(self, fn: Callable[[ReconfigurableGroup], T], skipped: T) -> T:
        """Run ``fn`` on the current group; on failure recover and retry, or, if others passed here, return
        the result they got (``skipped`` before a spare's entry boundary: the state it receives supersedes it)."""
        pos = (self.step, self.count)
        self.count += 1
        while True:
            if self._behind(pos):
                return self._replayed(pos, skipped)
            try:
                self.transport.check()
                result = fn(self.transport)
            except PeerFailure as exc:
                self._recover(pos, reduced=False, cause=str(exc))
                continue
            self.log.record(pos, result)
            return result

    def _replayed(self, pos: Position, skipped: T) -> T:
        if pos in self._replay:
            result = self._replay.pop(pos)
            self.log.record(pos, result)
            return result
        if pos < self._replay_from:
            return skipped
        # No survivor completed it, and the spare cannot take part: it enters at the next step boundary, so
        # this collective runs after the optimizer step of the step the lost rank completed.
        raise lost_after_the_step(pos[0])

    def reduce_gradients(self, buckets: GradientBuckets) -> None:
        """All-reduce the gradient buckets, then vote to commit the step; then the buckets hold the sum.

        The vote is a one-element all-reduce that each rank enters only after its own reduction completed,
        so a rank that finishes the vote knows that every rank holds the reduced gradient. Until then a
        failure makes everyone retry the reduction from the intact local gradients (the spare recomputes
        its predecessor's), unless the agreement finds the step committed.
        """
        pos = (self.step, self.count)
        self.count += 1
        if self._behind(pos):
            raise AssertionError(f"torchpass: gradient reduction at {pos} behind target {self.target}")
        while True:
            reduced = False
            try:
                self.transport.check()
                buckets.complete(self.transport, issued=lambda: faults.point("reduce"))
                reduced = True
                if self.rank_state is not None:  # before the vote: a finished vote implies every copy is made
                    self.rank_state.exchange(self.transport, "vote", self.step, self.adapter.rank_state())
                faults.point("commit")
                vote = self._ballot()
                self.transport.all_reduce(vote, what="commit vote")
            except PeerFailure as exc:
                if not self._recover(pos, reduced=reduced, cause=str(exc)):
                    continue
                vote = self._replay.pop(pos)  # committed: what the members that finished the vote got
            self._voted = self.adapter.applied_steps()
            self.log.record(pos, vote)
            self._count_vote(vote)
            return

    def _ballot(self) -> torch.Tensor:
        """This rank's part of the commit vote: its signals, and rank 0's buffers (no extra collective)."""
        signals = self.signals()
        if self.buffer_sync is None or not self.buffer_sync.size:
            return signals
        return torch.cat([signals, self.buffer_sync.contribution(self.rank)])

    def _count_vote(self, vote: torch.Tensor) -> None:
        w = 2 * self.world_size
        if self.buffer_sync is not None and self.buffer_sync.size:
            self.buffer_sync.adopt(vote[w:])
        self.take_signals(vote[:w], self.step, drain_at=self.step + 1)

    def _behind(self, pos: tuple[int, int]) -> bool:
        if self.target is None:
            return False
        if pos < self.target:
            return True
        self.target = None
        self._replay.clear()
        return False

    # -- step boundaries ---------------------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """Start of optimizer step ``step``: reseed, record the snapshot, hand over a deferred state."""
        self.step, self.count, self.last_boundary = step, 0, step
        self._voted = -1
        if self.unproven_spare:
            self.unproven_spare = self._entered_at is None or step == self._entered_at
            self._entered_at = step
        self.log.new_step(step)
        now = time.perf_counter()
        self.timer.boundary(step, now, self.transport.waited)
        if now - self._progress_logged >= PROGRESS_EVERY_S:
            self._progress_logged = now
            self.events.emit("progress", rank=self.rank, step=step)
        rng.reseed(self.seed, self.rank, step)
        faults.at(self.rank, step)
        faults.point("boundary")
        self.boundary_record = self.adapter.boundary_snapshot()
        if step >= 1 and self.rank == 0 and not self._landing_announced:
            self._announce_landing()
        while self._pending and self._pending[0] == step:
            spares, self._pending = self._pending[1], None
            try:
                self._send_to(self.transport, spares, self.adapter.boundary_state(None))
            except PeerFailure as exc:
                self._recover((step, 0), reduced=False, cause=str(exc))
        if self.rank_state is not None:
            self._exchange_rank_state(step)

    def _exchange_rank_state(self, step: int) -> None:
        """The boundary's copy of this rank's rank-local state to its successor: the first collective of the
        step (a member that others passed skips it: its successor holds the copy of its predecessor)."""
        if self._entering_rank_state is not None:
            self.adapter.load_rank_state(self._entering_rank_state)
            self._entering_rank_state = None
        state = self.adapter.rank_state()
        self.collective(lambda t: self.rank_state.exchange(t, "boundary", step, state), None)

    def _send_to(self, transport: ReconfigurableGroup, spares: list[int], state: Any) -> None:
        for dst in spares:
            faults.point("donor")
            t0 = time.perf_counter()
            nbytes = send_state(transport, state, dst)
            self.events.emit("state_sent", rank=self.rank, to=dst, bytes=nbytes, seconds=time.perf_counter() - t0)

    # -- recovery ----------------------------------------------------------------------------------------
    def recover(self, plan: RecoveryPlan, cause: str) -> Any:
        """The recovery loop, one for every strategy: join the newest roster's group, gather every
        member's row, derive the plan's decision, exchange state; a failure meanwhile starts over with
        the roster after it. Then the plan applies the decision locally; returns what it returns."""
        t0 = time.perf_counter()
        while True:
            self.report_stall(cause)
            gen = self.next_roster()
            plan.prepare()
            try:
                t_connect = time.perf_counter()
                for group in (self.transport, *self.side_transports):
                    group.configure(gen, self.rank)
                connect_s = time.perf_counter() - t_connect
                if not self.is_spare:
                    faults.point("survivor")
                decision = plan.decide(self.transport.all_gather(plan.row()))
                self.events.emit("transport_rebuilt", rank=self.rank, gen=gen, seconds=connect_s, cause=cause,
                                 **plan.describe(decision))
                plan.exchange(decision)
            except PeerFailure as exc:
                cause = str(exc)
                continue
            result, outcome = plan.finish(decision)
            self.events.emit("recovered", rank=self.rank, gen=gen, cause=cause, seconds=time.perf_counter() - t0,
                             **outcome)
            return result

    def _recover(self, pos: tuple[int, int], reduced: bool, cause: str = "") -> bool:
        """Recover at ``pos``; returns whether this rank's completed (``reduced``) reduction is committed."""
        return self.recover(_ReplicatedPlan(self, pos, reduced), cause)

    def report_stall(self, cause: str) -> None:
        """Tell the coordinator, once per generation, that this rank's group failed with no newer roster in
        sight: if a peer is alive but stalled outside the collective, only these reports reveal it."""
        gen = self.transport.gen
        if not self.transport.built() or self.member.latest_gen > gen or self._stall_reported == gen:
            return
        self._stall_reported = gen
        self.member.store.queue_push(INBOX, json.dumps({
            "stalled": self.env.worker_id, "gen": gen, "why": cause,
            "grace_s": self.transport.timeout.total_seconds() / 2,  # the others time out within this
        }))

    def next_roster(self) -> int:
        """Wait for a roster newer than the current group's; returns its generation (raises if it aborts)."""
        self.member.wait_newer_than(self.transport.gen if self.transport.built() else -1)
        gen = self.member.latest_gen
        roster = self.member.roster(gen)
        if roster.abort:
            self.events.emit("job_aborted", rank=self.rank, message=roster.abort, applied=self._applied())
            raise JobAborted(roster.abort)
        return gen

    def _replay_results(self, a: Agreement) -> None:
        """The member furthest ahead sends every member behind the results it completed and they did not."""
        self._replay = {}
        self._replay_from = (a.entry_step, 0) if self.is_spare else _BEFORE_LOOP
        for member, (start, stop) in sorted(a.replay.items()):
            if self.rank == a.source:
                send_state(self.transport, self.log.between(start, stop), member)
            elif self.rank == member:
                self._replay, _ = recv_state(self.transport, a.source)

    def _hand_over(self, a: Agreement) -> None:
        self._pending = None
        if not a.spares:
            return
        if self.rank_state is not None:
            self._hand_over_rank_state(a)
        if self.is_spare:
            faults.point("promoted")
            t0 = time.perf_counter()
            state, nbytes = recv_state(self.transport, a.donor, self.landing)
            self.landing = None
            self.events.emit(
                "state_received", rank=self.rank, src=a.donor, bytes=nbytes, seconds=time.perf_counter() - t0
            )
            self.adapter.load_state(state)
            self.is_spare = False
        elif self.rank == a.donor:
            if a.immediate:
                self._send_to(self.transport, a.spares, self.adapter.boundary_state(self.boundary_record))
            else:
                self._pending = (a.entry_step, a.spares)

    def _hand_over_rank_state(self, a: Agreement) -> None:
        """Each spare gets the lost rank's rank-local state from the ring successor that holds its copy.
        Where no copy survived (that successor lost too, or a spare itself when the copy went round), the
        spare goes on with its own, as after resuming from a snapshot, and says so (``rank_state_lost``):
        a restart would lose the same values and the steps since the snapshot besides."""
        for spare in a.spares:
            holder = (spare + 1) % self.world_size
            if self.rank == holder and holder not in a.spares:
                kind, state = self.rank_state.for_entry(a.entry_step)
                send_state(self.transport, {"kind": kind, "state": state}, spare)
            elif self.rank == spare:
                received = recv_state(self.transport, holder)[0] if holder not in a.spares else {"kind": "none"}
                # None before the first boundary's copy: the lost rank had what a fresh process has.
                if received["kind"] == "none" and a.entry_step > 0:
                    self.events.emit("rank_state_lost", rank=spare, holder=holder, step=a.entry_step)
                    print(f"torchpass: logical rank {spare}'s metric states and logged values were lost with rank "
                          f"{holder}, which held their copy; on rank {spare} they start over at step "
                          f"{a.entry_step}, as after resuming from a snapshot", file=sys.stderr, flush=True)
                    continue
                if received["kind"] != "none":
                    self._entering_rank_state = received["state"]
                self.events.emit("rank_state_received", rank=spare, kind=received["kind"], step=a.entry_step)

    # -- signals: planned migrations and step times, carried by a collective each step makes anyway -----
    def signals(self) -> torch.Tensor:
        """This rank's row: a 1 at the index of a rank the coordinator asked to migrate (if this rank has
        seen that notice), and this rank's median compute time per step at ``world_size + rank``."""
        w = self.world_size
        row = [0.0] * (2 * w)  # built in Python: one tensor op instead of several, on the step's hot path
        notice = self.member.drain_notice
        if notice is not None and self.member.roster(self.transport.gen).ranks[notice["rank"]] != notice["worker"]:
            self.member.drain_carried_out()  # stale: that worker no longer holds the rank
            notice = None
        if notice is not None:
            row[notice["rank"]] = 1.0
        row[w + self.rank] = self.timer.median
        return torch.tensor(row, dtype=torch.float64)

    def take_signals(self, total: torch.Tensor, step: int, drain_at: int) -> None:
        """``total``: the sum of every rank's :meth:`signals` at step ``step``, the same on every rank, so
        every rank takes the same decisions: the migration (at boundary ``drain_at``) and the verdict."""
        w = self.world_size
        values = total.tolist()
        asked = next((r for r in range(w) if values[r]), None)
        if asked is not None and self.drain is None:
            self.drain = (drain_at, asked, self.member.roster(self.transport.gen).ranks[asked])
        window = self.timer.window
        if window and step and step % window == 0 and self._judged != step:
            self._judged = step
            self._judge(values[w:], step)

    def _judge(self, medians: list[float], step: int) -> None:
        slow = stragglers(medians, self.env.straggler_factor)
        if not slow:
            return
        if self.rank == 0:  # one record for the job
            self.events.emit("straggler", ranks=slow, step=step, window=self.timer.window,
                             compute_s=medians, factor=self.env.straggler_factor)
        if self.rank in slow and self.env.straggler_migrate and not self._asked_to_move:
            self._asked_to_move = True
            typical = statistics.median(medians)
            self.member.store.queue_push(INBOX, json.dumps({
                "migrate": self.env.worker_id,
                "why": f"straggler: rank {self.rank} computes {medians[self.rank] / typical:.2f}x the median step",
            }))

    def drain_due(self, step: int) -> int | None:
        """The logical rank that moves to a spare at this boundary, if one does. A migration whose worker
        was lost meanwhile (and replaced by a recovery) is dropped: its rank has moved already."""
        if self.drain is None or self.drain[0] != step:
            return None
        _, rank, worker = self.drain
        if self.member.roster(self.transport.gen).ranks[rank] != worker:
            self.drain = None
            self.member.drain_carried_out()
            return None
        return rank

    def carry_out_drain(self, step: int) -> None:
        """At the agreed boundary: the moving rank leaves; the others rebuild the group with the spare."""
        rank = self.end_drain(step)
        # where this rank is: past the boundary's collectives (the rank-state exchange), which the spare,
        # entering at this boundary, must then skip as it would after a failure
        self._recover((self.step, self.count), reduced=False, cause=f"planned migration of rank {rank}")

    def end_drain(self, step: int) -> int:
        """The agreed migration happens now: the moving rank leaves (this does not return there); the
        others get the rank that moved, and rebuild the group with the spare."""
        rank = self.drain[1]
        self.drain = None
        self.member.drain_carried_out()
        if rank != self.rank:
            return rank
        # Tell the coordinator (which promotes the reserved spare), land what is in flight, and exit. The
        # state reaches the spare from a peer at this boundary.
        self.member.store.queue_push(INBOX, json.dumps({"drained": self.env.worker_id}))
        self.events.emit("drained", rank=self.rank, worker=self.env.worker_id, step=step)
        for hook in self.leave_hooks:
            hook()
        raise Drained(0)

    def training_complete(self, step: int) -> None:
        """Past the barrier that ends ``fit``: every rank has finished training (see ``TRAINED_KEY``)."""
        self.events.emit("progress", rank=self.rank, step=step)
        self.member.store.set(TRAINED_KEY, str(step))

    def _applied(self) -> int:
        return -1 if self.is_spare or self.adapter is None else self.adapter.applied_steps()

    def before_abort_exit(self) -> None:
        """The job was aborted and this worker is leaving: record how far it got (for the restart's log of
        steps lost) and let the hooks finish (e.g. land the snapshot in flight, which the restart resumes
        from)."""
        if self._applied() >= 0:
            self.member.store.set(reached_key(self.rank), str(self._applied()))
        for hook in self.leave_hooks:
            try:
                hook()
            except Exception as exc:  # leaving anyway
                print(f"torchpass: while leaving the aborted job: {exc}", file=sys.stderr)

    def close(self) -> None:
        """At exit: stop the membership threads and destroy the process groups while the interpreter is
        still whole (gloo worker threads that outlive it abort the process: pytorch/pytorch#190489). If an
        operation of a replaced group is still stuck in C++, the process leaves through ``os._exit``."""
        transports = (self.transport, *self.side_transports)
        drained = all([t.drain(timeout=2.0) for t in transports])  # heartbeats go on meanwhile
        self.member.close()
        if not drained:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if getattr(sys, "last_value", None) is not None else 0)
        for t in transports:
            t.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class _ReplicatedPlan:
    """The recovery plan of the replicated strategies: rows are :class:`MemberState`, the decision an
    :class:`Agreement`; the exchange replays missed results and hands the whole state to each spare."""

    def __init__(self, rt: Runtime, pos: tuple[int, int], reduced: bool) -> None:
        self.rt, self.pos, self.reduced = rt, pos, reduced

    def prepare(self) -> None:
        pass

    def row(self) -> torch.Tensor:
        rt = self.rt
        applied = -1 if rt.is_spare else rt.adapter.applied_steps()
        voted = applied >= 0 and rt._voted == applied
        return MemberState(rt.is_spare, self.pos, applied, rt.last_boundary, self.reduced or voted, voted).to_tensor()

    def decide(self, rows: list[torch.Tensor]) -> Agreement:
        return Agreement.decide([MemberState.from_tensor(t) for t in rows])

    def describe(self, a: Agreement) -> dict[str, Any]:
        return {"position": list(self.pos), "committed": self.rt.rank in a.committed, "target": list(a.target),
                "entry_step": a.entry_step, "spares": a.spares, "donor": a.donor}

    def exchange(self, a: Agreement) -> None:
        self.rt._replay_results(a)
        self.rt._hand_over(a)

    def finish(self, a: Agreement) -> tuple[bool, dict[str, Any]]:
        self.rt.target = a.target
        self.rt.timer.discard()
        return self.rt.rank in a.committed, {"retries_collective": self.pos >= a.target}
