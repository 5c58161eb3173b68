"""Per-step random streams derived from (job seed, logical rank, step).

Every rank reseeds its generators at each step boundary from a counter, so a spare that takes over
logical rank ``r`` at step ``k`` draws exactly the numbers its predecessor drew: nothing random has to
survive the failed process. Runs with and without failures draw the same streams.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed unique to (seed, rank, step) (splitmix-style mixing, stable across versions)."""
    x = (seed * _MIX + rank * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    return (x ^ (x >> 32)) & _MASK


_DATA = 0x632BE59BD9B4E019  # keeps the loader's seeds apart from the steps' for the same numbers


def data_seed(seed: int, rank: int, epoch: int, position: int) -> int:
    """The seed of the sample at ``position`` of ``epoch`` in rank ``rank``'s share of the data."""
    return step_seed(seed ^ _DATA, rank, (epoch << 32) + position)


_ORDER = 0x3C6EF372FE94F82B


def order_seed(seed: int, epoch: int) -> int:
    """The seed of ``epoch``'s sample order: the same on every rank, as the order a sampler splits between
    the ranks must be."""
    return step_seed(seed ^ _ORDER, 0, epoch)


def reseed(seed: int, rank: int, step: int) -> None:
    s = step_seed(seed, rank, step)
    seed_cpu(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s)


def seed_cpu(s: int) -> None:
    """Seed Python's, NumPy's and torch's CPU generators from ``s``."""
    random.seed(s)
    np.random.seed(s & 0xFFFFFFFF)
    # Not ``torch.manual_seed``: with CUDA not yet initialized, it queues a lazy CUDA seeding call with a
    # captured stack trace, every step (milliseconds per step, and a list that grows for the whole run).
    torch.default_generator.manual_seed(s)


def cpu_state() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.default_generator.get_state()


def set_cpu_state(state: tuple[Any, Any, torch.Tensor]) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.default_generator.set_state(state[2])
