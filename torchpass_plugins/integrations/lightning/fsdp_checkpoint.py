"""``torchpass_fsdp``'s checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fit(ckpt_path=...)``):
directories in the layout of Lightning's ``ModelParallelStrategy``, so that either strategy loads the
other's: torch DCP's shards of ``state_dict`` and of each ``optimizer_{i}`` (optimizer state by parameter
name, sharded as held), written by every rank, and the rest of Lightning's checkpoint in ``meta.pt``,
from rank 0. Besides, each rank writes its own module buffers: DCP keeps one copy of a tensor that is not
sharded, and buffers differ between ranks (BatchNorm statistics).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.optim import Optimizer
from typing_extensions import override

from torchpass_plugins.core.training_state import ModelState, OptimizerState, load_stored
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.storage.snapshot_store import stored_entries

if TYPE_CHECKING:
    from torchpass_plugins.integrations.lightning.fsdp import TorchPassFSDPStrategy

CHECKPOINT_META = "meta.pt"  # beside the DCP shards: everything but model and optimizers (Lightning's name)
RANK_BUFFERS = "buffers_rank{rank}.pt"  # beside them too: each rank's own module buffers


class ShardedCheckpoints:
    """Lightning's checkpoint hooks of :class:`TorchPassFSDPStrategy`."""

    _loaded_sharded = False  # a directory was loaded into the shards: Lightning's own loading is skipped

    @override
    def optimizer_state(self: TorchPassFSDPStrategy, optimizer: Optimizer) -> dict[str, Any]:
        if self._trainer_part_only:
            return {}
        return OptimizerState(self.lightning_module, [optimizer]).state_dict()

    @override
    def save_checkpoint(self: TorchPassFSDPStrategy, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("torchpass_fsdp writes sharded checkpoints with torch DCP: storage_options are unused")
        save_sharded_checkpoint(self, checkpoint, Path(filepath))

    @override
    def load_checkpoint(self: TorchPassFSDPStrategy, checkpoint_path: Any,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if (path / "lightning.pt").is_file():
            raise ConfigError(f"torchpass: {path} was written by an earlier torchpass_fsdp, in a layout this "
                              "version does not read; resume it with that version, or from a snapshot")
        if not (path / CHECKPOINT_META).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only)  # a single file, as Lightning writes
        checkpoint = load_sharded_checkpoint(self, path)
        self._loaded_sharded = True
        self.adapter.resume_data_from(checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self: TorchPassFSDPStrategy, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if not self._loaded_sharded:
            super().load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self: TorchPassFSDPStrategy, checkpoint: dict[str, Any]) -> None:
        if not self._loaded_sharded:
            super().load_optimizer_state_dict(checkpoint)


def save_sharded_checkpoint(strategy: TorchPassFSDPStrategy, checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` (Lightning's, dumped on every rank) as a directory in the layout above."""
    optimizers = checkpoint.get("optimizer_states", [])
    dcp.save({"state_dict": checkpoint["state_dict"], **{f"optimizer_{i}": o for i, o in enumerate(optimizers)}},
             checkpoint_id=path)
    torch.save(strategy.sharded.buffers(), path / RANK_BUFFERS.format(rank=strategy.global_rank))
    if strategy.is_global_zero:
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        torch.save(rest, path / CHECKPOINT_META)


def load_sharded_checkpoint(strategy: TorchPassFSDPStrategy, path: Path) -> dict[str, Any]:
    """Load a directory written by :func:`save_sharded_checkpoint` (or by ``ModelParallelStrategy``) into
    the shards, resharded if it was written by another number of ranks; returns the rest of the checkpoint.
    Each optimizer gets the state the checkpoint holds, and none for a parameter it has none for."""
    module = strategy.lightning_module
    parts = {"state_dict": ModelState(module), **{f"optimizer_{i}": OptimizerState(module, [optimizer])
                                                  for i, optimizer in enumerate(strategy.optimizers)}}
    metadata = dcp.FileSystemReader(path).read_metadata()
    load_stored(parts, lambda prefix: stored_entries(metadata, prefix), lambda into: dcp.load(into, checkpoint_id=path))
    own = path / RANK_BUFFERS.format(rank=strategy.global_rank)
    if own.is_file():  # else (a rank the writing job did not have, or ModelParallelStrategy) one rank's buffers
        strategy.sharded.load_buffers(torch.load(own, weights_only=True))
    checkpoint = torch.load(path / CHECKPOINT_META, weights_only=False)
    checkpoint.update(state_dict={}, optimizer_states=[])
    return checkpoint
