"""What the recovery protocol needs from a Lightning ``Trainer``: step boundaries, the state a spare
needs (everything Lightning would checkpoint) and how the spare adopts it through Lightning's own
restore path, in memory."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import BatchSampler, IterableDataset

from torchpass_plugins._compat.lightning import (
    continue_from_boundary,
    dataloader_with_sampler,
    drop_loader_positions,
    reopen_epoch_cut_by_fit_end,
    replays_a_batch_end,
    restore_at_fit_start,
    users_sampler,
)
from torchpass_plugins.core.sampler import SeededSampler, generators_of, seed_fetches
from torchpass_plugins.core.training_state import Stateful
from torchpass_plugins.core.tree import tensors_in
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.state_parts import FromPeer
from torchpass_plugins.testing import faults

if TYPE_CHECKING:
    from torchpass_plugins.integrations.lightning.ddp import TorchPassDDPStrategy

log = logging.getLogger(__name__)


def _fixed_size_batch_samplers() -> tuple[type, ...]:
    try:
        from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
    except ImportError:
        return (BatchSampler,)
    return BatchSampler, StatefulBatchSampler


def _index_sampler(dataloader: Any) -> tuple[Any, int | None]:
    """The sampler of single indices and the fixed batch size of a train loader: the loader's own, or
    those of its batch sampler where it is one of fixed size (a ``StatefulDataLoader``'s, which Lightning
    rebuilds around its distributed sampler). ``(sampler, None)`` for any other batch sampler."""
    if dataloader.batch_size is not None:
        return dataloader.sampler, dataloader.batch_size
    batches = dataloader.batch_sampler
    if type(batches) in _fixed_size_batch_samplers():
        return batches.sampler, batches.batch_size
    return getattr(dataloader, "sampler", None), None


class LightningAdapter:
    """Implements :class:`torchpass_plugins.core.runtime.Adapter` for a Lightning strategy."""

    def __init__(self, strategy: TorchPassDDPStrategy) -> None:
        self.strategy = strategy
        self._resume: tuple[int, int] | None = None  # (epoch, batches already consumed in it)
        self._restored_at_boundary = False  # fit restores a boundary's state: see step_starts

    @property
    def trainer(self):
        return self.strategy.lightning_module.trainer

    def applied_steps(self) -> int:
        return self.trainer.global_step

    def boundary_snapshot(self) -> Any:
        return self.trainer.fit_loop.state_dict()  # built afresh from the progress objects: a snapshot

    def training_state(self) -> dict[str, Stateful]:
        return self.strategy.training_state()

    def state_tensors(self) -> list[Tensor]:
        """Weights and optimizer state, read without building the parts; none for sharded parameters, whose
        spare receives a shard from its ring successor instead."""
        params = list(self.strategy.lightning_module.state_dict().values())
        if any(isinstance(p, DTensor) for p in params):
            return []
        return tensors_in([params, [list(s.values()) for o in self.strategy.optimizers for s in o.state.values()]])

    def load_state(self, values: dict[str, Any]) -> None:
        self.strategy.adopt(FromPeer(values))

    def restore_trainer(self, trainer_state: dict[str, Any]) -> None:
        """``fit`` restores ``trainer_state`` (the trainer part) as from a checkpoint file (``ckpt_path=None``
        leaves it in place): loops, schedulers, callbacks, precision; the model and the optimizers come from
        their own parts, loaded as Lightning restores them."""
        restore_at_fit_start(self.trainer, {**trainer_state, "state_dict": {}, "optimizer_states": []})
        self.resume_data_from(trainer_state)
        self._restored_at_boundary = True

    def step_starts(self, data_fetcher: Any) -> bool:
        """Before each ``advance`` of the epoch loop: whether it takes the first batch of an optimizer step
        (not one that replays the end of a batch restored from the user's checkpoint, taking none). Once
        ``fit`` has restored a state handed over here (taken at a step boundary, not inside a batch's end as
        Lightning's checkpoints are), the loop first continues exactly as the ranks that never stopped
        (:func:`continue_from_boundary`): no rank makes a collective the others do not."""
        loop, trainer = self.trainer.fit_loop.epoch_loop, self.trainer
        if self._restored_at_boundary:
            self._restored_at_boundary = False
            continue_from_boundary(loop)
        first = loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0
        return first and not replays_a_batch_end(loop, data_fetcher)

    def fit_ended(self) -> None:
        """A state handed over is restored by the ``fit`` it was handed to, even one with no batch left."""
        self._restored_at_boundary = False

    def resume_data_from(self, checkpoint: dict) -> None:
        """The train loader will start where ``checkpoint``'s loop progress says (Lightning itself restarts
        a map-style loader's epoch from its first batch)."""
        reopen_epoch_cut_by_fit_end(checkpoint)
        fit = checkpoint.get("loops", {}).get("fit_loop")
        if fit is None:
            return
        drop_loader_positions(fit)
        batches = fit["epoch_loop.batch_progress"]
        # A checkpoint written after an epoch's last batch resumes at the start of the next epoch.
        self._resume = (
            fit["epoch_progress"]["current"]["processed"],
            0 if batches["is_last_batch"] else batches["current"]["ready"],
        )

    def install_step_boundary(self) -> None:
        """Mark the start of each optimizer step: before the fetch of its first batch."""
        loop = self.trainer.fit_loop.epoch_loop
        trainer, runtime = self.trainer, self.strategy.runtime
        original = type(loop).advance.__get__(loop)

        def advance(data_fetcher) -> None:
            if self.step_starts(data_fetcher) and runtime.last_boundary != trainer.global_step:
                runtime.boundary(trainer.global_step)
                if runtime.drain_due(trainer.global_step) is not None:
                    runtime.carry_out_drain(trainer.global_step)
            faults.point("data")
            original(data_fetcher)

        loop.advance = advance

    def prepare_train_loader(self, dataloader: Any) -> Any:
        """Every rank's train loader: positions carry their seeds and batches reseed as they load (see
        :mod:`torchpass_plugins.core.sampler`); on a spare it starts at the batch its predecessor was about to take.
        A ``StatefulDataLoader`` is treated alike (its own saved position is dropped on resuming: see
        :func:`drop_loader_positions`). A loader no spare could resume is refused here, on every rank,
        before training."""
        epoch, batches = self._resume or (-1, 0)
        self._resume = None
        if isinstance(getattr(dataloader, "dataset", None), IterableDataset):
            raise ConfigError(
                "torchpass: the train DataLoader reads an IterableDataset: a spare cannot take up a lost rank's "
                "stream where it stopped (its position died with the rank, a StatefulDataLoader's too). Use a "
                "map-style Dataset (one with __getitem__ and __len__)."
            )
        sampler, batch_size = _index_sampler(dataloader)
        if not hasattr(sampler, "set_epoch") or batch_size is None:
            raise ConfigError(
                "torchpass: a spare resumes the train DataLoader at the batch its predecessor was about to take, "
                "which needs batches of a fixed size and a sampler with set_epoch (Lightning's DistributedSampler, "
                f"injected with use_distributed_sampler=True); got sampler {type(sampler).__name__}, "
                f"batch size {batch_size}"
            )
        runtime = self.strategy.runtime
        seed_fetches(dataloader.dataset)
        generators = generators_of(sampler) + generators_of(users_sampler(sampler))
        seeded = SeededSampler(sampler, runtime.seed, runtime.rank, batches * batch_size, epoch, generators)
        return dataloader_with_sampler(dataloader, seeded)
