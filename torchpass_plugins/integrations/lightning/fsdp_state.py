"""What ``torchpass_fsdp`` keeps of each rank's state, and how it is captured and put back.

Under fully sharded training no peer holds a rank's shard, so three things are kept per rank: the shard
itself (ring replicas, :mod:`torchpass_plugins.core.ring_replication`), the rank's *own* state (module
buffers, which FSDP keeps per rank, e.g. BatchNorm statistics, plus logged values and metric states), and
the *host* part every rank shares (loop progress, schedulers, optimizer hyperparameters), restored
with the shards. A spare receives all three; a survivor that rolls back restores them in memory.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from torchpass_plugins._compat.lightning import dump_checkpoint
from torchpass_plugins.core import shard_state
from torchpass_plugins.integrations.lightning.snapshot_parts import capture

if TYPE_CHECKING:
    from torchpass_plugins.integrations.lightning.fsdp import TorchPassFSDPStrategy

CHECKPOINT_META = "lightning.pt"  # beside the DCP shards: everything but model and optimizer tensors
RANK_BUFFERS = "buffers_rank{rank}.pt"  # beside them too: each rank's own module buffers


def hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Per parameter group: lr, betas... (schedulers change them), without the parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def set_hyperparameters(optimizer: Optimizer, groups: list[dict[str, Any]]) -> None:
    for group, values in zip(optimizer.param_groups, groups, strict=True):
        group.update(values)


def trainable_only(name: str, param: nn.Parameter) -> bool:
    """A model-aware ``state_filter``: frozen parameters never change, so their shards need not move."""
    return param.requires_grad


class ShardedState:
    """One rank's kept state under ``torchpass_fsdp``, at recent step boundaries."""

    def __init__(self, strategy: TorchPassFSDPStrategy) -> None:
        self.strategy = strategy
        self.own: dict[int, dict] = {}  # this rank's own state at recent boundaries (:meth:`own_state`)
        self.entering_own: dict | None = None  # a spare's: the lost rank's, adopted at its first boundary
        self.incoming: dict | None = None  # a spare's shard, applied when Lightning restores the model
        self.handing_over = False  # Lightning's checkpoint is being dumped for a spare: no model, no optimizer

    def snapshot(self, step: int) -> tuple[dict, set[int]]:
        """For a snapshot at boundary ``step``: this rank's shards, its own state and Lightning's state as
        of the boundary (model-aware filtering does not apply: a snapshot is the last resort)."""
        s = self.strategy
        rest = {k: v for k, v in self.host_checkpoint(step).items() if k not in ("state_dict", "optimizer_states")}
        return capture(s.lightning_module, s.optimizers, s.global_rank, rest, own=self.own[step])

    def skipped_parameters(self) -> frozenset[str]:
        """Model-aware mode: the parameters ``state_filter`` leaves out of replicas and hand-overs."""
        s = self.strategy
        if s.state_filter is None:
            return frozenset()
        return frozenset(n for n, p in s.lightning_module.named_parameters() if not s.state_filter(n, p))

    def own_state(self) -> dict:
        """What differs between ranks besides the shard: module buffers and the logged values and metric
        states. Copied, because the step's forward changes them in place: a retried or rolled-back step
        starts again from this copy, and a spare from its predecessor's, which the ring replica carries."""
        return {"buffers": self.buffers(), "rank": copy.deepcopy(self.strategy.adapter.rank_state())}

    def adopt_entering_own(self) -> None:
        """A spare at its first boundary: the lost rank's own state, received with its shard, becomes its own."""
        if self.entering_own is not None:
            self.load_own(self.entering_own)
            self.entering_own = None

    def forget_before(self, step: int) -> None:
        """Own states older than the oldest kept replica round can no longer be restored to."""
        for old in [s for s in self.own if s < step]:
            del self.own[old]

    def buffers(self) -> dict[str, Tensor]:
        return {name: b.detach().clone() for name, b in self.strategy.lightning_module.named_buffers()}

    def load_own(self, own: dict) -> None:
        self.load_buffers(own["buffers"])
        self.strategy.adapter.load_rank_state(copy.deepcopy(own["rank"]))  # the kept copy may be needed again

    def load_buffers(self, buffers: dict[str, Tensor]) -> None:
        named = dict(self.strategy.lightning_module.named_buffers())
        with torch.no_grad():
            for name, value in buffers.items():
                named[name].copy_(value)

    def restore_incoming_parameters(self) -> None:
        """A spare, as Lightning restores the model: the received parameter shards into the sharded model."""
        shard_state.restore(self.strategy.lightning_module, None, {"params": self.incoming["params"], "optim": {}})

    def restore_incoming_optimizer(self, optimizer_states: list[dict[str, Any]]) -> None:
        """Then, as Lightning restores the optimizers: the received optimizer shard and the hyperparameters."""
        s, incoming, self.incoming = self.strategy, self.incoming, None
        for optimizer, state in zip(s.optimizers, optimizer_states, strict=True):
            set_hyperparameters(optimizer, state["param_groups"])
        shard_state.restore(s.lightning_module, s.optimizers[0], {"params": {}, "optim": incoming["optim"]})

    def capture_shard(self) -> dict:
        s = self.strategy
        optimizer = s.optimizers[0] if s.optimizers else None
        return shard_state.capture(s.lightning_module, optimizer, self.skipped_parameters())

    def host_now(self) -> dict:
        """Loop progress (this boundary's snapshot) and scheduler state: restored with the shards."""
        s = self.strategy
        schedulers = [c.scheduler.state_dict() for c in s.lightning_module.trainer.lr_scheduler_configs]
        groups = [hyperparameters(optimizer) for optimizer in s.optimizers]
        return copy.deepcopy({"loops": s.runtime.boundary_record, "schedulers": schedulers, "param_groups": groups})

    def host_at(self, step: int) -> dict:
        if step in self.strategy.replicator.own:
            return self.strategy.replicator.own[step].host
        return self.host_now()  # the live boundary (no rank was lost, so no replica was needed)

    def host_checkpoint(self, step: int) -> dict:
        """Everything a spare needs besides the shards: Lightning's checkpoint without model and optimizer."""
        with self._handing_over():
            checkpoint = dump_checkpoint(self.strategy.lightning_module.trainer)
        host = self.host_at(step)
        checkpoint["loops"]["fit_loop"] = host["loops"]
        checkpoint["lr_schedulers"] = host["schedulers"]
        checkpoint["optimizer_states"] = [{"param_groups": groups} for groups in host["param_groups"]]
        return checkpoint

    @contextmanager
    def _handing_over(self):
        self.handing_over = True
        try:
            yield
        finally:
            self.handing_over = False


