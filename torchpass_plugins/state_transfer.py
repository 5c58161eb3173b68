"""Moving a nested training state (dicts of tensors and small Python values) between two ranks.

The structure travels as a small pickle; tensor bytes travel as one flat buffer over the process
group, never through pickle or the store. A header with both sizes goes first, so the receiver allocates
exactly what is sent (gloo aborts a process on a size mismatch, so the sizes are never guessed).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchpass_plugins.transport import Transport


@dataclass(frozen=True)
class _TensorRef:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def _strip(obj: Any, chunks: list[torch.Tensor], offset: list[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        ref = _TensorRef(offset[0], flat.numel(), obj.dtype, tuple(obj.shape), obj.requires_grad)
        chunks.append(flat)
        offset[0] += flat.numel()
        return ref
    if isinstance(obj, Mapping):
        return type(obj)((k, _strip(v, chunks, offset)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_strip(v, chunks, offset) for v in obj)
    return obj


def _fill(obj: Any, payload: torch.Tensor) -> Any:
    if isinstance(obj, _TensorRef):
        raw = payload[obj.offset : obj.offset + obj.nbytes].clone()
        t = raw.view(obj.dtype).reshape(obj.shape)
        return t.requires_grad_(obj.requires_grad) if obj.requires_grad else t
    if isinstance(obj, Mapping):
        return type(obj)((k, _fill(v, payload)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_fill(v, payload) for v in obj)
    return obj


def pack(state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (structure as uint8 pickle, all tensor bytes as one uint8 buffer)."""
    chunks: list[torch.Tensor] = []
    skeleton = _strip(state, chunks, [0])
    meta = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return meta, payload


def unpack(meta: torch.Tensor, payload: torch.Tensor) -> Any:
    return _fill(pickle.loads(meta.numpy().tobytes()), payload)


def send_state(transport: Transport, state: Any, dst: int) -> int:
    """Send ``state`` to rank ``dst``; returns the bytes moved."""
    return send_packed(transport, *pack(state), dst)


def send_packed(transport: Transport, meta: torch.Tensor, payload: torch.Tensor, dst: int) -> int:
    """Send what :func:`pack` made (received by :func:`recv_state`); returns the bytes moved."""
    transport.send(torch.tensor([meta.numel(), payload.numel()], dtype=torch.int64), dst)
    transport.send(meta, dst)
    if payload.numel():
        transport.send(payload, dst)
    return meta.numel() + payload.numel()


def recv_state(transport: Transport, src: int) -> tuple[Any, int]:
    header = torch.empty(2, dtype=torch.int64)
    transport.recv(header, src)
    meta = torch.empty(int(header[0]), dtype=torch.uint8)
    payload = torch.empty(int(header[1]), dtype=torch.uint8)
    transport.recv(meta, src)
    if payload.numel():
        transport.recv(payload, src)
    return unpack(meta, payload), meta.numel() + payload.numel()
