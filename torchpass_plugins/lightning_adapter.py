"""What the recovery protocol needs from a Lightning ``Trainer``: step boundaries, the state a spare
needs (everything Lightning would checkpoint) and how the spare adopts it through Lightning's own
restore path, in memory."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.data import _update_dataloader
from torch import Tensor
from torch.distributed.tensor import DTensor

from torchpass_plugins import faults
from torchpass_plugins.sampler import ResumeSampler
from torchpass_plugins.tree import tensors_in

if TYPE_CHECKING:
    from torchpass_plugins.strategies.ddp import TorchPassDDPStrategy

log = logging.getLogger(__name__)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class LightningAdapter:
    """Implements :class:`torchpass_plugins.runtime.Adapter` for a Lightning strategy."""

    def __init__(self, strategy: TorchPassDDPStrategy) -> None:
        self.strategy = strategy
        self._resume: tuple[int, int] | None = None  # (epoch, batches already consumed in it)

    @property
    def trainer(self):
        return self.strategy.lightning_module.trainer

    def applied_steps(self) -> int:
        return self.trainer.global_step

    def boundary_snapshot(self) -> Any:
        return self.trainer.fit_loop.state_dict()  # built afresh from the progress objects: a snapshot

    def boundary_state(self, snapshot: Any) -> Any:
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if snapshot is not None:
            checkpoint["loops"]["fit_loop"] = snapshot
        return checkpoint

    def state_tensors(self) -> list[Tensor]:
        """Weights and optimizer state, read without ``dump_checkpoint`` (which runs the user's hooks); none
        for sharded parameters, whose spare receives a shard from its ring successor instead."""
        params = list(self.strategy.lightning_module.state_dict().values())
        if any(isinstance(p, DTensor) for p in params):
            return []
        return tensors_in([params, [list(s.values()) for o in self.strategy.optimizers for s in o.state.values()]])

    def load_state(self, checkpoint: Any) -> None:
        # ``fit(ckpt_path=None)`` leaves this in place, so Lightning restores model, optimizers,
        # schedulers, callbacks and loops from it exactly as from a checkpoint file.
        self.trainer._checkpoint_connector._loaded_checkpoint = checkpoint
        self.resume_data_from(checkpoint)

    def resume_data_from(self, checkpoint: dict) -> None:
        """The train loader will start where ``checkpoint``'s loop progress says (Lightning itself restarts
        a map-style loader's epoch from its first batch)."""
        fit = checkpoint.get("loops", {}).get("fit_loop")
        if fit is None:
            return
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
            if loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0:
                runtime.boundary(trainer.global_step)
                if runtime.drain_due(trainer.global_step) is not None:
                    runtime.carry_out_drain(trainer.global_step)
            faults.point("data")
            original(data_fetcher)

        loop.advance = advance

    def resume_dataloader(self, dataloader: Any) -> Any:
        """On a spare: start the train loader at the batch its predecessor was about to take."""
        if self._resume is None:
            return dataloader
        epoch, batches = self._resume
        self._resume = None
        sampler = getattr(dataloader, "sampler", None)
        if batches == 0 or _is_stateful(dataloader):
            return dataloader  # a stateful loader is repositioned by Lightning's loop restore itself
        if not hasattr(sampler, "set_epoch") or dataloader.batch_size is None:
            raise TypeError(
                "torchpass: a spare can only resume a map-style DataLoader with a batch_size and a sampler "
                f"with set_epoch (e.g. DistributedSampler); got sampler {type(sampler).__name__}"
            )
        return _update_dataloader(dataloader, ResumeSampler(sampler, batches * dataloader.batch_size, epoch))
