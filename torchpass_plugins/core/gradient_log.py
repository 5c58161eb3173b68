"""The gradient log of fully sharded training: a lost shard rebuilt as of the step the job is at.

A ring replica is a rank's shard state as of some step boundary, and it is copied in the background, so
it can be a step or more behind (``replicate_every_n_steps > 1``, or a round still in flight). Every
optimizer step, before the commit vote, each rank also hands its ring successor what that step applied to
its shard: the gradient as the optimizer took it (reduced, unscaled, clipped) and its parameter groups'
hyperparameters, a shard-sized message. The optimizer step is deterministic, so the successor can replay
the steps since its replica on a copy of it and produce the lost shard as of any later boundary whose
steps it logged. Since a rank enters the vote only after that exchange, a step that some rank applied is
one whose gradient every successor holds: the survivors never roll back (:mod:`sharded_recovery`). The
replica only bounds the length of the replay.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchpass_plugins.core.training_state import MODEL, OPTIMIZER, local_part


def applied_gradient(optimizer: Optimizer, names: dict[int, str], skip: frozenset[str]) -> dict[str, Any]:
    """What ``optimizer`` is about to apply to this rank's shard (called just before its step): the local
    part of each gradient by parameter name (views: the exchange packs them before the step), and each
    group's hyperparameters."""
    grads = {names[id(p)]: local_part(p.grad).detach()
             for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None and names[id(p)] not in skip}
    return {"grads": grads, "groups": hyperparameters(optimizer)}


# torch.optim's optimizers whose step is elementwise within each tensor, so a step replayed on one local
# shard gives the live values. Others reduce over a whole parameter (LAMB, Adafactor's factored moments,
# Shampoo, Muon) or across parameters (LBFGS), which a shard alone cannot.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
                torch.optim.ASGD)


def replay_refusal(optimizer: Optimizer, scaled: bool) -> str | None:
    """Why the holder's replay could not take ``optimizer``'s steps as the live run does (``scaled``: a loss
    scaler is in use), or ``None``. Only a step that is elementwise within each tensor can be replayed one
    local shard at a time (a subclass that keeps its base's step is one). A fused step takes the loss scale
    inside the step, after the commit has logged the gradient still scaled; a capturable or differentiable
    step needs state the replay does not rebuild (a graph, CUDA step counts)."""
    name, defaults = type(optimizer).__name__, optimizer.defaults
    if _step_of(type(optimizer)) not in {_step_of(cls) for cls in _ELEMENTWISE}:
        known = ", ".join(cls.__name__ for cls in _ELEMENTWISE)
        return (f"{name}'s step is not one the ring neighbour can replay on a shard (it may take norms over a "
                f"whole parameter); use one of torch.optim's {known}")
    if scaled and defaults.get("fused"):
        return (f"{name}(fused=True) unscales the gradients inside its step, so the ring neighbour's log of "
                f"them would be scaled; with a loss scaler (precision='16-mixed') use {name}(fused=False)")
    for flag in ("capturable", "differentiable"):
        if defaults.get(flag):
            return f"{name}({flag}=True) cannot be replayed by the ring neighbour; leave {flag} off"
    return None


def _step_of(cls: type) -> Any:
    """The function ``cls.step`` runs (torch wraps each optimizer class's ``step`` in a profiling hook)."""
    return inspect.unwrap(cls.step)


def hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def producible(replica_steps: list[int], logged: set[int]) -> tuple[int, int] | None:
    """The boundaries the holder can bring its predecessor's shard to, as ``(first, last)``: from its newest
    replica, or an older one whose logged steps reach past it, on through every logged step."""
    best = None
    for start in sorted(replica_steps):
        end = start
        while end in logged:
            end += 1
        if best is None or end > best[1]:
            best = (start, end)
    return best


def replay(shard: dict[str, Any], steps: list[dict[str, Any]], like: Optimizer) -> dict[str, Any]:
    """The shard state ``shard`` (the model and optimizer parts, local host tensors) after the logged
    ``steps``, stepped by an optimizer of ``like``'s class and defaults (the lost rank's: every rank builds
    the same); a step logged without gradients (a loss scaler skipped it) changes nothing.

    The replay runs where ``like`` runs: on its parameters' device, each state entry where ``like`` keeps
    it (Adam's step count stays on the host beside CUDA moments). A CUDA step and a host step of the same
    optimizer round differently (other kernels: foreach against per-tensor, fused multiply-adds), so only
    the live run's placement gives the live run's bits."""
    device, kept = placement(like)
    params = {name: nn.Parameter(value.to(device, copy=True), requires_grad=value.is_floating_point())
              for name, value in shard[MODEL].items() if isinstance(value, torch.Tensor)}
    saved = shard[OPTIMIZER]
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [params[n] for n in g["params"] if n in params]} for g in saved["param_groups"]]
    optimizer = type(like).__new__(type(like))
    Optimizer.__init__(optimizer, groups, dict(like.defaults))  # not the class's own: its signature is its own
    for name, state in saved["state"].items():
        if name in params:
            optimizer.state[params[name]] = {
                k: v.to(kept.get(k, device if v.dim() else v.device), copy=True) if isinstance(v, torch.Tensor)
                else v for k, v in state.items()}
    for step in steps:
        for group, hyper in zip(optimizer.param_groups, step["groups"], strict=True):
            group.update(hyper)
        if step["grads"] is None:
            continue
        for name, p in params.items():
            grad = step["grads"].get(name)
            p.grad = None if grad is None else grad.to(device)
        optimizer.step()
    home = {name: value.device for name, value in shard[MODEL].items() if isinstance(value, torch.Tensor)}
    model = {**shard[MODEL], **{name: p.detach().to(home[name]) for name, p in params.items()}}
    state = {name: {k: v.to(home[name]) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
             for name, p in params.items() if p in optimizer.state}
    names = [g["params"] for g in saved["param_groups"]]
    return {**shard, MODEL: model, OPTIMIZER: {
        "state": state,
        "param_groups": [{**hyper, "params": n} for hyper, n in zip(hyperparameters(optimizer), names, strict=True)]}}


def placement(optimizer: Optimizer) -> tuple[torch.device, dict[str, torch.device]]:
    """Where ``optimizer`` works: its parameters' device, and the device of each state entry it keeps."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = local_part(params[0]).device if params else torch.device("cpu")
    state = next(iter(optimizer.state.values()), {})
    kept = {k: local_part(v).device for k, v in state.items() if isinstance(v, torch.Tensor)}
    return device, kept
