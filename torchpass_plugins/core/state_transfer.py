"""Moving a nested training state (dicts of tensors and small Python values) between two ranks.

The structure travels as a small pickle; tensor bytes travel over the process group, never through pickle
or the store. The layout is that of one flat payload (every tensor at an offset aligned to 64 bytes), cut
into *segments*: each large tensor is its own segments (pieces of at most 8 MiB), and each run of small
tensors is one segment. The sender sends every large tensor in place, from its own memory (no copy), and
copies each run of small tensors into one staging buffer. The first message carries the sizes and the
structure (which lists the segments); the sender posts it and all segments at once, so gloo streams them
back to back. The receiver allocates each large tensor in its final form and receives straight into it
(posting every receive at once too), and copies the small ones out of their run's buffer: what it hands
out are ordinary, separate tensors. Gloo aborts a process on a size mismatch, so the receiver learns every
size from what was sent before it posts a receive. A receiver that knew the large tensors' shapes in
advance (a spare, told by the donor while it idles) takes them from a :class:`Landing` it allocated and
touched then, so the transfer does not wait for the kernel to fault in fresh memory.

:func:`pack` builds the same layout in one buffer, and :func:`pack_plan` says where each tensor goes in
it for a caller that copies in its own time (ring replication, into memory its successor maps);
:func:`send_packed` sends its segments as slices of such a buffer, and :func:`recv_state` takes either.
:func:`unpack` copies every tensor out of a packed buffer, which its caller may reuse.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchpass_plugins.core.host_copy import to_host
from torchpass_plugins.core.process_group import ReconfigurableGroup
from torchpass_plugins.core.tree import map_leaves, tensors_in

_ALIGN = 64  # every tensor starts at a multiple of this in the payload (any dtype can view it)
_SMALL = 1 << 18  # tensors below this many bytes travel coalesced, one segment per run of them
_PIECE = 1 << 23  # a large tensor travels in segments of at most this many bytes
_FIRST = 1 << 15  # the first message: int64 fields (sizes), then as much of the structure as fits


@dataclass(frozen=True)
class _TensorRef:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True)
class _Segment:
    """Payload bytes [offset, offset + length) of one message: a piece of one large tensor (``direct``),
    or a run of small tensors; ``members`` index the tensors in leaf order."""

    offset: int
    length: int
    members: tuple[int, ...]
    direct: bool


@dataclass(frozen=True)
class _Layout:
    skeleton: Any  # the state with every tensor replaced by its _TensorRef
    size: int  # payload bytes, padding included
    segments: tuple[_Segment, ...]


class Landing:
    """Large tensors allocated and written (every page faulted in) ahead of a transfer, taken by
    :func:`recv_state` by shape and dtype; what it does not take is freed with the landing."""

    def __init__(self, shapes: Iterable[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        for shape, dtype in shapes:
            self._free.setdefault((tuple(shape), dtype), []).append(torch.zeros(shape, dtype=dtype))

    @staticmethod
    def describe(state: Any) -> str:
        """The shapes and dtypes of ``state``'s large tensors, as a donor announces them (JSON)."""
        large = [t for t in tensors_in(state) if t.numel() * t.element_size() >= _SMALL]
        return json.dumps([[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in large])

    @classmethod
    def from_description(cls, text: str | bytes) -> Landing:
        return cls((tuple(shape), getattr(torch, dtype)) for shape, dtype in json.loads(text))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        free = self._free.get((shape, dtype))
        return free.pop() if free else None


def _strip(state: Any) -> tuple[Any, list[tuple[_TensorRef, torch.Tensor]], int]:
    """The skeleton, every tensor (with its place, as flat bytes) in leaf order, and the payload size."""
    tensors: list[tuple[_TensorRef, torch.Tensor]] = []
    offset = 0
    on_host = iter(to_host(tensors_in(state)))  # device tensors: all copied at once, off the training stream

    def ref(obj: Any) -> Any:
        nonlocal offset
        if not isinstance(obj, torch.Tensor):
            return obj
        flat = _flat_bytes(next(on_host))
        r = _TensorRef(offset, flat.numel(), obj.dtype, tuple(obj.shape), obj.requires_grad)
        tensors.append((r, flat))
        offset += -(-flat.numel() // _ALIGN) * _ALIGN
        return r

    skeleton = map_leaves(state, ref)
    return skeleton, tensors, offset


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (a CPU tensor) as a flat uint8 tensor: a view where ``t`` is contiguous (the usual
    case, so each call stays a few attribute reads: a replication round makes one per state tensor)."""
    if not t.is_contiguous():
        t = t.detach().contiguous()
    return t.detach().view(-1).view(torch.uint8) if t.requires_grad else t.view(-1).view(torch.uint8)


def _segments(refs: list[_TensorRef]) -> tuple[_Segment, ...]:
    out: list[_Segment] = []
    run: list[int] = []

    def close() -> None:
        if run:
            first, last = refs[run[0]], refs[run[-1]]
            out.append(_Segment(first.offset, last.offset + last.nbytes - first.offset, tuple(run), False))
            run.clear()

    for i, r in enumerate(refs):
        if r.nbytes == 0:
            continue
        if r.nbytes < _SMALL:
            run.append(i)
            continue
        close()
        out.extend(_Segment(r.offset + lo, min(_PIECE, r.nbytes - lo), (i,), True) for lo in range(0, r.nbytes, _PIECE))
    close()
    return tuple(out)


def _refs(skeleton: Any) -> list[_TensorRef]:
    refs: list[_TensorRef] = []
    map_leaves(skeleton, lambda obj: refs.append(obj) if isinstance(obj, _TensorRef) else None)
    return refs


def _meta(layout: _Layout) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8)


def _layout(meta: torch.Tensor) -> _Layout:
    return pickle.loads(meta.numpy().tobytes())


def _from_bytes(r: _TensorRef, data: torch.Tensor) -> torch.Tensor:
    """A new tensor holding ``data``, the bytes of ``r`` (copied)."""
    return data.clone().view(r.dtype).reshape(r.shape)


def _rebuild(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """``skeleton`` with its refs replaced by ``tensors`` (in leaf order)."""
    it = iter(tensors)

    def tensor(obj: Any) -> Any:
        if not isinstance(obj, _TensorRef):
            return obj
        t = next(it)
        return t.requires_grad_(obj.requires_grad) if obj.requires_grad else t

    return map_leaves(skeleton, tensor)


def pack_plan(state: Any) -> tuple[torch.Tensor, int, list[tuple[int, torch.Tensor]]]:
    """What :func:`pack` does, left to the caller: (structure as uint8 pickle, payload bytes, each tensor's
    flat bytes with its offset in the payload). Ring replication copies them in its own time."""
    skeleton, tensors, size = _strip(state)
    meta = _meta(_Layout(skeleton, size, _segments([r for r, _ in tensors])))
    return meta, size, [(r.offset, flat) for r, flat in tensors]


def pack(state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (structure as uint8 pickle, all tensor bytes as one uint8 buffer)."""
    meta, size, sources = pack_plan(state)
    payload = torch.empty(size, dtype=torch.uint8)
    for offset, flat in sources:
        payload[offset : offset + flat.numel()].copy_(flat)
    return meta, payload


def unpack(meta: torch.Tensor, payload: torch.Tensor) -> Any:
    """The state :func:`pack` packed, every tensor copied out of ``payload`` (which may be reused)."""
    layout = _layout(meta)
    return _rebuild(
        layout.skeleton, [_from_bytes(r, payload[r.offset : r.offset + r.nbytes]) for r in _refs(layout.skeleton)]
    )


def send_state(transport: ReconfigurableGroup, state: Any, dst: int) -> int:
    """Send ``state`` to rank ``dst`` (received by :func:`recv_state`); returns the bytes moved."""
    skeleton, tensors, size = _strip(state)
    segments = _segments([r for r, _ in tensors])
    parts = []
    for s in segments:
        if s.direct:  # in place: a slice of the tensor's own memory
            r, flat = tensors[s.members[0]]
            parts.append(flat[s.offset - r.offset : s.offset - r.offset + s.length])
            continue
        staging = torch.empty(s.length, dtype=torch.uint8)
        for i in s.members:
            r, flat = tensors[i]
            staging[r.offset - s.offset : r.offset - s.offset + r.nbytes].copy_(flat)
        parts.append(staging)
    return _send(transport, _meta(_Layout(skeleton, size, segments)), parts, dst)


def send_packed(transport: ReconfigurableGroup, meta: torch.Tensor, payload: torch.Tensor, dst: int) -> int:
    """Send what :func:`pack` made (received by :func:`recv_state`); returns the bytes moved."""
    return _send(transport, meta, [payload[s.offset : s.offset + s.length] for s in _layout(meta).segments], dst)


def frame(fields: list[int], meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first message of a transfer (``_FIRST`` bytes): ``fields`` as int64, then as much of the structure
    ``meta`` as fits; and the rest of the structure, to send apart (None when it all fits)."""
    first = torch.zeros(_FIRST, dtype=torch.uint8)
    head = len(fields) * 8
    first[:head].view(torch.int64).copy_(torch.tensor(fields, dtype=torch.int64))
    inline = min(meta.numel(), _FIRST - head)
    first[head : head + inline] = meta[:inline]
    return first, (meta[inline:] if meta.numel() > inline else None)


def first_buffer() -> torch.Tensor:
    """Where to receive the first message of a transfer (:func:`frame`)."""
    return torch.empty(_FIRST, dtype=torch.uint8)


def fields_of(first: torch.Tensor, count: int) -> list[int]:
    """The ``count`` int64 fields at the start of a first message (:func:`frame`)."""
    return first[: count * 8].view(torch.int64).tolist()


def structure_of(first: torch.Tensor, count: int, meta_n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``meta_n``-byte structure of a first message with ``count`` fields, as far as it came in it; and
    the part of it still to receive (None when it all came)."""
    meta = torch.empty(meta_n, dtype=torch.uint8)
    head = count * 8
    inline = min(meta_n, _FIRST - head)
    meta[:inline] = first[head : head + inline]
    return meta, (meta[inline:] if meta_n > inline else None)


def _send(transport: ReconfigurableGroup, meta: torch.Tensor, parts: list[torch.Tensor], dst: int) -> int:
    """The first message (sizes, and the structure if it fits), the rest of the structure, the segments:
    all posted at once, waited for together."""
    moved = sum(p.numel() for p in parts)
    first, rest = frame([meta.numel(), moved], meta)
    _transfer(transport, "send", [first, *([] if rest is None else [rest]), *parts], dst)
    return meta.numel() + moved


def recv_state(transport: ReconfigurableGroup, src: int, landing: Landing | None = None) -> tuple[Any, int]:
    """Receive what :func:`send_state` or :func:`send_packed` sent, large tensors into ``landing``'s where
    their shape and dtype match; returns (state, bytes moved)."""
    first = first_buffer()
    transport.recv_from(first, src)
    meta_n, moved = fields_of(first, 2)
    meta, rest = structure_of(first, 2, meta_n)
    if rest is not None:
        transport.recv_from(rest, src)
    layout = _layout(meta)
    refs = _refs(layout.skeleton)
    tensors: list[torch.Tensor | None] = [None] * len(refs)
    targets: list[torch.Tensor] = []

    def made() -> Iterator[torch.Tensor]:  # each target allocated just before its receive is posted
        for s in layout.segments:
            if s.direct:
                i = s.members[0]
                r = refs[i]
                if tensors[i] is None:
                    landed = landing.take(r.shape, r.dtype) if landing is not None else None
                    tensors[i] = landed if landed is not None else torch.empty(r.shape, dtype=r.dtype)
                lo = s.offset - r.offset
                targets.append(tensors[i].reshape(-1).view(torch.uint8)[lo : lo + s.length])
            else:
                targets.append(torch.empty(s.length, dtype=torch.uint8))
            yield targets[-1]

    _transfer(transport, "recv", made(), src)
    for s, data in zip(layout.segments, targets, strict=True):
        if not s.direct:
            for i in s.members:
                r = refs[i]
                tensors[i] = _from_bytes(r, data[r.offset - s.offset : r.offset - s.offset + r.nbytes])
    for i, r in enumerate(refs):
        if tensors[i] is None:  # no bytes
            tensors[i] = torch.empty(r.shape, dtype=r.dtype)
    return _rebuild(layout.skeleton, tensors), meta_n + moved


def _transfer(transport: ReconfigurableGroup, op: str, tensors: Iterable[torch.Tensor], peer: int) -> None:
    """All sends (or receives) posted at once and waited for together."""
    getattr(transport, f"{op}_many")(tensors, peer)
