"""The prepared objects of an Accelerate loop, checked before training (what a spare could not take over
is refused here, saying what to change) and seeded (so a spare draws the same numbers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchpass_plugins.core.runtime import Runtime
from torchpass_plugins.core.sampler import SeededSampler, seed_fetches
from torchpass_plugins.core.training_state import OWN, TRAINER
from torchpass_plugins.errors import ConfigError


def sort_tracked(objects: dict[str, Any]) -> tuple[Any, list[Any], list[Any]]:
    """The train loader, the optimizers and the models among the objects passed to ``track``, which must be
    one, some and some, under names not torchpass's own, and all the others stateful."""
    from accelerate.data_loader import DataLoaderShard

    loaders = [o for o in objects.values() if isinstance(o, DataLoaderShard)]
    optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
    models = [o for o in objects.values() if isinstance(o, nn.Module)]
    if len(loaders) != 1 or not optimizers or not models:
        raise ConfigError(
            "torchpass: track() needs the prepared model(s), optimizer(s) and exactly one train loader "
            f"(returned by accelerator.prepare); got {len(models)} model(s), {len(optimizers)} "
            f"optimizer(s), {len(loaders)} prepared loader(s)"
        )
    for name, obj in objects.items():
        if name in (TRAINER, OWN):
            raise ConfigError(f"torchpass: track({name}=...): the name {name!r} is torchpass's own; choose another")
        stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        if not (stateful or isinstance(obj, DataLoaderShard)):
            raise ConfigError(f"torchpass: track({name}=...) has no state_dict/load_state_dict to hand over")
    return loaders[0], optimizers, models


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
