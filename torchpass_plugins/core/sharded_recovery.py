"""The recovery decision of fully sharded training: to which step every rank restores, and from where.

Each member reports the steps whose shard state it can produce: a survivor its live state (if it has not
applied a step since its last boundary) and its own packed snapshots; for a lost rank, its ring
successor's replicas. The job restores the newest step that every logical rank can produce. That is
the step in flight whenever the failure struck after the round's fence, and older only if it struck
while a round was in flight or between rounds (``replicate_every_n_steps > 1``): then every rank rolls
back in memory, and the steps lost are recorded. If no common step exists (a rank and its ring
successor lost together), nothing can restore the lost shard and the job stops with that message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchpass_plugins.control.membership import Unrecoverable

NONE = -1


def _pad(steps: tuple[int, ...]) -> list[int]:
    return [*steps, NONE, NONE][:2]


@dataclass(frozen=True)
class ShardRow:
    """What one member reports (spares report only that they are spares)."""

    spare: bool
    applied: int = NONE
    last_boundary: int = NONE
    own: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()

    def to_tensor(self) -> torch.Tensor:
        row = [int(self.spare), self.applied, self.last_boundary, *_pad(self.own), *_pad(self.replicas)]
        return torch.tensor(row, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> ShardRow:
        spare, applied, boundary, *steps = t.tolist()
        own, replicas = (tuple(x for x in pair if x != NONE) for pair in (steps[:2], steps[2:]))
        return cls(bool(spare), applied, boundary, own, replicas)

    def steps(self) -> set[int]:
        live = {self.last_boundary} if self.applied == self.last_boundary != NONE else set()
        return live | set(self.own)


@dataclass(frozen=True)
class ShardAgreement:
    restore_step: int
    lost_steps: int  # applied by some survivor after ``restore_step``: rolled back, applied again
    sources: dict[int, int]  # lost logical rank -> the ring successor that holds its shard
    donor: int  # sends the non-sharded state (loops, schedulers, callbacks)

    @classmethod
    def decide(cls, rows: list[ShardRow]) -> ShardAgreement:
        world = len(rows)
        survivors = [r for r, row in enumerate(rows) if not row.spare]
        if not survivors:
            raise Unrecoverable("torchpass: every rank lost its state at once; resume from a snapshot")
        sources, available = {}, []
        for r, row in enumerate(rows):
            if not row.spare:
                available.append(row.steps())
                continue
            buddy = (r + 1) % world
            if rows[buddy].spare:
                raise Unrecoverable(
                    f"torchpass: logical rank {r} and its replica holder, rank {buddy}, were lost together, so "
                    f"rank {r}'s shard exists nowhere. Resume the job from its newest snapshot."
                )
            sources[r] = buddy
            available.append(set(rows[buddy].replicas))
        common = set.intersection(*available)
        if not common:
            raise Unrecoverable(
                "torchpass: no step is held by every rank's shard copies (replication is off, or a failure came "
                "before the first replication round completed); resume the job from its newest snapshot."
            )
        step = max(common)
        lost = max(rows[r].applied for r in survivors) - step
        return cls(step, lost, sources, min(survivors))
