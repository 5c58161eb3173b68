"""Straggler detection: which rank's own work per step holds everyone back.

In synchronous training every rank's step takes the same wall time: the fast ranks wait for the slow one
inside the collectives. So each rank measures its *compute* time per step, the wall time between step
boundaries minus the time it spent waiting in collectives, and the ranks compare the medians of aligned
windows (steps ``[s - window, s)`` for ``s`` a multiple of ``window``). Works alike on CPU and GPU: no
profiler or CUPTI is needed.
"""

from __future__ import annotations

import statistics


class StepTimer:
    """This rank's compute time per optimizer step, summarized per window."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.median = 0.0  # of the last complete window; 0 until one completes
        self._times: list[float] = []
        self._last: tuple[int, float, float] | None = None  # (step, wall clock, collective waits) at a boundary

    def boundary(self, step: int, now: float, waited: float) -> bool:
        """At the boundary of ``step``; True when it closed a window (``median`` is then new)."""
        if self._last is not None and self._last[0] == step - 1:
            self._times.append((now - self._last[1]) - (waited - self._last[2]))
        self._last = (step, now, waited)
        if not self.window or step % self.window:
            return False
        complete = len(self._times) == self.window
        self.median, self._times = (statistics.median(self._times) if complete else 0.0), []
        return True

    def discard(self) -> None:
        """A recovery interrupted the window: its wall times say nothing about this rank's speed."""
        self._times, self._last = [], None


def stragglers(medians: list[float], factor: float) -> list[int]:
    """Ranks whose median compute time exceeds ``factor`` times the job's median (none unless every rank
    reported a complete window)."""
    if not medians or min(medians) <= 0:
        return []
    typical = statistics.median(medians)
    return [rank for rank, m in enumerate(medians) if m > factor * typical]
