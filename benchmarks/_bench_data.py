"""What every training script of the benchmarks shares, without importing Lightning (TorchFT's replicas
and the drivers need it too): the run's flags, the model, the synthetic task and a once-per-run marker."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchpass_plugins.control.worker_env import WorkerEnv


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of the model, data, schedule and kill point, the same for every contender."""
    for flag, default in (("--max-steps", 30), ("--accumulate", 1), ("--batch-size", 32), ("--features", 64),
                          ("--hidden", 128), ("--depth", 2), ("--classes", 10), ("--seed", 7),
                          ("--kill-rank", -1), ("--kill-step", -1)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pin", action="store_true", help="pin this process to one core: its slot on the node mod cores")


def pin_to_core() -> None:
    """Pin every thread of this process to one core, chosen by its slot on the node by the same rule under
    every launcher, so that side-by-side runs differ by what they run, not by where the scheduler moved
    them (unpinned, run medians of one configuration spread by +-10% on this 2-core machine)."""
    worker = WorkerEnv.from_env()  # a torchpass worker's slot; torchrun's LOCAL_RANK otherwise
    slot = worker.local_slot if worker is not None else int(os.environ.get("LOCAL_RANK") or 0)
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {slot % os.cpu_count()})


def mlp(features: int, hidden: int, depth: int, classes: int) -> nn.Sequential:
    """The benchmark model: ``depth`` hidden ReLU layers of width ``hidden``."""
    layers: list[nn.Module] = []
    width = features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def make_dataset(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """A fixed synthetic classification task (a random linear teacher), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher + 0.1 * torch.randn(samples, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def claim(marker: Path) -> bool:
    """True for the first caller only (across processes and restarts): creates ``marker`` exclusively."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
