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
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from torchpass_plugins import faults, rng
from torchpass_plugins.events import EventLog
from torchpass_plugins.grad_buckets import GradientBuckets
from torchpass_plugins.membership import WAKE, JobAborted, Member, WorkerEnv, commit_key
from torchpass_plugins.state_transfer import recv_state, send_state
from torchpass_plugins.transport import PeerFailure, Transport

T = TypeVar("T")
_BEFORE_LOOP = (-1, -1)
_COMMIT_WAIT = timedelta(seconds=30)  # a backstop only: a newer roster ends the wait at once


class SpareReleased(SystemExit):
    """The job ended while this worker waited as a spare: exit cleanly."""


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


@dataclass
class _Agreement:
    committed: bool
    entry_step: int
    target: tuple[int, int]
    donor: int
    immediate: bool
    spares: list[int]


class Runtime:
    """One rank's side of the protocol: positions, collectives with recovery, commits, state hand-over."""

    def __init__(self, env: WorkerEnv, timeout: timedelta) -> None:
        self.env = env
        self.member = Member(env)
        atexit.register(self.close)
        self.transport = Transport(self.member, timeout)
        self.events = EventLog(None)  # TorchPassCallback attaches the run's log
        self.adapter: Adapter | None = None
        self.is_spare = False
        self.step, self.count = _BEFORE_LOOP
        self.last_boundary = -1
        self.target: tuple[int, int] | None = None
        self._pending: tuple[int, list[int]] | None = None
        self._snapshot: Any = None

    @property
    def seed(self) -> int:
        """``seed_everything``'s seed when the script set one, else the job's."""
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
        assignment = self.member.wait_assignment()
        if "exit" in assignment:
            self.member.close()
            raise SpareReleased(0)
        if "reject" in assignment:
            raise PermissionError(f"torchpass: the coordinator refused this worker: {assignment['reject']}")
        gen, rank = assignment["gen"], assignment["rank"]
        self.member.watch_from(gen)
        self.transport.rank = rank
        self.is_spare = gen > 0
        if not self.is_spare:
            try:
                self.transport.connect(gen, rank)
            except PeerFailure:
                pass  # a failure before the first step: the first collective recovers

    def enter_as_spare(self) -> None:
        """Spare side of a recovery: join the group and receive the state (called once ``adapter`` is set)."""
        self.events.emit("spare_promoted", rank=self.rank, gen=self.member.latest_gen)
        self._recover(_BEFORE_LOOP, reduced_gen=None)

    # -- collectives --------------------------------------------------------------------------------------
    def collective(self, fn: Callable[[Transport], T], skipped: T) -> T:
        """Run ``fn`` on the current group; on failure recover and retry, or skip if others passed here."""
        pos = (self.step, self.count)
        self.count += 1
        while True:
            if self._behind(pos):
                return skipped
            try:
                if self.transport.stale() or self.transport.pg is None:
                    raise PeerFailure("newer roster")
                return fn(self.transport)
            except PeerFailure as exc:
                self._recover(pos, reduced_gen=None, cause=str(exc))

    def reduce_gradients(self, buckets: GradientBuckets) -> None:
        """All-reduce the gradient buckets and commit the step; then the buckets hold the sum.

        The step is committed once every rank confirmed its reduction in the store; until then a failure
        makes everyone retry the reduction from the intact local gradients (the spare recomputes its
        predecessor's).
        """
        pos = (self.step, self.count)
        self.count += 1
        if self._behind(pos):
            raise AssertionError(f"torchpass: gradient reduction at {pos} behind target {self.target}")
        while True:
            reduced_gen = None
            try:
                if self.transport.stale() or self.transport.pg is None:
                    raise PeerFailure("newer roster")
                buckets.complete(self.transport, issued=lambda: faults.point("reduce"))
                reduced_gen = self.transport.gen
                faults.point("commit")
                self._commit(self.adapter.applied_steps(), reduced_gen)
                return
            except PeerFailure as exc:
                if self._recover(pos, reduced_gen=reduced_gen, cause=str(exc)):
                    return

    def _commit(self, step: int, gen: int) -> None:
        """Count this rank's reduction; return once all W ranks counted (the step is then committed).

        Waiting is a blocking ``Store.wait`` on the key the last rank sets; the roster watch writes
        ``WAKE`` into it when a newer roster appears, and the counter decides what the wake-up means.
        """
        store, key = self.member.store, commit_key(step, gen)
        if store.add(key, 1) >= self.world_size:
            store.set(key + "/ok", b"1")
            return
        self.member.wake_key = key + "/ok"
        try:
            while True:
                if self.transport.stale():
                    raise PeerFailure(f"commit of step {step}: newer roster")
                try:
                    store.wait([key + "/ok"], _COMMIT_WAIT)
                except dist.DistStoreError:
                    continue
                if store.get(key + "/ok") != WAKE or store.add(key, 0) >= self.world_size:
                    return
                raise PeerFailure(f"commit of step {step}: newer roster")
        finally:
            self.member.wake_key = None

    def _behind(self, pos: tuple[int, int]) -> bool:
        if self.target is None:
            return False
        if pos < self.target:
            return True
        self.target = None
        return False

    # -- step boundaries ---------------------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """Start of optimizer step ``step``: reseed, record the snapshot, hand over a deferred state."""
        self.step, self.count, self.last_boundary = step, 0, step
        rng.reseed(self.seed, self.rank, step)
        faults.at(self.rank, step)
        faults.point("boundary")
        self._snapshot = self.adapter.boundary_snapshot()
        while self._pending and self._pending[0] == step:
            spares, self._pending = self._pending[1], None
            try:
                self._send_to(self.transport, spares, self.adapter.boundary_state(None))
            except PeerFailure as exc:
                self._recover((step, 0), reduced_gen=None, cause=str(exc))

    def _send_to(self, transport: Transport, spares: list[int], state: Any) -> None:
        for dst in spares:
            t0 = time.perf_counter()
            nbytes = send_state(transport, state, dst)
            self.events.emit("state_sent", rank=self.rank, to=dst, bytes=nbytes, seconds=time.perf_counter() - t0)

    # -- recovery ----------------------------------------------------------------------------------------
    def _recover(self, pos: tuple[int, int], reduced_gen: int | None, cause: str = "") -> bool:
        """Rebuild the group of the newest roster and agree how to go on; returns whether the step of a
        completed reduction is committed."""
        t0 = time.perf_counter()
        while True:
            self.member.wait_newer_than(self.transport.gen if self.transport.pg is not None else -1)
            gen = self.member.latest_gen
            roster = self.member.roster(gen)
            if roster.abort:
                self.events.emit("job_aborted", rank=self.rank, message=roster.abort)
                raise JobAborted(roster.abort)
            try:
                t_connect = time.perf_counter()
                self.transport.connect(gen, self.rank)
                connect_s = time.perf_counter() - t_connect
                agreement = self._agree(pos, reduced_gen)
                self.events.emit(
                    "transport_rebuilt",
                    rank=self.rank,
                    gen=gen,
                    seconds=connect_s,
                    cause=cause,
                    position=list(pos),
                    committed=agreement.committed,
                    target=list(agreement.target),
                    entry_step=agreement.entry_step,
                    spares=agreement.spares,
                    donor=agreement.donor,
                )
                self._hand_over(agreement)
            except PeerFailure as exc:
                cause = str(exc)
                continue
            self.target = agreement.target
            self.events.emit(
                "recovered",
                rank=self.rank,
                gen=gen,
                seconds=time.perf_counter() - t0,
                retries_collective=pos >= agreement.target,
            )
            return agreement.committed

    def _agree(self, pos: tuple[int, int], reduced_gen: int | None) -> _Agreement:
        committed = False
        if reduced_gen is not None:
            count = int(self.member.store.add(commit_key(self.adapter.applied_steps(), reduced_gen), 0))
            committed = count >= self.world_size
        applied = self.adapter.applied_steps() if not self.is_spare else -1
        effective = (pos[0], pos[1] + 1) if committed else pos
        mine = torch.tensor(
            [int(self.is_spare), *effective, applied + int(committed), self.last_boundary, int(committed)],
            dtype=torch.int64,
        )
        rows = [r.tolist() for r in self.transport.all_gather(mine)]
        survivors = [(r, row) for r, row in enumerate(rows) if not row[0]]
        if not survivors:
            raise JobAborted("torchpass: every rank lost its state at once; resume from a snapshot")
        spares = [r for r, row in enumerate(rows) if row[0]]
        entry = max(row[3] for _, row in survivors)
        target = max([(row[1], row[2]) for _, row in survivors] + [(entry, 0)])
        ready = [r for r, row in survivors if row[3] == entry and row[4] == entry and not row[5]]
        donor = ready[0] if ready else survivors[0][0]
        return _Agreement(any(row[5] for _, row in survivors), entry, target, donor, bool(ready), spares)

    def _hand_over(self, a: _Agreement) -> None:
        self._pending = None
        if not a.spares:
            return
        if self.is_spare:
            t0 = time.perf_counter()
            state, nbytes = recv_state(self.transport, a.donor)
            self.events.emit(
                "state_received", rank=self.rank, src=a.donor, bytes=nbytes, seconds=time.perf_counter() - t0
            )
            self.adapter.load_state(state)
            self.is_spare = False
        elif self.rank == a.donor:
            if a.immediate:
                self._send_to(self.transport, a.spares, self.adapter.boundary_state(self._snapshot))
            else:
                self._pending = (a.entry_step, a.spares)

    def close(self) -> None:
        """At exit: stop the membership threads. If an operation of a replaced group is still stuck in
        C++, interpreter teardown could crash under it, so such a process leaves through ``os._exit``."""
        drained = self.transport.drain(timeout=2.0)  # heartbeats go on meanwhile
        self.member.close()
        if not drained:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if getattr(sys, "last_value", None) is not None else 0)
