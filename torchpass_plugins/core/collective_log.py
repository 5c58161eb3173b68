"""The results of the collectives a rank completed, so that a rank behind is given them, not local values.

Within a step every rank issues the same collectives in the same order, and every rank that completes one
holds the same result: an all-reduce's sum, a broadcast's object, an all-gather's list. After a failure,
members can stand at different positions (one survivor finished a collective that another could not), and
a spare replays its predecessor's step from the boundary. The members behind must then see exactly what the
others saw: a local value in their place would feed the forward pass (a gathered feature, a synchronized
statistic), a logged metric or a decision (early stopping) with numbers no run produced. So each rank keeps
the results of the current and the previous step, and after a recovery the member furthest ahead sends each
member behind the results it is missing (:meth:`Runtime._replay`).
"""

from __future__ import annotations

from typing import Any

import torch

from torchpass_plugins.core.tree import map_leaves

Position = tuple[int, int]


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
