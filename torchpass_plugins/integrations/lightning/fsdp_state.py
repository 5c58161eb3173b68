"""What ``torchpass_fsdp`` keeps of each rank's state, and how it is captured and put back.

Under fully sharded training no peer holds a rank's shard, so three things are kept per rank: the shard
itself (ring replicas, :mod:`torchpass_plugins.core.ring_replication`), the rank's *own* state (module
buffers, which FSDP keeps per rank, e.g. BatchNorm statistics, plus logged values and metric states), and
the *host* part every rank shares (loop progress, schedulers, the gradient scaler's state), restored with
the shards. A spare receives all three; a survivor that rolls back restores them in memory.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torchpass_plugins._compat.lightning import load_rank_local_state, rank_local_state
from torchpass_plugins.core.training_state import (
    MODEL,
    OPTIMIZER,
    OWN,
    TRAINER,
    Held,
    ModelState,
    OptimizerState,
    Stateful,
    stable_pointers,
)
from torchpass_plugins.integrations.lightning.state_parts import TrainerState
from torchpass_plugins.storage.snapshot_parts import snapshot_values

if TYPE_CHECKING:
    from torchpass_plugins.integrations.lightning.fsdp import TorchPassFSDPStrategy


def trainable_only(name: str, param: nn.Parameter) -> bool:
    """A model-aware ``state_filter``: frozen parameters never change, so their shards need not move."""
    return param.requires_grad


class ShardedState:
    """One rank's kept state under ``torchpass_fsdp``, at recent step boundaries; itself the rank's ``own``
    part (:meth:`state_dict`)."""

    def __init__(self, strategy: TorchPassFSDPStrategy) -> None:
        self.strategy = strategy
        self.own: dict[int, dict] = {}  # this rank's own state at recent boundaries (:meth:`state_dict`)
        self.entering_own: dict | None = None  # a spare's: the lost rank's, adopted at its first boundary

    def parts(self, complete: bool, step: int) -> dict[str, Stateful]:
        """The training state: the live model, optimizer and own parts (read them at a boundary), and the
        trainer part as of boundary ``step`` (a rollback's restore step may be older than the live state; the
        own part of a kept step is ``self.own[step]``). ``complete`` (a snapshot, the last resort): every
        parameter and the buffers in the model part; else what moves between ranks: the parameters
        ``state_filter`` keeps (buffers differ between ranks: they are this rank's ``own`` part, this object)."""
        s = self.strategy
        module, skip = s.lightning_module, frozenset() if complete else self.skipped_parameters()
        return {MODEL: ModelState(module, skip, buffers=complete),
                OPTIMIZER: OptimizerState(module, s.optimizers, skip),
                TRAINER: TrainerState(s, lambda: self.host_at(step)), OWN: self}

    def snapshot(self, step: int) -> tuple[dict[str, Any], set[int]]:
        """A snapshot's values of boundary ``step`` (every rank writes its shards and its own state), and the
        tensors that stay unchanged until the optimizer step."""
        s = self.strategy
        parts = {**self.parts(complete=True, step=step), OWN: Held(self.own[step])}
        return snapshot_values(parts, s.global_rank), stable_pointers(s.lightning_module, s.optimizers)

    def skipped_parameters(self) -> frozenset[str]:
        """Model-aware mode: the parameters ``state_filter`` leaves out of replicas and hand-overs."""
        s = self.strategy
        if s.state_filter is None:
            return frozenset()
        return frozenset(n for n, p in s.lightning_module.named_parameters() if not s.state_filter(n, p))

    def state_dict(self) -> dict:
        """What differs between ranks besides the shard: module buffers and the logged values and metric
        states. Copied, because the step's forward changes them in place: a retried or rolled-back step
        starts again from this copy, and a spare from its predecessor's, which the ring replica carries."""
        logged = rank_local_state(self.strategy.lightning_module.trainer)
        return {"buffers": self.buffers(), "rank": copy.deepcopy(logged)}

    def load_state_dict(self, own: dict) -> None:
        self.load_buffers(own["buffers"])
        # a deep copy: the kept copy may be needed again
        load_rank_local_state(self.strategy.lightning_module.trainer, copy.deepcopy(own["rank"]))

    def adopt_entering_own(self) -> None:
        """A spare at its first boundary: the lost rank's own state, received with its shard, becomes its own."""
        if self.entering_own is not None:
            self.load_state_dict(self.entering_own)
            self.entering_own = None

    def forget_before(self, step: int) -> None:
        """Own states older than the oldest kept replica round can no longer be restored to."""
        for old in [s for s in self.own if s < step]:
            del self.own[old]

    def buffers(self) -> dict[str, Tensor]:
        return {name: b.detach().clone() for name, b in self.strategy.lightning_module.named_buffers()}

    def load_buffers(self, buffers: dict[str, Tensor]) -> None:
        named = dict(self.strategy.lightning_module.named_buffers())
        with torch.no_grad():
            for name, value in buffers.items():
                named[name].copy_(value)

    def host_now(self) -> dict:
        """What every rank holds alike and each step changes besides the shards, as of this boundary: loop
        progress, schedulers and the precision plugin's state (the gradient scaler's). Restored with the
        shards, so that a step run again leaves no trace of its first run in them."""
        s = self.strategy
        trainer = s.lightning_module.trainer
        return copy.deepcopy({
            "loops": s.runtime.boundary_record,
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "precision": trainer.precision_plugin.state_dict(),
        })

    def restore_host(self, host: dict) -> None:
        """A survivor rolling back: schedulers and precision as of :meth:`host_now` (the loops are rewound
        apart)."""
        trainer = self.strategy.lightning_module.trainer
        for config, state in zip(trainer.lr_scheduler_configs, host["schedulers"], strict=True):
            config.scheduler.load_state_dict(state)
        trainer.precision_plugin.load_state_dict(copy.deepcopy(host["precision"]))

    def host_at(self, step: int) -> dict:
        if step in self.strategy.replicator.own:
            return self.strategy.replicator.own[step].host
        return self.host_now()  # the live boundary (no rank was lost, so no replica was needed)
