"""A sampler that starts the current epoch part-way, so that a spare does not load skipped batches."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler


class ResumeSampler(Sampler[int]):
    """Wraps a sampler with ``set_epoch`` (e.g. ``DistributedSampler``) and skips the first ``skip``
    indices of epoch ``epoch``; other epochs, and the length Lightning counts batches with, are unchanged."""

    def __init__(self, inner: Sampler[int], skip: int, epoch: int) -> None:
        self.inner = inner
        self.skip = skip
        self.resume_epoch = epoch
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.inner)
        if self.epoch == self.resume_epoch:
            for _ in range(self.skip):
                next(indices, None)
        return indices

    def __len__(self) -> int:
        return len(self.inner)
