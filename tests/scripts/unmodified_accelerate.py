"""An Accelerate training loop written without torchpass, as a platform finds it: no torchpass import, none
of TorchPass's four lines. Batch normalization, dropout, loader workers that add random noise, gradient
accumulation, AdamW with a per-step schedule, and code between the passes that changes the training state
(the weight decay shrinks after each pass) and runs collectives (an evaluation through
``gather_for_metrics``). With ``--out`` each rank records the optimizer steps it applied
(``applied_rank{r}.txt``) and writes its full state at the end (``state_rank{r}.pt``), for comparison.
``--four-lines`` runs the same loop with TorchPass's four lines added (the one use of torchpass here)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from noisy_data import Noisy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    p.add_argument("--sleep-until", type=Path, default=None)
    p.add_argument("--four-lines", action="store_true")
    args = p.parse_args()
    set_seed(5)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.05 * step))
    loader = DataLoader(Noisy(288), batch_size=8, shuffle=True, num_workers=2)
    eval_loader = DataLoader(TensorDataset(torch.randn(60, 12), torch.randint(0, 3, (60,))), batch_size=10)
    tp = None
    if args.four_lines:
        from torchpass_plugins import TorchPass

        tp = TorchPass(seed=5)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, loader, eval_loader,
                                                                          scheduler)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if tp is not None:
        tp.track(accelerator, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    first = next(iter(accelerator.unwrap_model(model).parameters()))
    for epoch in tp.epochs(args.epochs) if tp is not None else range(args.epochs):
        model.train()
        for x, y in tp.batches(loader) if tp is not None else loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and args.out is not None:
                with open(args.out / f"applied_rank{accelerator.process_index}.txt", "a") as f:
                    f.write(f"{int(optimizer.state[first]['step']) - 1}\n")
            if args.sleep_per_step and not (args.sleep_until is not None and args.sleep_until.exists()):
                time.sleep(args.sleep_per_step)
        for group in optimizer.param_groups:  # state the code between the passes changes
            group["weight_decay"] *= 0.5
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in eval_loader:
                predictions, targets = accelerator.gather_for_metrics((model(x).argmax(dim=1), y))
                correct += int((predictions == targets).sum())
        accelerator.print(f"epoch {epoch}: accuracy {correct / 60:.3f}")
    if args.out is not None:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
                   args.out / f"state_rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main()
