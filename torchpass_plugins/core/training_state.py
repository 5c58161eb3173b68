"""The training state in one shape for every mechanism that moves it: peer transfer to a spare, ring
replicas of shards, snapshots.

An integration hands the engine a dict of named *parts*, each ``Stateful`` as torch Distributed Checkpoint
defines it (``state_dict()`` / ``load_state_dict()``), as torchtitan's checkpointer does:

- ``model`` (:class:`ModelState`): parameters (and buffers, where every rank holds the same) by name;
- ``optim`` (:class:`OptimizerState`): optimizer state by parameter name and the groups' hyperparameters;
- ``trainer``: the rest of the framework's state (loop progress, schedulers, callbacks, data position);
- ``own``: what only this rank holds (logged values, metric states; per-rank buffers under FSDP).

Values are held as the job holds them: a sharded parameter is a ``DTensor`` (the transports send its
local part, :func:`local_parts`; snapshots write it sharded). A spare loads the parts it receives; a
snapshot loads the same parts, resharded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from torchpass_plugins.core.tree import map_leaves
from torchpass_plugins.errors import ConfigError

MODEL, OPTIMIZER, TRAINER, OWN = "model", "optim", "trainer", "own"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def capture(parts: Mapping[str, Stateful], leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every part's values, but those named in ``leave_out`` (live tensors: a mechanism copies them)."""
    return {name: part.state_dict() for name, part in parts.items() if name not in leave_out}


class Held:
    """A part's values as received, handed on as they are (a spare that cannot load them yet)."""

    def __init__(self, values: Any) -> None:
        self.values = values

    def state_dict(self) -> Any:
        return self.values

    def load_state_dict(self, state: Any) -> None:
        self.values = state


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its chunk of a sharded tensor, else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_parts(values: Any) -> Any:
    """``values`` with every sharded tensor replaced by this rank's chunk, as peer transfer sends it."""
    with torch.no_grad():  # ``to_local`` outside autograd: a quarter of its cost, paid by the training thread
        return map_leaves(values, lambda v: local_part(v) if isinstance(v, torch.Tensor) else v)


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    local_part(target).copy_(local_part(value))


