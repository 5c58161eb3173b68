"""What a Lightning job's snapshot holds, in one shape for both strategies, and how it is put back.

A snapshot is a dict of named parts, written with torch Distributed Checkpoint
(:mod:`torchpass_plugins.storage.snapshot_store`):

- ``model`` and ``optim``: torch's distributed state dicts (``get_model_state_dict``,
  ``get_optimizer_state_dict``), keyed by parameter name and sharded as the job holds them, so that a job
  of another size loads them resharded;
- ``trainer``: the rest of Lightning's checkpoint (loop progress, schedulers, callbacks, precision), as
  one value;
- ``rank{r}``: what rank ``r`` holds that no other rank does, where the strategy keeps such state
  (``torchpass_fsdp``: its module buffers, logged values and metric states), as one value.

Lightning restores the model before the strategy sets up and the optimizers after, so a resumed snapshot
is put back in three moments (:class:`ResumedSnapshot`).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from torchpass_plugins.core.shard_state import local_part
from torchpass_plugins.storage.snapshot_store import Manifest, SnapshotCorrupted, SnapshotStore


def _pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def capture(module: nn.Module, optimizers: list[Optimizer], rank: int, trainer_state: dict[str, Any],
            own: Any = None, model: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, Any], set[int]]:
    """The snapshot's parts at a step boundary (``model``: values to use instead of the live ones, e.g.
    buffers as they were at the boundary), and the local ``data_ptr`` of each parameter and optimizer
    state tensor: unchanged until the optimizer step, so copied in the background."""
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    state["model"].update(model or {})
    if optimizers:
        state["optim"] = get_optimizer_state_dict(module, optimizers)
    state["trainer"] = _pack(trainer_state)
    if own is not None:
        state[f"rank{rank}"] = _pack(own)
    with torch.no_grad():
        stable = {local_part(p).data_ptr() for p in module.parameters()}
        stable |= {local_part(t).data_ptr() for optimizer in optimizers for per_param in optimizer.state.values()
                   for t in per_param.values() if isinstance(t, torch.Tensor)}
    return state, stable


class ResumedSnapshot:
    """A verified snapshot this rank resumes from: Lightning's state and this rank's own state now, the
    model and the optimizers as Lightning restores them, in the layout this job has."""

    def __init__(self, store: SnapshotStore, manifest: Manifest, rank: int) -> None:
        self.store, self.manifest = store, manifest
        own = f"rank{rank}"
        parts: dict[str, Any] = {"trainer": b"", own: b""}
        store.read(manifest, parts, missing_ok=True)  # no own state: a rank the writing job did not have
        if not parts["trainer"]:
            raise SnapshotCorrupted(f"{store.url}: the snapshot of step {manifest.step} has no trainer state")
        self.trainer: dict[str, Any] = _unpack(parts["trainer"])
        self.own: Any = _unpack(parts[own]) if parts[own] else None

    def load_model(self, module: nn.Module) -> None:
        state = {"model": get_model_state_dict(module)}
        self.store.read(self.manifest, state)
        set_model_state_dict(module, state["model"])

    def load_optimizers(self, module: nn.Module, optimizers: list[Optimizer]) -> None:
        if not optimizers:
            return
        state = {"optim": get_optimizer_state_dict(module, optimizers)}
        self.store.read(self.manifest, state)
        set_optimizer_state_dict(module, optimizers, state["optim"])
