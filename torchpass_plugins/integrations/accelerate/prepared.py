"""The prepared objects of an Accelerate loop, checked before training (what a spare could not take over
is refused here, saying what to change) and seeded (so a spare draws the same numbers)."""

from __future__ import annotations

from typing import Any

from torchpass_plugins.core.runtime import Runtime
from torchpass_plugins.core.sampler import SeededSampler, seed_fetches
from torchpass_plugins.errors import ConfigError


def check_layout(accelerator: Any, runtime: Runtime) -> None:
    """Refuse an ``Accelerator`` that does not see the job's ranks: it would shard the data and reduce as
    a single process (on a CPU machine without ``cpu=True``), and every rank would train on everything."""
    if (accelerator.num_processes, accelerator.process_index) != (runtime.world_size, runtime.rank):
        raise ConfigError(
            f"torchpass: the Accelerator sees {accelerator.num_processes} process(es) with this one at index "
            f"{accelerator.process_index}, but the job has {runtime.world_size} active ranks and this is rank "
            f"{runtime.rank}: it did not join the job's process group. On a CPU machine pass "
            "Accelerator(cpu=True); otherwise check that nothing initialized torch.distributed before TorchPass()."
        )


def check_loader(loader: Any) -> None:
    """Refuse a prepared loader whose order a spare could not reproduce, saying what to change."""
    from accelerate.data_loader import SeedableRandomSampler
    from torch.utils.data import RandomSampler

    sampler = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)
    sampler = getattr(sampler, "sampler", None)
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
        raise ConfigError(
            "torchpass: a shuffled loader must draw its order from a seed, so that a spare can take the "
            "same batches: Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))"
        )
    if getattr(loader, "use_stateful_dataloader", False):
        raise ConfigError(
            "torchpass: a spare repositions the train loader itself (it skips the batches its predecessor took, "
            "with skip_first_batches, which Accelerate does not support on a StatefulDataLoader): drop "
            "use_stateful_dataloader=True from the DataLoaderConfiguration"
        )
    if loader.rng_types:
        raise ConfigError(
            f"torchpass: the loader synchronizes RNG states ({loader.rng_types}) at each pass; torchpass "
            "reseeds every step instead: drop rng_types (or use use_seedable_sampler=True)"
        )


def seed_loader(loader: Any, seed: int) -> SeededSampler:
    """Give the prepared loader's batches seeds of their place in the job's order, and make the dataset
    reseed from them as it loads (see :mod:`torchpass_plugins.core.sampler`): augmentation in loader workers
    then draws the same numbers on a spare that starts mid-pass as on the rank it replaces."""
    holder = loader.batch_sampler  # BatchSamplerShard -> BatchSampler -> the index sampler
    while getattr(holder, "batch_sampler", None) is not None:
        holder = holder.batch_sampler
    holder.sampler = SeededSampler(holder.sampler, seed, rank=0)
    seed_fetches(loader.dataset)
    return holder.sampler
