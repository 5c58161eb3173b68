"""The train loader's order and random streams, reproducible from any position of any epoch.

A spare that takes over a rank mid-epoch must skip the samples its predecessor already took (without
loading them) and must draw, for every batch it loads, the random numbers its predecessor drew. Random
augmentation runs in the loader's workers, whose generators are seeded once per iterator (from the main
process's generator) and then advance with every sample they load: their state at batch j depends on where
the iterator started and on everything loaded before. So :class:`SeededSampler` hands out indices that
carry a seed derived from (job seed, logical rank, epoch, position in the epoch), and the dataset's fetch
(:func:`seed_fetches`) reseeds Python, NumPy and torch from the first index of each batch before loading
it; in the main process (``num_workers=0``) it puts the training stream back afterwards, so fetching never
shifts dropout. Augmentation then depends only on where a batch is in its epoch: not on which worker loads
it, whether workers persist, or where a spare started.

The order itself may be random too, beyond ``DistributedSampler``'s own seed: a ``RandomSampler`` or
``WeightedRandomSampler`` of the user's (Lightning wraps it in a ``DistributedSamplerWrapper``, which
splits one order between the ranks), or a ``StatefulDataLoader``'s, drawn from the global generators or
from a generator of the sampler's own that runs on from epoch to epoch. Both are seeded from (job seed,
epoch) alone before the order is drawn, so every rank draws the same order, and a spare the order of the
epoch it enters, whenever its iterator is made.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler, get_worker_info

from torchpass_plugins.core import rng


class SeededIndex(int):
    """A dataset index with the seed of the position it was drawn at (pickles to loader workers with it)."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SeededIndex:
        obj = super().__new__(cls, index)
        obj.seed = seed
        return obj

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return SeededIndex, (int(self), self.seed)


class SeededSampler(Sampler[int]):
    """Wraps a sampler (``DistributedSampler``, or the job-wide sampler Accelerate shards afterwards): tags
    every index with its position's seed, and skips the first ``skip`` positions of epoch ``resume_epoch``
    (a spare resuming). ``rank`` names whose order the positions count: a rank's own share (Lightning), or
    the whole job's (Accelerate, which shards batches after the sampler: every rank passes 0)."""

    def __init__(self, inner: Sampler[int], seed: int, rank: int, skip: int = 0, resume_epoch: int = -1,
                 generators: Sequence[torch.Generator] | None = None) -> None:
        """``generators``: those the order is drawn from (default: :func:`generators_of` ``inner``)."""
        self.inner = inner
        self.generators = generators_of(inner) if generators is None else list(generators)
        self.seed, self.rank = seed, rank
        self.skip, self.resume_epoch = skip, resume_epoch
        self.epoch = getattr(inner, "epoch", 0)
        if resume_epoch >= 0:  # Lightning makes a resumed run's iterator before it sets the sampler's epoch
            self.set_epoch(resume_epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.inner, "set_epoch"):  # an unshuffled order is the same every epoch; its seeds are not
            self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip = self.skip if self.epoch == self.resume_epoch else 0
        for position, index in enumerate(self._order()):
            if position >= skip:
                yield SeededIndex(index, rng.data_seed(self.seed, self.rank, self.epoch, position))

    def _order(self) -> Iterator[int]:
        """The inner sampler's order of this epoch, with whatever it draws from the global generators drawn
        from the epoch's order seed (a lazy sampler draws at its first index); the streams are put back."""
        saved, order = rng.cpu_state(), rng.order_seed(self.seed, self.epoch)
        rng.seed_cpu(order)
        for generator in self.generators:
            generator.manual_seed(order)
        try:
            indices = iter(self.inner)
            first = next(indices, None)
        finally:
            rng.set_cpu_state(saved)
        if first is not None:
            yield first
            yield from indices

    def __len__(self) -> int:
        return len(self.inner)


def generators_of(sampler: Any, depth: int = 3) -> list[torch.Generator]:
    """The generators a sampler keeps to draw its order: its own, and those of the samplers it wraps."""
    found = []
    for value in getattr(sampler, "__dict__", {}).values():
        if isinstance(value, torch.Generator):
            found.append(value)
        elif isinstance(value, Sampler) and depth:
            found += generators_of(value, depth - 1)
    return found


class _SeededFetch:
    """The dataset's ``__getitems__`` while it feeds a seeded loader: reseed from the batch's first index, then
    load the batch as the loader would have (the dataset's own ``__getitems__`` or one item at a time)."""

    def __init__(self, dataset: Any, original: Any) -> None:
        self.dataset, self.original = dataset, original

    def __call__(self, indices: list[int]) -> list[Any]:
        seed = getattr(indices[0], "seed", None) if len(indices) else None
        plain = [int(i) for i in indices]
        if seed is None:  # another loader sharing the dataset (validation): untouched
            return self._load(plain)
        saved = rng.cpu_state() if get_worker_info() is None else None
        rng.seed_cpu(seed)
        try:
            return self._load(plain)
        finally:
            if saved is not None:
                rng.set_cpu_state(saved)

    def _load(self, indices: list[int]) -> list[Any]:
        return self.original(indices) if self.original else [self.dataset[i] for i in indices]


def seed_fetches(dataset: Any) -> None:
    """Make ``dataset`` reseed before loading each batch of a :class:`SeededSampler` (an instance attribute,
    so the loader's workers get it with their copy of the dataset; other loaders are unaffected)."""
    if isinstance(getattr(dataset, "__getitems__", None), _SeededFetch):
        return
    dataset.__getitems__ = _SeededFetch(dataset, getattr(dataset, "__getitems__", None))
