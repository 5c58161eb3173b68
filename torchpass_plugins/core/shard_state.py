"""A rank's shard state (what fully sharded training keeps nowhere else): local parameter shards and
optimizer state, as plain tensors keyed by parameter position, so that it can be packed, replicated and
loaded into another process whose parameters are DTensors of the same layout."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its chunk of a sharded tensor, else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def capture(module: nn.Module, optimizer: Optimizer | None, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """This rank's shards as plain local tensors (the live ones: packing copies them); ``skip`` names
    parameters whose state need not move (model-aware mode)."""
    with torch.no_grad():  # ``to_local`` outside autograd: a quarter of its cost, paid by the training thread
        params = {n: local_part(p) for n, p in module.named_parameters() if n not in skip}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        if optimizer is not None:
            names = {id(p): n for n, p in module.named_parameters()}
            for p, state in optimizer.state.items():
                name = names.get(id(p))
                if name is not None and name not in skip:
                    optim[name] = {k: local_part(v) for k, v in state.items() if torch.is_tensor(v)}
    return {"params": params, "optim": optim}


def restore(module: nn.Module, optimizer: Optimizer | None, state: dict[str, Any]) -> None:
    """Load ``state`` (from :func:`capture`, here or on a lost rank's predecessor) into the shards."""
    named = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state["params"].items():
            local_part(named[name]).copy_(value)
        if optimizer is None:
            return
        for name in state["params"].keys() - state["optim"].keys():
            optimizer.state.pop(named[name], None)  # a state from before this parameter's first step: none
        for name, values in state["optim"].items():
            p = named[name]
            slot = optimizer.state[p]
            for key, value in values.items():
                if isinstance(slot.get(key), torch.Tensor):
                    local_part(slot[key]).copy_(value)
                elif isinstance(p, DTensor) and value.shape == local_part(p).shape and value.dim() > 0:
                    slot[key] = DTensor.from_local(value.clone(), p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
                else:
                    slot[key] = value.clone()