class ModelState:
    """A module's parameters by name (``skip``: parameters whose state need not move, e.g. frozen ones),
    and with ``buffers`` its persistent buffers and extra states; ``at_boundary()`` gives values to hand
    out instead of the live ones (buffers as they were at the step boundary, where the step's forward has
    moved them on). Building one costs nothing: it reads the module only when asked."""

    def __init__(self, module: nn.Module, skip: frozenset[str] = frozenset(), buffers: bool = True,
                 at_boundary: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> None:
        self.module, self.skip, self.buffers, self.at_boundary = module, skip, buffers, at_boundary

    def _targets(self) -> dict[str, torch.Tensor]:
        named = self.module.state_dict()
        if not self.buffers:
            kept = {name for name, _ in self.module.named_parameters()}
            named = {name: t for name, t in named.items() if name in kept}
        return {name: t for name, t in named.items() if name not in self.skip}

    def state_dict(self) -> dict[str, torch.Tensor]:
        at_boundary = self.at_boundary() if self.at_boundary is not None else {}
        return {name: at_boundary.get(name, t) for name, t in self._targets().items()}

    def loading_template(self, stored: Callable[[], Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Where to load a stored model part into: this job's own tensors (DCP loads in place, resharded)."""
        return self.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        targets = self._targets()
        if state.keys() != targets.keys():
            missing, unexpected = sorted(targets.keys() - state.keys()), sorted(state.keys() - targets.keys())
            raise RuntimeError(f"torchpass: the model state does not fit this model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]} (is every rank running the same model?)")
        with torch.no_grad():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    _copy_into(targets[name], value)
        extra = {name: value for name, value in state.items() if not isinstance(value, torch.Tensor)}
        if extra:  # a module's extra state (``get_extra_state``): the module sets it itself
            self.module.load_state_dict(extra, strict=False)


class OptimizerState:
    """The state of ``optimizers`` keyed by parameter name, and their param groups' hyperparameters, in the
    layout of torch's ``get_optimizer_state_dict`` (so snapshots are DCP checkpoints other tools read),
    built without its side effect: torch steps an optimizer that has no state yet once, with a learning
    rate of 0, to create the state, which would change the run (Adam's step count) on the rank that asks."""

    def __init__(self, module: nn.Module, optimizers: list[Optimizer], skip: frozenset[str] = frozenset()) -> None:
        self.module, self.optimizers, self.skip = module, optimizers, skip

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_parameters())

    @property
    def names(self) -> dict[int, str]:
        """Each optimized parameter's name in the module (the key its state travels under)."""
        names = {id(p): name for name, p in self.params.items()}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                if any(id(p) not in names for p in group["params"]):
                    raise ConfigError(
                        "torchpass: an optimizer holds a parameter that is not one of the module's (its state "
                        "travels by parameter name); build the optimizers from the LightningModule's parameters")
        return names

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, dict[str, Any]] = {}
        groups, by_id = [], self.names
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                names = [by_id[id(p)] for p in group["params"]]
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
                for name, p in zip(names, group["params"], strict=True):
                    if name not in self.skip and p in optimizer.state:
                        state[name] = dict(optimizer.state[p])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, values: Mapping[str, Any]) -> None:
        """Every parameter (but skipped ones) gets the state ``values`` has for it, and none where it has
        none (a parameter that had not stepped yet); each group its hyperparameters."""
        by_id = self.names
        groups = [(group, optimizer) for optimizer in self.optimizers for group in optimizer.param_groups]
        if len(groups) != len(values["param_groups"]):
            raise RuntimeError(f"torchpass: the optimizer state has {len(values['param_groups'])} parameter "
                               f"group(s), this job's optimizers {len(groups)}")
        with torch.no_grad():
            for (group, optimizer), saved in zip(groups, values["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
                for p in group["params"]:
                    name = by_id[id(p)]
                    if name in self.skip:
                        continue
                    if name not in values["state"]:
                        optimizer.state.pop(p, None)
                        continue
                    slot = optimizer.state[p]
                    for key, value in values["state"][name].items():
                        current = slot.get(key)
                        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) \
                                and local_part(current).shape == local_part(value).shape:
                            _copy_into(current, value)
                        else:
                            slot[key] = _as_held(p, key, value, group)

    def loading_template(self, stored: Callable[[], Mapping[str, tuple[torch.Size, torch.dtype] | None]]
                         ) -> dict[str, Any]:
        """Where to load a stored optimizer part into (DCP loads in place, in this job's layout): ``stored()``
        maps each of its entries (``"state.{parameter}.{key}"``, ``"param_groups.{i}.{key}"``) to a tensor's
        size and dtype, or None for another value. Only what is stored is loaded: a parameter without
        stored state gets none, a hyperparameter the checkpoint lacks keeps its value here (a scheduler's)."""
        state: dict[str, dict[str, Any]] = {}
        live, params = self.state_dict()["param_groups"], self.params
        groups: dict[int, dict[str, Any]] = {}
        for entry, described in stored().items():
            kind, _, rest = entry.partition(".")
            if kind == "param_groups":
                index, _, key = rest.partition(".")
                like = live[int(index)].get(key) if int(index) < len(live) else None
                groups.setdefault(int(index), {})[key] = _blank(described, like)
                continue
            name, _, key = rest.rpartition(".")
            p = params.get(name)
            if kind == "state" and p is not None and name not in self.skip:
                state.setdefault(name, {})[key] = _blank(described, p)
        return {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}


def load_stored(parts: Mapping[str, Any], stored: Callable[[str], Mapping[str, Any]],
                read: Callable[[dict[str, Any]], None]) -> None:
    """Load ``parts`` (model and optimizer parts, by their key in a DCP checkpoint) from it: each part's
    loading template, filled by ``read`` (DCP's load), then loaded. ``stored(prefix)`` gives the checkpoint's
    entries under a key (read only where a part needs them)."""
    into = {key: part.loading_template(lambda key=key: stored(f"{key}.")) for key, part in parts.items()}
    read(into)
    for key, part in parts.items():
        part.load_state_dict(into[key])


def _blank(described: tuple[torch.Size, torch.dtype] | None, like: Any) -> Any:
    """A value to load a stored entry into: a tensor of its size and dtype (sharded like ``like``, a
    parameter, where it has that parameter's shape), else ``like`` (DCP replaces it)."""
    if described is None:
        return like
    size, dtype = described
    if isinstance(like, DTensor) and tuple(size) == tuple(like.shape):
        return _sharded_like(like, torch.zeros(local_part(like).shape, dtype=dtype, device=local_part(like).device))
    return torch.zeros(size, dtype=dtype)


def _sharded_like(p: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as this rank's chunk of a tensor sharded as ``p`` is."""
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _as_held(p: torch.Tensor, key: str, value: Any, group: Mapping[str, Any]) -> Any:
    """``value`` of optimizer state ``key`` as the optimizer holds it for ``p``: on the parameter's device
    (the step count stays on the CPU unless the optimizer is fused or capturable, as torch loads it), a
    shard of a sharded parameter sharded like it, and in the dtype it was saved in (an optimizer may keep
    its state in another dtype than the parameter's: casting it would change the run)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        on_device = group.get("fused") or group.get("capturable")
        return value.to(device=p.device, dtype=torch.float32) if on_device else value.clone()
    if isinstance(p, DTensor) and not isinstance(value, DTensor) and value.dim() > 0 \
            and value.shape == local_part(p).shape:
        return _sharded_like(p, value.to(device=local_part(p).device).clone())
    return value.to(device=p.device).clone()


def stable_pointers(module: nn.Module, optimizers: list[Optimizer]) -> set[int]:
    """The local ``data_ptr`` of every parameter and optimizer state tensor: unchanged until the optimizer
    step, so a mechanism may copy them in the background until then."""
    with torch.no_grad():
        stable = {local_part(p).data_ptr() for p in module.parameters()}
        stable |= {local_part(t).data_ptr() for optimizer in optimizers for per_param in optimizer.state.values()
                   for t in per_param.values() if isinstance(t, torch.Tensor)}
    return stable
