"""The recovery decision of fully sharded training: to which step every rank restores, and from where.

Each member reports the steps whose shard state it can produce: a survivor its live state (if it has not
applied a step since its last boundary; the boundary after it too if it stands in the commit of that step
with the step's gradient reduced) and its own packed snapshots; for a lost rank, its ring successor the
boundaries it can bring its replica to by replaying the logged steps (:mod:`gradient_log`). The job
restores the newest step that every logical rank can produce and that no survivor is behind of: a step
nobody applied is run again rather than applied by survivors alone (their spare enters at a boundary that
some survivor has reached). A step some survivor applied is one whose gradient every successor logged
(it was logged before the commit vote), so a single failure rolls no survivor back; older steps are
restored only after two failures within one step, and the steps lost are recorded. If no common step
exists (a rank and its ring successor lost together), nothing can restore the lost shard and the job
stops with that message.
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
    """What one member reports (spares report only that they are spares). ``pending``: in the commit of
    the step after ``last_boundary``, its gradient reduced and not applied. ``predecessor``: the first and
    last boundary this rank can bring its ring predecessor's shard to."""

    spare: bool
    applied: int = NONE
    last_boundary: int = NONE
    pending: bool = False
    own: tuple[int, ...] = ()
    predecessor: tuple[int, int] = (NONE, NONE)

    def to_tensor(self) -> torch.Tensor:
        row = [int(self.spare), self.applied, self.last_boundary, int(self.pending), *_pad(self.own),
               *self.predecessor]
        return torch.tensor(row, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> ShardRow:
        spare, applied, boundary, pending, *rest = t.tolist()
        own = tuple(x for x in rest[:2] if x != NONE)
        return cls(bool(spare), applied, boundary, bool(pending), own, (rest[2], rest[3]))

    def live(self) -> int:
        """The boundary this rank's live state is at (``NONE`` if it applied a step since)."""
        return self.last_boundary if self.applied == self.last_boundary != NONE else NONE

    def steps(self) -> set[int]:
        live = {self.live()} - {NONE}
        if self.pending and live:
            live.add(self.last_boundary + 1)
        return live | set(self.own)

    def predecessor_steps(self) -> set[int]:
        first, last = self.predecessor
        return set(range(first, last + 1)) if first != NONE else set()


@dataclass(frozen=True)
class ShardAgreement:
    restore_step: int
    lost_steps: int  # applied by some survivor after ``restore_step``: rolled back, applied again
    sources: dict[int, int]  # lost logical rank -> the ring successor that holds its shard
    donor: int  # sends the non-sharded state (loops, schedulers, callbacks): a survivor live at the step

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
            available.append(rows[buddy].predecessor_steps())
        reached = max(rows[r].applied for r in survivors)
        common = {step for step in set.intersection(*available) if step <= reached}
        if not common:
            raise Unrecoverable(
                "torchpass: no step is held by every rank's shard copies (replication is off, or a failure came "
                "before the first replication round completed); resume the job from its newest snapshot."
            )
        step = max(common)
        live = [r for r in survivors if rows[r].live() == step]
        return cls(step, reached - step, sources, min(live or survivors))
