"""The replicated strategies' recovery decision (``torchpass_ddp``, ``TorchPass``): every rank holds the
whole state, so a recovery agrees on the commit of the pending step, the position to go on from, and who
hands the state to each spare. Pure: every member derives the same :class:`Agreement` from the same rows
(:mod:`torchpass_plugins.core.sharded_recovery` is its sharded counterpart)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchpass_plugins.control.membership import Unrecoverable
from torchpass_plugins.core.collective_log import Position


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
