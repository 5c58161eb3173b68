"""Device tensors copied to host memory without holding up the training stream.

State leaves the GPU for three reasons: a spare's hand-over (sent over gloo from host memory), ring
replicas of FSDP shards, and snapshots. A plain ``tensor.cpu()`` copies on the caller's current stream and
makes the host wait for everything queued before it, tensor by tensor. :func:`to_host` instead queues every
copy on one side stream per device (ordered after the work already queued on the current stream, so each
copy sees the tensor's latest values), into page-locked (pinned) memory so the copies run as DMA, and
waits once, for that stream's event, at the end. CPU tensors are returned as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device for copies to the host, beside the training stream."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def to_host(tensors: Sequence[torch.Tensor], into: Sequence[torch.Tensor | None] = (),
            copy: bool = False) -> list[torch.Tensor]:
    """Host copies of ``tensors``, into ``into[i]`` where its shape and dtype match (reused memory); CPU
    tensors are returned as they are unless ``copy`` (a snapshot, which must not change as training goes
    on). Returns once every copy has landed."""
    out: list[torch.Tensor] = []
    pending: dict[torch.device, torch.cuda.Event] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.device.type == "cpu" and not copy:
            out.append(t)
            continue
        target = into[i] if i < len(into) else None
        if target is None or target.shape != t.shape or target.dtype != t.dtype:
            target = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        out.append(target)
        if not t.is_cuda:
            target.copy_(t)
            continue
        stream = side_stream(t.device)
        if t.device not in pending:
            stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            target.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the caller may drop ``t`` before the copy ran: keep its memory until then
        pending[t.device] = stream.record_event()
    for event in pending.values():
        event.synchronize()
    return out
