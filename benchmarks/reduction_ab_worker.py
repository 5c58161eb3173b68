"""Worker of ``reduction_ab.py``: one model in one process whose steps alternate how gradients are reduced.

Each cycle runs one step of every arm, in an order that rotates through all permutations of the arms, so
that each arm follows every other equally often and a drift of the machine within a cycle is shared:

- ``ddp``: the module wrapped in ``DistributedDataParallel`` (its reducer, default buckets) on a plain gloo
  group; what a plain Accelerate loop runs.
- ``ddp_sigterm``: the same plus the one-element broadcast Lightning's training loop makes before every
  batch when ``torch.distributed`` is initialized (``_broadcast_sigterm_tensor``); what Lightning's ``ddp``
  strategy runs.
- ``torchpass``: what ``torchpass_ddp`` and ``TorchPass`` run per step, through the library's own runtime:
  the step boundary (reseed, step timer), fixed buckets issued during backward on the runtime's transport,
  ``Runtime.reduce_gradients`` (waits and the commit vote) and ``write_back``.

Every arm then applies the same AdamW step to the same parameters. Rank 0 writes each step's time.
Run it under ``torchpass launch --spares 0`` (the runtime needs the agent); ``reduction_ab.py`` does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _bench_data import mlp, pin_to_core
from torch.nn.parallel import DistributedDataParallel

from torchpass_plugins.control.worker import current_runtime
from torchpass_plugins.core.grad_buckets import GradientBuckets
from torchpass_plugins.core.training_state import OWN, Held

ARMS = ("ddp", "ddp_sigterm", "torchpass")
ORDERS = list(itertools.permutations(ARMS))
BATCHES = 8  # distinct batches per rank, cycled


class _Loop:
    """The runtime's view of this loop: optimizer steps applied. No spares run, so no state is handed over."""

    def __init__(self) -> None:
        self.applied = 0

    def applied_steps(self) -> int:
        return self.applied

    def boundary_snapshot(self) -> None:
        return None

    def training_state(self) -> dict[str, Held]:
        """No spares run, so only the ``own`` part is ever read: what a Lightning rank copies to its ring
        successor twice per step (its logged running values)."""
        own = {"loss": {"value": torch.zeros(()), "cumulated_batch_size": torch.zeros(())}, "step": self.applied}
        return {OWN: Held(own)}

    def load_state(self, state: Any) -> None:
        raise RuntimeError("reduction_ab runs without spares: no state to adopt")

    def state_tensors(self) -> list[torch.Tensor]:
        return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    for flag in ("--features", "--hidden", "--depth", "--classes", "--batch-size", "--cycles"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    pin_to_core()  # before any group exists: their threads inherit the main thread's core

    rt = current_runtime()
    loop = _Loop()
    rt.adapter = loop
    store = dist.PrefixStore("reduction_ab", rt.member.store)
    dist.init_process_group("gloo", store=store, rank=rt.rank, world_size=rt.world_size)

    torch.manual_seed(0)  # the same initial weights on every rank, as after DDP's start-up broadcast
    model = mlp(args.features, args.hidden, args.depth, args.classes)
    ddp = DistributedDataParallel(model)
    buckets = GradientBuckets(model.parameters(), rt.world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rt.rank)
    batches = [(torch.randn(args.batch_size, args.features, generator=g),
                torch.randint(0, args.classes, (args.batch_size,), generator=g)) for _ in range(BATCHES)]

    def ddp_step(x: torch.Tensor, y: torch.Tensor, sigterm: bool) -> None:
        if sigterm:
            flag = torch.tensor([0])
            dist.broadcast(flag, src=0)
            flag.item()
        F.cross_entropy(ddp(x), y).backward()

    def torchpass_step(x: torch.Tensor, y: torch.Tensor) -> None:
        rt.boundary(loop.applied)
        buckets.overlap_with(rt.transport)
        F.cross_entropy(model(x), y).backward()
        rt.reduce_gradients(buckets)
        buckets.write_back()

    rows: list[tuple[int, str, float]] = []
    step = 0
    for cycle in range(args.cycles):
        for arm in ORDERS[cycle % len(ORDERS)]:
            x, y = batches[step % BATCHES]
            start = time.perf_counter()
            if arm == "torchpass":
                torchpass_step(x, y)
            else:
                ddp_step(x, y, sigterm=arm == "ddp_sigterm")
            optimizer.step()
            loop.applied += 1
            optimizer.zero_grad()
            rows.append((cycle, arm, (time.perf_counter() - start) * 1e3))
            step += 1

    rt.boundary(loop.applied)  # end as the strategies do: every rank past its last step, then done
    rt.collective(lambda t: t.barrier(), None)
    rt.training_complete(loop.applied)
    dist.destroy_process_group()
    if rt.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "steps_rank0.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
