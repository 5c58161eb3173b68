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
