"""The CPU form of ``SyncBatchNorm``: two processes, each with half a batch, must compute what one
BatchNorm computes over the whole batch (outputs, input and parameter gradients, running statistics)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchpass_plugins.integrations.lightning.sync_batchnorm import SyncBatchNorm, TorchPassSyncBatchNorm

pytestmark = pytest.mark.timeout(120)


def _batch() -> torch.Tensor:
    return torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(0)) * 3 + 1


def _run(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = TorchPassSyncBatchNorm().apply(nn.Sequential(nn.BatchNorm1d(3)))
    assert type(model[0]) is SyncBatchNorm
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        model[0].bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    x = _batch()[rank * 4 : (rank + 1) * 4].clone().requires_grad_()
    for _ in range(2):  # twice: running statistics move from their initial values
        y = model(x)
    (y * torch.arange(y.numel()).view_as(y)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # as data parallel does (summed: the reference's loss is the sum)
    bn = model[0]
    torch.save({"y": y.detach(), "x_grad": x.grad, "w_grad": bn.weight.grad, "b_grad": bn.bias.grad,
                "running_mean": bn.running_mean, "running_var": bn.running_var}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_with_half_a_batch_each_compute_one_batchnorm_over_the_whole(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

    ref = nn.BatchNorm1d(3)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        ref.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    x = _batch().requires_grad_()
    for _ in range(2):
        y = ref(x)
    weights = torch.cat([torch.arange(60).view(4, 3, 5)] * 2)  # each rank weighted its own outputs so
    (y * weights).sum().backward()

    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), y.detach(), **close)
    torch.testing.assert_close(torch.cat([g["x_grad"] for g in got]), x.grad, **close)
    for g in got:
        torch.testing.assert_close(g["w_grad"], ref.weight.grad, **close)
        torch.testing.assert_close(g["b_grad"], ref.bias.grad, **close)
        torch.testing.assert_close(g["running_mean"], ref.running_mean, **close)
        torch.testing.assert_close(g["running_var"], ref.running_var, **close)
