"""A plain Accelerate training loop that survives the loss of a worker (see README.md beside it).

Four lines differ from the loop without torchpass: ``TorchPass()``, ``tp.track(...)``, ``tp.epochs`` and
``tp.batches``. The loop is a usual one: random augmentation in two loader workers, two parameter groups,
gradient clipping, a scheduler, an evaluation pass per epoch through ``gather_for_metrics``, and an object
of its own (the best accuracy) whose state travels with the rest. Run it with a spare::

    accelerate launch --multi_gpu --num_processes 4 -m torchpass_plugins.run --spares 1 examples/accelerate/train.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from torchpass_plugins import TorchPass


def data(samples: int = 768, features: int = 32, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Augmented(Dataset):
    """Noise added to every sample as it loads, in the loader's workers, as vision and audio pipelines do."""

    def __init__(self, base: Dataset, noise: float) -> None:
        self.base, self.noise = base, noise

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[index]
        return x + self.noise * torch.randn_like(x), y


class Best:
    """The best evaluation accuracy so far: a stateful object of the script's own, tracked like the rest."""

    def __init__(self) -> None:
        self.accuracy, self.epoch = 0.0, -1

    def update(self, accuracy: float, epoch: int) -> None:
        if accuracy > self.accuracy:
            self.accuracy, self.epoch = accuracy, epoch

    def state_dict(self) -> dict:
        return {"accuracy": self.accuracy, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.accuracy, self.epoch = state["accuracy"], state["epoch"]


def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> float:
    """Accuracy over the whole evaluation set: every rank's predictions, gathered."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            predictions, targets = accelerator.gather_for_metrics((model(x).argmax(dim=1), y))
            correct += int((predictions == targets).sum())
            total += targets.numel()
    model.train()
    return correct / total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (0: load in the loop)")
    p.add_argument("--noise", type=float, default=0.1, help="augmentation: noise added to every sample")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=None, help="write the final weights and the steps applied here")
    p.add_argument("--publish-weights", default=None, help="serve versions of the weights at tcp://HOST:PORT")
    args = p.parse_args()

    set_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(64, 4))
    decay = [p for name, p in model.named_parameters() if name.endswith("weight")]
    no_decay = [p for name, p in model.named_parameters() if not name.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2)
    loader = DataLoader(Augmented(data(), args.noise), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    eval_loader = DataLoader(data(200), batch_size=args.batch_size)
    best = Best()

    # Before Accelerator(): joins the job (a spare waits here until it takes a rank). With publish_weights,
    # logical rank 0 serves the tracked model's weights after every optimizer step (TORCHPASS_WEIGHTS_TOKEN).
    tp = TorchPass(seed=args.seed, publish_weights=args.publish_weights)
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation, cpu=not torch.cuda.is_available(),
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    # Accelerate steps a scheduler once per process per optimizer step. The accumulation is Accelerate's, which
    # ACCELERATE_GRADIENT_ACCUMULATION_STEPS sets over the script's argument.
    steps = args.epochs * len(loader) // accelerator.gradient_accumulation_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, loader, eval_loader,
                                                                          scheduler)
    tp.track(accelerator, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, best=best)

    record = None  # one line per optimizer step this process applies (read by the tests)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = open(args.out / f"applied_rank{accelerator.process_index}.txt", "a", buffering=1)
    for epoch in tp.epochs(args.epochs):
        model.train()
        for x, y in tp.batches(loader):
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if record is not None and accelerator.sync_gradients:
                record.write(f"{tp.applied - 1}\n")
        accuracy = evaluate(accelerator, model, eval_loader)
        best.update(accuracy, epoch)
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, accuracy {accuracy:.3f} (best {best.accuracy:.3f})")

    if args.out is not None:  # every rank's own state, to compare runs rank by rank
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "best": best.state_dict(), "rng": torch.get_rng_state()},
                   args.out / f"state_rank{accelerator.process_index}.pt")
    if args.out is not None and accelerator.is_main_process:
        weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save({"weights": weights, "applied": tp.applied}, args.out / "final.pt")
        (args.out / "summary.json").write_text(json.dumps({"steps": tp.applied, "loss": loss.item()}))


if __name__ == "__main__":
    main()
