"""A version's copy into a publisher's host buffer, started during the step and finished before the
optimizer step changes the parameters: host tensors are copied by a thread of the idle scheduling class
(it runs where the core would otherwise wait, as in a collective), device tensors on a side stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from torchpass_plugins.core.host_copy import side_stream
from torchpass_plugins.core.idle_copy import IdleCopy, pieces
from torchpass_plugins.weights import wire


@dataclass
class Staging:
    owner: Any  # what the buffer belongs to (the publisher's copy; its ``plan`` keeps the pieces to copy)
    idle: IdleCopy | None
    device_done: list[torch.cuda.Event] = field(default_factory=list)

    @classmethod
    def start(cls, owner: Any, buffer: torch.Tensor, entries: list[wire.Entry], state: dict[str, torch.Tensor],
              later: set[int]) -> Staging:
        """Tensors in ``later`` (by address: the parameters) are copied in the background, host ones of the
        published dtype by the idle thread, device ones on a side stream into pinned memory; the rest (the
        buffers, which the next forward pass may change, and casts) is copied here, before this returns."""
        idle_sources, device_done = [], []
        with torch.no_grad():
            for entry, tensor in zip(entries, state.values(), strict=True):
                tensor = tensor.detach()
                if (tensor.data_ptr() in later and tensor.device.type == "cpu"
                        and str(tensor.dtype).removeprefix("torch.") == entry.dtype and tensor.is_contiguous()):
                    idle_sources.append((entry.offset, tensor.reshape(-1).view(torch.uint8)))
                    continue
                dst = wire.view(buffer, entry)
                if tensor.is_cuda and tensor.data_ptr() in later:
                    stream = side_stream(tensor.device)
                    stream.wait_stream(torch.cuda.current_stream(tensor.device))
                    with torch.cuda.stream(stream):
                        dst.copy_(tensor, non_blocking=True)
                    tensor.record_stream(stream)
                    device_done.append(stream.record_event())
                else:
                    dst.copy_(tensor)
        if not idle_sources:
            return cls(owner, None, device_done)
        sources = tuple((offset, src.data_ptr(), src.numel()) for offset, src in idle_sources)
        if owner.plan is None or owner.plan[0] != sources:  # (the same tensors as last time: the same pieces)
            owner.plan = (sources, pieces(buffer, idle_sources))
        return cls(owner, IdleCopy(owner.plan[1], roam=True), device_done)  # (only this rank copies)

    def finish(self, grace_s: float) -> bool:
        """Copy what is left; False when the idle thread held a piece longer than ``grace_s`` (it may still
        write into the buffer, which must then be neither served nor reused)."""
        for event in self.device_done:
            event.synchronize()
        return self.idle is None or self.idle.finish(grace_s)