def save_sharded_checkpoint(strategy: TorchPassFSDPStrategy, checkpoint: dict[str, Any], path: Path) -> None:
    """A directory: every rank writes its shards through torch DCP, rank 0 the rest of the checkpoint."""
    model, optimizers = get_state_dict(strategy.lightning_module, strategy.optimizers)
    dcp.save({"model": model, "optimizers": optimizers}, checkpoint_id=path)
    # DCP keeps one copy of a tensor that is not sharded, and buffers differ between ranks (BatchNorm
    # statistics): each rank writes its own beside the shards.
    torch.save(strategy.sharded.buffers(), path / RANK_BUFFERS.format(rank=strategy.global_rank))
    if strategy.is_global_zero:
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        torch.save(rest, path / CHECKPOINT_META)


def load_sharded_checkpoint(strategy: TorchPassFSDPStrategy, path: Path) -> dict[str, Any]:
    """Load a directory written by :func:`save_sharded_checkpoint` into the shards; returns the rest."""
    model, optimizers = get_state_dict(strategy.lightning_module, strategy.optimizers)
    dcp.load({"model": model, "optimizers": optimizers}, checkpoint_id=path)
    set_state_dict(strategy.lightning_module, strategy.optimizers, model_state_dict=model, optim_state_dict=optimizers)
    own = path / RANK_BUFFERS.format(rank=strategy.global_rank)
    if own.is_file():
        strategy.sharded.load_buffers(torch.load(own, weights_only=True))
    checkpoint = torch.load(path / CHECKPOINT_META, weights_only=False)
    checkpoint.update(state_dict={}, optimizer_states=[])
    return checkpoint
