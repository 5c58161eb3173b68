"""Mapping over the leaves of a nested training state (dicts, lists, tuples; named tuples are leaves)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild ``obj`` with every leaf replaced by ``fn(leaf)``, keeping container types."""
    if isinstance(obj, Mapping):
        return type(obj)((k, map_leaves(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(map_leaves(v, fn) for v in obj)
    return fn(obj)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor leaf of ``obj``, in leaf order."""
    found: list[torch.Tensor] = []
    map_leaves(obj, lambda leaf: found.append(leaf) if isinstance(leaf, torch.Tensor) else None)
    return found


def device_kinds(obj: Any) -> list[str]:
    """The device type of every tensor leaf of ``obj``, in leaf order: recorded beside a state that travels
    through host memory, so that the receiver puts each tensor back on its own device of that type."""
    return [t.device.type for t in tensors_in(obj)]


def onto_device_kinds(obj: Any, kinds: list[str]) -> Any:
    """``obj`` with each tensor leaf on this process's current device of the type ``kinds`` names for it (in
    leaf order; a type this process has no device of leaves the tensor where it is)."""
    remaining = iter(kinds)

    def place(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        kind = next(remaining)
        if kind == leaf.device.type or not _available(kind):
            return leaf
        return leaf.to(kind)  # a device type without an index: this process's current device of it

    return map_leaves(obj, place)


def _available(kind: str) -> bool:
    backend = getattr(torch, kind, None)
    return kind in ("cpu", "meta") or (backend is not None and backend.is_available())
