"""The results of the collectives a rank completed, so that a rank behind is given them, not local values.

Within a step every rank issues the same collectives in the same order, and every rank that completes one
holds the same result: an all-reduce's sum, a broadcast's object, an all-gather's list. After a failure,
members can stand at different positions (one survivor finished a collective that another could not), and
a spare replays its predecessor's step from the boundary. The members behind must then see exactly what the
others saw: a local value in their place would feed the forward pass (a gathered feature, a synchronized
statistic), a logged metric or a decision (early stopping) with numbers no run produced. So each rank keeps
the results of the current and the previous step, and after a recovery the member furthest ahead sends each
member behind the results it is missing (:class:`Replay`).
"""

from __future__ import annotations

from typing import Any

import torch

from torchpass_plugins.control.membership import lost_after_the_step
from torchpass_plugins.core.tree import map_leaves

Position = tuple[int, int]
BEFORE_LOOP: Position = (-1, -1)


class CollectiveLog:
    """Results by position ``(step, count)``, for the current and the previous step."""

    def __init__(self) -> None:
        self._steps: dict[int, dict[int, Any]] = {}

    def record(self, pos: Position, result: Any) -> None:
        # A copy: the caller owns the result and may change it in place (a metric's running value).
        kept = map_leaves(result, lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v)
        self._steps.setdefault(pos[0], {})[pos[1]] = kept

    def new_step(self, step: int) -> None:
        """Step ``step`` begins: results older than the previous step can no longer be asked for."""
        self._steps = {s: results for s, results in self._steps.items() if s >= step - 1}

    def between(self, start: Position, stop: Position) -> dict[Position, Any]:
        """Every result recorded at a position in ``[start, stop)``."""
        return {(s, c): r for s, results in self._steps.items() for c, r in results.items() if start <= (s, c) < stop}


class Replay:
    """A member behind the agreed *target* position after a recovery: at each position before it, the
    result the member furthest ahead got there, instead of running the collective again."""

    def __init__(self) -> None:
        self.target: Position | None = None
        self._results: dict[Position, Any] = {}
        self._superseded_before: Position = BEFORE_LOOP  # a spare's: the state it received supersedes these

    def start(self, target: Position, results: dict[Position, Any], superseded_before: Position) -> None:
        self.target, self._results, self._superseded_before = target, results, superseded_before

    def behind(self, pos: Position) -> bool:
        """Whether ``pos`` is before the target; the first position at or past it ends the replay."""
        if self.target is None:
            return False
        if pos < self.target:
            return True
        self.target = None
        self._results.clear()
        return False

    def pop(self, pos: Position) -> Any:
        """The result the member ahead got at ``pos`` (a committed vote this member did not finish)."""
        return self._results.pop(pos)

    def result(self, pos: Position, skipped: Any) -> tuple[Any, bool]:
        """The result at ``pos`` (behind the target) and True; ``(skipped, False)`` where the state this
        member received supersedes the collective."""
        if pos in self._results:
            return self._results.pop(pos), True
        if pos < self._superseded_before:
            return skipped, False
        # No survivor completed it, and the spare cannot take part: it enters at the next step boundary, so
        # this collective runs after the optimizer step of the step the lost rank completed.
        raise lost_after_the_step(pos[0])
