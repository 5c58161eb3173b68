"""Module buffers (batch-norm statistics) kept equal on every rank, as ``DistributedDataParallel`` does.

DDP broadcasts rank 0's buffers before each step's forward (``broadcast_buffers=True``, its default and
Lightning's), so every rank starts each step from rank 0's statistics. Data-parallel torchpass does the
same through the commit vote it makes anyway: rank 0 adds its buffers to the vote (every other rank adds
zeros, so the sum is rank 0's values exactly), and every rank adopts them. Two things follow. Every rank
holds the same buffers at each step boundary, so any survivor can hand a spare the lost rank's own
statistics, whichever rank was lost. And those boundary values stay known after the step's forward pass
has moved the live buffers on, which is what a spare replaying the step must start from.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class BufferSync:
    def __init__(self, named: list[tuple[str, Tensor]]) -> None:
        self.names = [name for name, _ in named]
        self.buffers = [buffer for _, buffer in named]
        self.size = sum(b.numel() for b in self.buffers)
        self._boundary = self._flat()

    def _flat(self) -> Tensor:
        if not self.buffers:
            return torch.zeros(0, dtype=torch.float64)
        # float64 holds every value of the float dtypes up to 64 bits and integers up to 2**53 exactly
        return torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in self.buffers])

    @classmethod
    def of_state_dicts(cls, modules: dict[str, nn.Module]) -> BufferSync:
        """The buffers of the modules' state dicts, each under ``{module name}.{buffer name}`` (a constant
        mask or cache, left out of the state dict, needs no vote)."""
        named = []
        for prefix, module in modules.items():
            persistent = module.state_dict(keep_vars=True).keys()
            named += [(f"{prefix}.{key}", buffer) for key, buffer in module.named_buffers() if key in persistent]
        return cls(named)

    def mark_boundary(self) -> None:
        """The buffers as they are now are the boundary's (before the first step: after the start-up
        broadcast of rank 0's state)."""
        self._boundary = self._flat()

    def contribution(self, rank: int) -> Tensor:
        """This rank's part of the vote: rank 0's buffers, zeros elsewhere."""
        return self._flat() if rank == 0 else torch.zeros(self.size, dtype=torch.float64)

    def adopt(self, values: Tensor) -> None:
        """Take rank 0's buffers from the vote's sum; they are the next boundary's."""
        self._boundary = values
        offset = 0
        for buffer in self.buffers:
            n = buffer.numel()
            buffer.copy_(values[offset : offset + n].view(buffer.shape))
            offset += n

    def boundary_values(self) -> dict[str, Tensor]:
        """Each buffer as of the last step boundary (for the state a spare receives)."""
        values, offset = {}, 0
        for name, buffer in zip(self.names, self.buffers, strict=True):
            n = buffer.numel()
            values[name] = self._boundary[offset : offset + n].view(buffer.shape).to(buffer.dtype)
            offset += n
        return values
