"""Moving a nested training state (dicts of tensors and small Python values) between two ranks.

The structure travels as a small pickle; tensor bytes travel as one flat buffer over the process
group, never through pickle or the store. A header with both sizes goes first, so the receiver allocates
exactly what is sent (gloo aborts a process on a size mismatch, so the sizes are never guessed).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from torchpass_plugins.transport import Transport
from torchpass_plugins.tree import map_leaves


@dataclass(frozen=True)
class _TensorRef:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def _strip(state: Any, chunks: list[torch.Tensor]) -> Any:
    offset = 0

    def ref(obj: Any) -> Any:
        nonlocal offset
        if not isinstance(obj, torch.Tensor):
            return obj
        flat = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        chunks.append(flat)
        offset += flat.numel()
        return _TensorRef(offset - flat.numel(), flat.numel(), obj.dtype, tuple(obj.shape), obj.requires_grad)

    return map_leaves(state, ref)


def _fill(skeleton: Any, payload: torch.Tensor) -> Any:
    def tensor(obj: Any) -> Any:
        if not isinstance(obj, _TensorRef):
            return obj
        t = payload[obj.offset : obj.offset + obj.nbytes].clone().view(obj.dtype).reshape(obj.shape)
        return t.requires_grad_(obj.requires_grad) if obj.requires_grad else t

    return map_leaves(skeleton, tensor)


def pack(state: Any, into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (structure as uint8 pickle, all tensor bytes as one uint8 buffer); the bytes go into ``into``
    when it has exactly their size (a buffer reused across rounds costs no fresh pages)."""
    chunks: list[torch.Tensor] = []
    skeleton = _strip(state, chunks)
    meta = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
    if into is not None and into.numel() == sum(c.numel() for c in chunks):
        payload = torch.cat(chunks, out=into) if chunks else into
    else:
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
