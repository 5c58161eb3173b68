"""The benchmark's Accelerate loop: the same MLP and data as ``bench_train.py``, written as a plain loop.

With ``TorchPass`` active (under ``-m torchpass_plugins.run``) it is protected; under plain ``accelerate
launch`` the same code runs unprotected (``TorchPass`` passes everything through and Accelerate's DDP
reduces the gradients), which is the baseline. Each logical rank appends every optimizer step it
completes to ``OUT/steps_rank{r}.txt`` (step, wall-clock time, ``perf_counter``, pid); the victim of
``--kill-rank``/``--kill-step`` appends a mark to ``OUT/kill_marks_rank{r}.txt`` just before the
backward whose gradient reduction the injected fault interrupts.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch
from _bench_data import mlp, pin_to_core
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchpass_plugins import TorchPass
from torchpass_plugins.integrations.accelerate.loop import UnprotectedRunWarning


def main() -> None:
    p = argparse.ArgumentParser()
    for flag, default in (("--steps", 40), ("--accumulate", 1), ("--batch-size", 64), ("--features", 1024),
                          ("--hidden", 1024), ("--depth", 4), ("--classes", 10), ("--kill-rank", -1),
                          ("--kill-step", -1)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pin", action="store_true", help="pin this process to one core (see pin_to_core)")
    args = p.parse_args()
    if args.pin:
        pin_to_core()
    warnings.simplefilter("ignore", UnprotectedRunWarning)  # the baseline is unprotected on purpose

    set_seed(0)
    model = mlp(args.features, args.hidden, args.depth, args.classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tp = TorchPass(seed=0)
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=True,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    samples = args.steps * args.accumulate * args.batch_size * accelerator.num_processes
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, args.features, generator=g),
                         torch.randint(0, args.classes, (samples,), generator=g))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    tp.track(accelerator, model=model, optimizer=optimizer, loader=loader)

    rank = accelerator.process_index
    args.out.mkdir(parents=True, exist_ok=True)
    steps_file = open(args.out / f"steps_rank{rank}.txt", "a", buffering=1)
    step = tp.applied  # a spare starts at the step it takes over
    for _ in tp.epochs(1):
        for x, y in tp.batches(loader):
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                if accelerator.sync_gradients and (rank, step) == (args.kill_rank, args.kill_step):
                    with open(args.out / f"kill_marks_rank{rank}.txt", "a") as f:
                        f.write(f"{step} {time.time():.6f} {os.getpid()}\n")
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps_file.write(f"{step} {time.time():.6f} {time.perf_counter():.6f} {os.getpid()}\n")
                step += 1
    steps_file.close()


if __name__ == "__main__":
    main()
