"""The recovery protocol, independent of any training framework.

Each rank tracks its *position* ``(step, count)``: the optimizer step whose boundary it last passed and
the number of collectives it issued since. Every collective goes through :meth:`Runtime.collective`.
When one fails (a peer died, or the coordinator published a newer roster), the members of the newest
roster rebuild the group, agree on the commit state and on a *target* position, the donor sends the full
state to each spare, and everyone continues: members behind the target skip (locally) the collectives
the others already completed; those at the target retry theirs. See ``docs/protocol.md``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchpass_plugins.control.membership import JobAborted, JoinRejected, Member
from torchpass_plugins.control.protocol import TRAINED_KEY, RosterChange, Stalled, reached_key, send
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.core import rng
from torchpass_plugins.core.buffer_sync import BufferSync
from torchpass_plugins.core.collective_log import BEFORE_LOOP, CollectiveLog, Replay
from torchpass_plugins.core.grad_buckets import GradientBuckets
from torchpass_plugins.core.interfaces import Adapter, Phase, RecoveryPlan
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.core.rank_state import RankStateRing
from torchpass_plugins.core.replicated_recovery import ReplicatedPlan, announce_landing, prepare_landing, send_state_to
from torchpass_plugins.core.state_transfer import Landing
from torchpass_plugins.core.step_signals import SignalVerbs, StepSignals
from torchpass_plugins.core.training_state import OWN
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing import faults

T = TypeVar("T")
PROGRESS_EVERY_S = 0.5  # a ``progress`` event per rank at most this often: a timeline, not a firehose


class SpareReleased(SystemExit):
    """The job ended while this worker waited as a spare: exit cleanly."""


class Runtime(SignalVerbs):
    """One rank's side of the protocol: positions, collectives with recovery, commits, state hand-over."""

    def __init__(self, env: WorkerEnv, timeout: timedelta, *, member: Member | None = None,
                 group: ReconfigurableGroup | None = None, events: EventLog | None = None) -> None:
        """``member``, ``group`` and ``events`` stand in for the job's membership, process group and event
        log (in-process tests of the protocol drive several runtimes over fakes); by default each is built
        from ``env``."""
        self.env = env
        self.member = Member(env) if member is None else member
        self.transport = ReconfigurableGroup(self.member, timeout) if group is None else group
        self.side_transports: list[ReconfigurableGroup] = []  # other groups of this process (e.g. shard replication)
        self.events = EventLog(Path(env.run_dir) / "events.jsonl", source=env.worker_id) if events is None else events
        self._progress_logged = -float("inf")  # when the last ``progress`` event was written
        self.adapter: Adapter | None = None
        self.phase = Phase.ACTIVE
        self._entered_at: int | None = None  # a promoted spare's entry boundary
        self.step, self.count = BEFORE_LOOP
        self.last_boundary = -1
        self.voted = -1  # applied steps when this rank last finished a commit vote
        self.log = CollectiveLog()
        self.replay = Replay()
        self.buffer_sync: BufferSync | None = None  # module buffers every rank takes from rank 0 (DDP)
        self.rank_state: RankStateRing | None = RankStateRing()  # None: the strategy carries that state
        self.entering_rank_state: Any = None  # a spare's: the lost rank's, adopted at the first boundary
        self.failed_recovery: BaseException | None = None  # what ended a recovery: this worker is done
        self.deferred_hand_over: tuple[int, list[int]] | None = None  # (boundary, spares) the donor sends at
        self.boundary_record: Any = None  # the adapter's snapshot at the last boundary
        self.seed_override: int | None = None
        self.leave_hooks: list[Callable[[], None]] = []  # run before leaving the job (aborted, or migrated)
        self.signals = StepSignals(env, self.member, self.transport, self.events)
        self._stall_reported = -1  # the generation of this rank's last stall report
        self.rollback_hooks: list[Callable[[], object]] = []  # before a rollback overwrites the live state
        self.landing: Landing | None = None  # a spare's, prepared while it waits
        self._landing_announced = False

    @property
    def is_spare(self) -> bool:
        """Promoted to a rank but without its state yet (it contributes no state to a recovery)."""
        return self.phase is Phase.SPARE

    @property
    def unproven_spare(self) -> bool:
        """A promoted spare until it has completed a step: an error before that would recur on every spare."""
        return self.phase is not Phase.ACTIVE

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
        assignment = self.member.wait_assignment(idle=lambda: prepare_landing(self))
        if "exit" in assignment:
            self.member.close()
            raise SpareReleased(0)
        if "reject" in assignment:
            raise JoinRejected(f"torchpass: the coordinator refused this worker: {assignment['reject']}")
        gen, rank = assignment["gen"], assignment["rank"]
        self.member.watch_from(gen)
        self.transport.rank = rank
        faults.at(rank, -1)
        self.phase = Phase.SPARE if gen > 0 else Phase.ACTIVE
        if not self.is_spare:
            try:
                self.transport.configure(gen, rank, self.member.change(gen).path)
            except PeerFailure:
                pass  # a failure before the first step: the first collective recovers

    def enter_as_spare(self, plan: RecoveryPlan | None = None) -> None:
        """Spare side of a recovery: join the group and receive the state (called once ``adapter`` is set),
        through the strategy's ``plan`` (the replicated strategies' by default)."""
        self.events.emit("spare_promoted", rank=self.rank, gen=self.member.latest_gen)
        self.recover(plan or ReplicatedPlan(self, BEFORE_LOOP, reduced=False), "spare promoted")

    # -- collectives --------------------------------------------------------------------------------------
    def collective(self, fn: Callable[[ReconfigurableGroup], T], skipped: T) -> T:
        """Run ``fn`` on the current group; on failure recover and retry, or, if others passed here, return
        the result they got (``skipped`` before a spare's entry boundary: the state it receives supersedes it)."""
        self._raise_if_recovery_failed()
        pos = (self.step, self.count)
        self.count += 1
        while True:
            if self.replay.behind(pos):
                result, given = self.replay.result(pos, skipped)
                if given:
                    self.log.record(pos, result)
                return result
            try:
                self.transport.check()
                result = fn(self.transport)
            except PeerFailure as exc:
                self._recover(pos, reduced=False, cause=str(exc))
                continue
            self.log.record(pos, result)
            return result

    def reduce_gradients(self, buckets: GradientBuckets) -> None:
        """All-reduce the gradient buckets, then vote to commit the step; then the buckets hold the sum.

        The vote is a one-element all-reduce that each rank enters only after its own reduction completed,
        so a rank that finishes the vote knows that every rank holds the reduced gradient. Until then a
        failure makes everyone retry the reduction from the intact local gradients (the spare recomputes
        its predecessor's), unless the agreement finds the step committed.
        """
        self._raise_if_recovery_failed()
        pos = (self.step, self.count)
        self.count += 1
        if self.replay.behind(pos):
            raise AssertionError(f"torchpass: gradient reduction at {pos} behind target {self.replay.target}")
        while True:
            reduced = False
            try:
                self.transport.check()
                buckets.complete(self.transport, issued=lambda: faults.point("reduce"))
                reduced = True
                if self.rank_state is not None:  # before the vote: a finished vote implies every copy is made
                    own = self.adapter.training_state()[OWN].state_dict()
                    self.rank_state.exchange(self.transport, "vote", self.step, own)
                faults.point("commit")
                vote = self._ballot()
                self.transport.all_reduce(vote, what="commit vote")
            except PeerFailure as exc:
                if not self._recover(pos, reduced=reduced, cause=str(exc)):
                    continue
                vote = self.replay.pop(pos)  # committed: what the members that finished the vote got
            self.voted = self.adapter.applied_steps()
            self.log.record(pos, vote)
            self._count_vote(vote)
            return

    def _ballot(self) -> torch.Tensor:
        """This rank's part of the commit vote: its signals, and rank 0's buffers (no extra collective)."""
        signals = self.signals.row()
        if self.buffer_sync is None or not self.buffer_sync.size:
            return signals
        return torch.cat([signals, self.buffer_sync.contribution(self.rank)])

    def _count_vote(self, vote: torch.Tensor) -> None:
        w = 2 * self.world_size
        if self.buffer_sync is not None and self.buffer_sync.size:
            self.buffer_sync.adopt(vote[w:])
        self.signals.take(vote[:w], self.step, drain_at=self.step + 1)

    # -- step boundaries ---------------------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """Start of optimizer step ``step``: reseed, record the snapshot, hand over a deferred state."""
        self.step, self.count, self.last_boundary = step, 0, step
        self.voted = -1
        if self.phase is Phase.ENTERING:
            self.phase, self._entered_at = Phase.PROVING, step
        elif self.phase is Phase.PROVING and step != self._entered_at:
            self.phase = Phase.ACTIVE
        self.log.new_step(step)
        now = time.perf_counter()
        self.signals.timer.boundary(step, now, self.transport.waited)
        if now - self._progress_logged >= PROGRESS_EVERY_S:
            self._progress_logged = now
            self.events.emit("progress", rank=self.rank, step=step)
        rng.reseed(self.seed, self.rank, step)
        faults.at(self.rank, step)
        faults.point("boundary")
        self.boundary_record = self.adapter.boundary_snapshot()
        if step >= 1 and self.rank == 0 and not self._landing_announced:
            self._landing_announced = True  # once, after an optimizer step: its state exists now
            announce_landing(self)
        while self.deferred_hand_over and self.deferred_hand_over[0] == step:
            spares, self.deferred_hand_over = self.deferred_hand_over[1], None
            try:
                send_state_to(self, spares)
            except PeerFailure as exc:
                self._recover((step, 0), reduced=False, cause=str(exc))
        if self.rank_state is not None:
            self._exchange_rank_state(step)

    def _exchange_rank_state(self, step: int) -> None:
        """The boundary's copy of this rank's rank-local state to its successor: the first collective of the
        step (a member that others passed skips it: its successor holds the copy of its predecessor)."""
        if self.entering_rank_state is not None:
            self.adapter.training_state()[OWN].load_state_dict(self.entering_rank_state)
            self.entering_rank_state = None
        state = self.adapter.training_state()[OWN].state_dict()
        self.collective(lambda t: self.rank_state.exchange(t, "boundary", step, state), None)

    # -- recovery ----------------------------------------------------------------------------------------
    def recover(self, plan: RecoveryPlan, cause: str) -> Any:
        """The recovery loop, one for every strategy. An exception that ends it ends this worker: every later
        collective raises it again (a caller may swallow it, as Lightning's SIGTERM check does)."""
        try:
            return self._recover_loop(plan, self.signals.recovery_cause(self.step, cause))
        except BaseException as exc:
            self.failed_recovery = exc
            raise

    def _raise_if_recovery_failed(self) -> None:
        if self.failed_recovery is not None:
            raise self.failed_recovery

    def _recover_loop(self, plan: RecoveryPlan, cause: str) -> Any:
        """Join the newest roster's group, gather every member's row, derive the plan's decision, exchange state
        (a failure meanwhile starts over with the next roster); then the plan applies it and returns."""
        t0 = time.perf_counter()
        while True:
            self.report_stall(cause)
            change = self.next_roster()
            gen = change.gen
            plan.prepare()
            try:
                t_connect = time.perf_counter()
                for group in (self.transport, *self.side_transports):
                    group.configure(gen, self.rank, change.path)
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

    def _recover(self, pos: tuple[int, int], reduced: bool, cause: str) -> bool:
        """Recover at ``pos``; returns whether this rank's completed (``reduced``) reduction is committed."""
        return self.recover(ReplicatedPlan(self, pos, reduced), cause)

    def roster_changed(self) -> bool:
        """A newer roster replaced this rank's group (a failure elsewhere, or a planned migration)."""
        return self.transport.stale()

    def report_stall(self, cause: str) -> None:
        """Tell the coordinator, once per generation, that this rank's group failed with no newer roster in
        sight: if a peer is alive but stalled outside the collective, only these reports reveal it."""
        gen = self.transport.gen
        if not self.transport.built() or self.member.latest_gen > gen or self._stall_reported == gen:
            return
        self._stall_reported = gen
        grace_s = self.transport.timeout.total_seconds() / 2  # the others time out within this
        send(self.member.store, Stalled(self.env.worker_id, gen, grace_s, why=cause))

    def next_roster(self) -> RosterChange:
        """Wait for a roster newer than the current group's; returns what it changed (raises if it aborts)."""
        self.member.wait_newer_than(self.transport.gen if self.transport.built() else -1)
        change = self.member.change(self.member.latest_gen)
        if change.abort:
            self.events.emit("job_aborted", rank=self.rank, message=change.abort, applied=self._applied())
            raise JobAborted(change.abort)
        return change

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

    def close(self) -> bool:
        """Stop the membership threads and destroy the process groups; the worker's entry calls it at exit,
        while the interpreter is still whole (gloo worker threads that outlive it abort the process:
        pytorch/pytorch#190489). False when an operation of a replaced group is still stuck in C++: the
        groups cannot be destroyed then, and the process must leave without the interpreter's teardown
        (``os._exit``)."""
        transports = (self.transport, *self.side_transports)
        drained = all([t.drain(timeout=2.0) for t in transports])  # heartbeats go on meanwhile
        self.member.close()
        if not drained:
            return False
        for t in transports:  # gloo's threads end as its groups are dropped, NCCL's communicators are aborted
            t.release()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
