"""The replicated strategies' recovery decision (``torchpass_ddp``, ``TorchPass``): every rank holds the
whole state, so a recovery agrees on the commit of the pending step, the position to go on from, and who
hands the state to each spare. Every member derives the same :class:`Agreement` from the same rows (pure,
:meth:`Agreement.decide`); :class:`ReplicatedPlan` is how :meth:`Runtime.recover` runs it
(:mod:`torchpass_plugins.core.sharded_recovery` is the sharded counterpart)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchpass_plugins.control.membership import Unrecoverable
from torchpass_plugins.control.protocol import LANDING_KEY
from torchpass_plugins.core.collective_log import BEFORE_LOOP, Position
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.core.state_transfer import Landing, recv_state, send_state
from torchpass_plugins.core.training_state import OWN, capture
from torchpass_plugins.testing import faults

if TYPE_CHECKING:
    from torchpass_plugins.core.runtime import Runtime


@dataclass(frozen=True)
class MemberState:
    """What one member reports when a new group is built: one row of the agreement."""

    spare: bool
    position: tuple[int, int]
    applied: int  # optimizer steps applied (-1 for a spare)
    last_boundary: int
    reduced: bool  # holds the reduced gradient of its pending step (reduction finished, step not applied)
    voted: bool  # finished the commit vote of its pending step: it applies that step whatever happens

    def to_tensor(self) -> torch.Tensor:
        row = [int(self.spare), *self.position, self.applied, self.last_boundary, int(self.reduced), int(self.voted)]
        return torch.tensor(row, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> MemberState:
        spare, step, count, applied, last_boundary, reduced, voted = t.tolist()
        return cls(bool(spare), (step, count), applied, last_boundary, bool(reduced), bool(voted))


@dataclass(frozen=True)
class Agreement:
    """The decision every member derives from the same rows."""

    committed: frozenset[int]  # ranks whose pending step is committed: they apply it, then go on
    entry_step: int
    target: tuple[int, int]
    donor: int
    immediate: bool
    spares: list[int]
    source: int = -1  # the survivor furthest ahead: it holds the results every member behind is missing
    replay: dict[int, tuple[Position, Position]] | None = None  # member -> [start, stop) of the results it gets

    @classmethod
    def decide(cls, rows: list[MemberState]) -> Agreement:
        """Commit rule: the pending step of the survivors that are behind (fewest applied steps) is
        committed iff some survivor finished its commit vote (it applies the step, or already did).

        A rank enters the vote only after its reduction finished, so a finished vote means every rank
        holds the reduced gradient and all behind can apply it. If no survivor finished the vote, no
        survivor applies the step: all retry it (a dead rank that applied it took that state with it).
        Survivors are never two steps apart: applying a step needs every rank's reduction of it.
        """
        survivors = {r: row for r, row in enumerate(rows) if not row.spare}
        if not survivors:
            raise Unrecoverable("torchpass: every rank lost its state at once; resume from a snapshot")
        behind = min(row.applied for row in survivors.values())
        pending = [r for r, row in survivors.items() if row.applied == behind]
        committed = frozenset()
        if any(row.voted or row.applied > behind for row in survivors.values()):
            committed = frozenset(r for r in pending if not survivors[r].voted)
            if not all(survivors[r].reduced for r in committed):
                raise AssertionError(f"torchpass: a step was voted on before every rank reduced it: {rows}")
        applied = {r: row.applied + (r in committed or row.voted) for r, row in survivors.items()}
        entry = max(applied.values())
        target = max([(row.position[0], row.position[1] + (r in committed)) for r, row in survivors.items()])
        target = max(target, (entry, 0))
        ready = [r for r, row in survivors.items() if row.applied == entry and row.last_boundary == entry]
        donor = ready[0] if ready else min(survivors)
        # Results of collectives the furthest member completed and others did not (a spare replays from
        # the entry boundary; the collectives of the steps before it are superseded by the state it gets).
        ahead = max(row.position for row in survivors.values())
        source = min(r for r, row in survivors.items() if row.position == ahead)
        starts = {r: (entry, 0) if row.spare else row.position for r, row in enumerate(rows)}
        replay = {r: (start, ahead) for r, start in starts.items() if start < ahead}
        spares = [r for r, row in enumerate(rows) if row.spare]
        return cls(committed, entry, target, donor, bool(ready), spares, source, replay)


class ReplicatedPlan:
    """The recovery plan of the replicated strategies: rows are :class:`MemberState`, the decision an
    :class:`Agreement`; the exchange replays missed results and hands the whole state to each spare."""

    def __init__(self, rt: Runtime, pos: Position, reduced: bool) -> None:
        self.rt, self.pos, self.reduced = rt, pos, reduced
        self.results: dict[Position, Any] = {}  # from the member furthest ahead, when this one is behind
        self.superseded_before = BEFORE_LOOP

    def prepare(self) -> None:
        pass

    def row(self) -> torch.Tensor:
        rt = self.rt
        applied = -1 if rt.is_spare else rt.adapter.applied_steps()
        voted = applied >= 0 and rt.voted == applied
        return MemberState(rt.is_spare, self.pos, applied, rt.last_boundary, self.reduced or voted, voted).to_tensor()

    def decide(self, rows: list[torch.Tensor]) -> Agreement:
        return Agreement.decide([MemberState.from_tensor(t) for t in rows])

    def describe(self, a: Agreement) -> dict[str, Any]:
        return {"position": list(self.pos), "committed": self.rt.rank in a.committed, "target": list(a.target),
                "entry_step": a.entry_step, "spares": a.spares, "donor": a.donor}

    def exchange(self, a: Agreement) -> None:
        self._replay_results(a)
        self._hand_over(a)

    def finish(self, a: Agreement) -> tuple[bool, dict[str, Any]]:
        rt = self.rt
        rt.replay.start(a.target, self.results, self.superseded_before)
        rt.signals.timer.discard()
        return rt.rank in a.committed, {"retries_collective": self.pos >= a.target}

    def _replay_results(self, a: Agreement) -> None:
        """The member furthest ahead sends every member behind the results it completed and they did not."""
        rt = self.rt
        self.results = {}
        # a spare's collectives before its entry boundary: the state it is about to receive supersedes them
        self.superseded_before = (a.entry_step, 0) if rt.is_spare else BEFORE_LOOP
        for member, (start, stop) in sorted(a.replay.items()):
            if rt.rank == a.source:
                send_state(rt.transport, rt.log.between(start, stop), member)
            elif rt.rank == member:
                self.results, _ = recv_state(rt.transport, a.source)

    def _hand_over(self, a: Agreement) -> None:
        rt = self.rt
        rt.deferred_hand_over = None
        if not a.spares:
            return
        if rt.rank_state is not None:
            self._hand_over_rank_state(a)
        if rt.is_spare:
            faults.point("promoted")
            t0 = time.perf_counter()
            state, nbytes = recv_state(rt.transport, a.donor, rt.landing)
            rt.landing = None
            rt.events.emit("state_received", rank=rt.rank, src=a.donor, bytes=nbytes, seconds=time.perf_counter() - t0)
            rt.adapter.load_state(state)
            rt.phase = Phase.ENTERING
        elif rt.rank == a.donor:
            if a.immediate:
                send_state_to(rt, a.spares)
            else:
                rt.deferred_hand_over = (a.entry_step, a.spares)

    def _hand_over_rank_state(self, a: Agreement) -> None:
        """Each spare gets the lost rank's rank-local state from the ring successor that holds its copy.
        Where no copy survived (that successor lost too, or a spare itself when the copy went round), the
        spare goes on with its own, as after resuming from a snapshot, and says so (``rank_state_lost``):
        a restart would lose the same values and the steps since the snapshot besides."""
        rt = self.rt
        for spare in a.spares:
            holder = (spare + 1) % rt.world_size
            if rt.rank == holder and holder not in a.spares:
                kind, state = rt.rank_state.for_entry(a.entry_step)
                send_state(rt.transport, {"kind": kind, "state": state}, spare)
            elif rt.rank == spare:
                received = recv_state(rt.transport, holder)[0] if holder not in a.spares else {"kind": "none"}
                # None before the first boundary's copy: the lost rank had what a fresh process has.
                if received["kind"] == "none" and a.entry_step > 0:
                    rt.events.emit("rank_state_lost", rank=spare, holder=holder, step=a.entry_step)
                    print(f"torchpass: logical rank {spare}'s metric states and logged values were lost with rank "
                          f"{holder}, which held their copy; on rank {spare} they start over at step "
                          f"{a.entry_step}, as after resuming from a snapshot", file=sys.stderr, flush=True)
                    continue
                if received["kind"] != "none":
                    rt.entering_rank_state = received["state"]
                rt.events.emit("rank_state_received", rank=spare, kind=received["kind"], step=a.entry_step)


def send_state_to(rt: Runtime, spares: list[int]) -> None:
    """The donor's side of a hand-over: the training state as of the last boundary (every part but this
    rank's own) to each spare, one after the other."""
    state = capture(rt.adapter.training_state(), leave_out=(OWN,))
    for dst in spares:
        faults.point("donor")
        t0 = time.perf_counter()
        nbytes = send_state(rt.transport, state, dst)
        rt.events.emit("state_sent", rank=rt.rank, to=dst, bytes=nbytes, seconds=time.perf_counter() - t0)


def announce_landing(rt: Runtime) -> None:
    """Rank 0, once its state exists: the shapes of the state's large tensors, for waiting spares."""
    tensors = rt.adapter.state_tensors()
    if tensors:
        rt.member.store.set(LANDING_KEY, Landing.describe(tensors))


def prepare_landing(rt: Runtime) -> None:
    """While waiting as a spare: once rank 0 announced the state's shapes, allocate and touch them, so that
    the hand-over writes into memory that is ready."""
    if rt.landing is not None or not rt.member.store.check([LANDING_KEY]):
        return
    t0 = time.perf_counter()
    try:
        rt.landing = Landing.from_description(rt.member.store.get(LANDING_KEY))
    except (RuntimeError, MemoryError) as exc:  # no room: receive into fresh memory when promoted
        rt.landing = Landing(())
        rt.events.emit("landing_skipped", why=str(exc))
        return
    rt.events.emit("landing_prepared", bytes=rt.landing.nbytes, seconds=time.perf_counter() - t0)
