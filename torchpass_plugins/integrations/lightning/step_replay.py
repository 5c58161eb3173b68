"""Re-running steps inside a live Lightning fit loop: rewind the loop progress and hand the same batches out
again, without restarting ``fit``.

Fully sharded ranks cannot retry a single collective after a failure (a spare would need every peer to
repeat the earlier all-gathers of the step), so the whole step is discarded before the optimizer applies
it and run again from its boundary, or from an older one after an in-memory rollback. The epoch loop is
given a :class:`ReplayFetcher` that records the batches handed out since the oldest step a rollback may
return to; (``_compat.lightning.rewind_loops`` puts the progress counters back to a boundary's snapshot.)
"""

from __future__ import annotations

from typing import Any

from torchpass_plugins.control.membership import Unrecoverable


class StepFailed(RuntimeError):
    """A collective of this step failed: the step is discarded before its optimizer update."""


class StepDiscarded(StepFailed):
    """The recovery from a failure in this step's commit restored its boundary: the step runs again."""


_OWN = ("_fetcher", "_log", "_cursor", "_replayed_done", "tag", "first_tag")


class ReplayFetcher:
    """Stands in for Lightning's data fetcher in the epoch loop; everything but ``next`` and ``done`` is the
    wrapped fetcher's."""

    def __init__(self, fetcher: Any, first_tag: int) -> None:
        object.__setattr__(self, "_fetcher", fetcher)
        object.__setattr__(self, "_log", [])  # (step, item, done) in fetch order
        object.__setattr__(self, "_cursor", None)
        object.__setattr__(self, "_replayed_done", None)
        object.__setattr__(self, "tag", first_tag)  # the step the next fetched batch belongs to
        object.__setattr__(self, "first_tag", first_tag)  # batches of steps >= this one are all recorded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fetcher, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._fetcher, name, value)

    def __iter__(self) -> ReplayFetcher:
        iter(self._fetcher)
        return self

    def __next__(self) -> Any:
        if self._cursor is not None and self._cursor < len(self._log):
            _, item, done = self._log[self._cursor]
            self._cursor += 1
            self._replayed_done = done
            return item
        self._cursor = self._replayed_done = None
        item = next(self._fetcher)
        self._log.append((self.tag, item, self._fetcher.done))
        return item

    @property
    def done(self) -> bool:
        return self._replayed_done if self._replayed_done is not None else self._fetcher.done

    def forget_before(self, step: int) -> None:
        """Batches of steps before ``step`` will never be replayed."""
        if self._cursor is not None:
            return  # never while replaying
        self._log[:] = [entry for entry in self._log if entry[0] >= step]
        self.first_tag = max(self.first_tag, step)

    def rewind(self, step: int) -> None:
        """The next ``next`` calls return the batches of step ``step`` onwards again."""
        if step < self.first_tag:
            raise Unrecoverable(
                f"torchpass: the recovery must return to step {step}, whose batches are not held any more (it "
                "belongs to an earlier epoch); resume the job from its newest snapshot."
            )
        self._cursor = next((i for i, entry in enumerate(self._log) if entry[0] >= step), len(self._log))
        self._replayed_done = None
