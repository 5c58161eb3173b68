"""The train loader's order and random streams from any position: what a spare resuming mid-epoch sees."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from torchpass_plugins._compat.lightning import users_sampler
from torchpass_plugins.core.sampler import SeededSampler, generators_of, seed_fetches


class Noisy(Dataset):
    """Random augmentation from all three generators, as transforms draw them."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int):
        return torch.full((2,), float(index)) + torch.randn(2), random.random(), float(np.random.rand())


def _batches(skip: int = 0, epoch: int = 1, workers: int = 0, persistent: bool = False, epochs: int = 1):
    dataset = Noisy()
    seed_fetches(dataset)
    inner = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    sampler = SeededSampler(inner, seed=11, rank=1, skip=skip, resume_epoch=epoch if skip else -1)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers, persistent_workers=persistent)
    out = []
    for e in range(epoch, epoch + epochs):
        sampler.set_epoch(e)
        out += [torch.cat([b[0].flatten(), b[1].double(), b[2].double()]) for b in loader]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(120)
def test_augmentation_depends_only_on_the_position_in_the_epoch():
    in_main = _batches(epochs=2)
    assert _same(_batches(workers=2, epochs=2), in_main)  # whichever process loads a batch
    assert _same(_batches(workers=2, persistent=True, epochs=2), in_main)  # workers kept across epochs
    assert not _same(in_main[:12], in_main[12:])  # the next epoch draws other numbers


@pytest.mark.timeout(120)
def test_a_resumed_epoch_skips_what_was_taken_and_draws_what_the_predecessor_drew():
    full = _batches(epoch=2, workers=2)
    dataset = Noisy()
    seed_fetches(dataset)
    inner = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    # Lightning makes a resumed run's iterator before it sets the sampler's epoch: the epoch comes from here.
    resumed = SeededSampler(inner, seed=11, rank=1, skip=5 * 4, resume_epoch=2)
    loader = DataLoader(dataset, batch_size=4, sampler=resumed, num_workers=2)
    got = [torch.cat([b[0].flatten(), b[1].double(), b[2].double()]) for b in loader]
    assert _same(got, full[5:])
    assert len(resumed) == len(inner)  # Lightning counts the epoch's batches from the full length
    resumed.set_epoch(3)
    assert _same([torch.cat([b[0].flatten(), b[1].double(), b[2].double()]) for b in loader], _batches(epoch=3))


@pytest.mark.parametrize("own_generator", [False, True], ids=["global-generators", "own-generator"])
def test_a_random_order_of_the_users_is_split_between_the_ranks_and_redrawn_on_a_spare(own_generator):
    """A user's own ``RandomSampler`` (or a ``StatefulDataLoader``'s), which Lightning wraps in a
    ``DistributedSamplerWrapper``, drawing from the global generators or from one of its own that runs on
    from epoch to epoch: every rank must draw the same order, or their shares overlap, and a spare must
    draw the order of the epoch it enters, whatever its generators did before."""

    def shares(rank: int, state: int, epochs: range, skip: int = 0) -> list[list[int]]:
        torch.manual_seed(state)  # each process's generators are somewhere else
        own = torch.Generator().manual_seed(state) if own_generator else None
        inner = DistributedSamplerWrapper(RandomSampler(range(96), generator=own), num_replicas=3, rank=rank,
                                          shuffle=False)
        generators = generators_of(inner) + generators_of(users_sampler(inner))
        sampler = SeededSampler(inner, 11, rank, skip=skip, resume_epoch=epochs[0] if skip else -1,
                                generators=generators)
        out = []
        for epoch in epochs:
            sampler.set_epoch(epoch)
            out.append([int(i) for i in sampler])
        return out

    job = [shares(rank, state=rank, epochs=range(2)) for rank in range(3)]
    for epoch in range(2):
        assert sorted(i for rank in range(3) for i in job[rank][epoch]) == list(range(96))
    assert job[1][0] != job[1][1]
    assert shares(1, state=99, epochs=range(1, 2), skip=8) == [job[1][1][8:]]
    shares(0, state=5, epochs=range(1))
    assert torch.equal(torch.random.get_rng_state(), torch.manual_seed(5).get_state())  # put back


def test_loading_in_the_main_process_leaves_the_training_stream_alone():
    # (making the iterator draws its base seed: Lightning does that before the step's reseed)
    batches = iter(DataLoader(_seeded(Noisy()), batch_size=4, sampler=SeededSampler(range(96), 1, 0)))

    def draws(fetch: bool) -> tuple:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        if fetch:
            next(batches)
        return torch.rand(3), random.random(), float(np.random.rand())

    expected, got = draws(fetch=False), draws(fetch=True)
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_other_loaders_of_the_same_dataset_load_as_before():
    dataset = Noisy()
    seed_fetches(dataset)
    torch.manual_seed(3)
    plain = next(iter(DataLoader(Noisy(), batch_size=4)))
    torch.manual_seed(3)
    shared = next(iter(DataLoader(dataset, batch_size=4)))  # a validation loader: plain indices
    assert torch.equal(plain[0], shared[0])


def _seeded(dataset: Dataset) -> Dataset:
    seed_fetches(dataset)
    return dataset
