"""The bit-exact oracle: two runs' full states compared rank by rank, leaf by leaf.

Comparing one rank's weights misses what only one rank holds: the batch-norm statistics of a replaced rank
0, a metric's running counts, a retried step counted twice in ``num_batches_tracked``. So every rank saves
its whole state at the end (the demo's ``state_rank{r}.pt``) and every leaf must be equal: tensors bit for
bit (dtype and shape included), everything else by ``==``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Each place where ``actual`` differs from ``expected``, as ``path: what``; empty when identical."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        return _tensor_difference(expected, actual, path)
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        found = [f"{path}/{k}: missing" for k in expected if k not in actual]
        found += [f"{path}/{k}: unexpected" for k in actual if k not in expected]
        for key in expected:
            if key in actual:
                found += differences(expected[key], actual[key], f"{path}/{key}")
        return found
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{path}: {len(actual)} items instead of {len(expected)}"]
        return [
            d for i, (e, a) in enumerate(zip(expected, actual, strict=True)) for d in differences(e, a, f"{path}[{i}]")
        ]
    return [] if expected == actual else [f"{path}: {actual!r} instead of {expected!r}"]


def _tensor_difference(expected: Any, actual: Any, path: str) -> list[str]:
    if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
        return [f"{path}: {type(actual).__name__} instead of {type(expected).__name__}"]
    if (expected.dtype, expected.shape) != (actual.dtype, actual.shape):
        return [f"{path}: {actual.dtype}{list(actual.shape)} instead of {expected.dtype}{list(expected.shape)}"]
    if expected.device.type != actual.device.type:  # a state moved off its device fails where it is used next
        return [f"{path}: on {actual.device.type} instead of {expected.device.type}"]
    if torch.equal(expected, actual) or (expected.is_floating_point() and _same_bits(expected, actual)):
        return []
    if expected.is_floating_point() or expected.is_complex():
        gap = (actual.double() - expected.double()).abs().max().item()
        return [f"{path}: differs (max abs difference {gap:.3g})"]
    return [
        f"{path}: {actual.tolist() if actual.numel() <= 8 else 'differs'} instead of "
        f"{expected.tolist() if expected.numel() <= 8 else '...'}"
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaNs in the same places count as equal, which ``torch.equal`` does not)."""
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
