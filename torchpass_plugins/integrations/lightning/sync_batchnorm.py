"""``Trainer(sync_batchnorm=True)`` under the torchpass strategies, on CUDA and on CPU.

torch's ``SyncBatchNorm`` refuses CPU tensors (its statistics kernels are CUDA-only), so CPU training
could not use it at all. :class:`SyncBatchNorm` is torch's on CUDA; elsewhere it computes the same batch
statistics over every rank from one all-reduce of per-channel sums (count, sum, sum of squares), and its
backward all-reduces their gradient: the same mathematics, not the same kernels, so CPU results agree with
a CUDA run's to rounding, not bit for bit. Both collectives go through the default process group, which
under torchpass survives failures, so a spare recomputes the lost rank's forward and backward and the
continuation stays bit-exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import TorchSyncBatchNorm
from torch import nn


class _SumOverRanks(torch.autograd.Function):
    """An all-reduce whose backward is an all-reduce: each rank's loss depends on every rank's sums."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        total = local.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        dist.all_reduce(total)
        return total


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch's ``SyncBatchNorm`` where torch runs it (CUDA), the all-reduce form elsewhere."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_cuda or not (self.training and dist.is_initialized()) or dist.get_world_size() < 2:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        channels = input.shape[1]
        x = input.float()
        dims = [0, *range(2, x.dim())]
        count = torch.tensor([x.numel() / channels], dtype=x.dtype)
        total = _SumOverRanks.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = var * n / (n - 1)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)


class TorchPassSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning's layer sync, converting to :class:`SyncBatchNorm` (``revert`` is Lightning's)."""

    def apply(self, model: nn.Module) -> nn.Module:
        model = super().apply(model)
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = SyncBatchNorm  # a subclass with no state of its own
        return model

