"""A Lightning script written without torchpass, as a platform finds it: Lightning's own strategy, no torchpass
import, no callback. Batch normalization, dropout, loader workers that add random noise, AdamW with a per-step
schedule. With ``--out`` each rank records the optimizer steps it applied (``applied_rank{r}.txt``) and writes its
full state at the end (``state_rank{r}.pt``), for comparison."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch
from noisy_data import Noisy
from torch import nn
from torch.utils.data import DataLoader


class Net(L.LightningModule):
    def __init__(self, pause: float, pause_until: Path | None, out: Path | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
        self.pause, self.pause_until, self.out = pause, pause_until, out

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.pause and not (self.pause_until is not None and self.pause_until.exists()):
            time.sleep(self.pause)

    def optimizer_step(self, *args, **kwargs) -> None:
        step = self.trainer.global_step
        super().optimizer_step(*args, **kwargs)
        if self.out is not None:
            with open(self.out / f"applied_rank{self.global_rank}.txt", "a") as f:
                f.write(f"{step}\n")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.05 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", default="auto")
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    p.add_argument("--sleep-until", type=Path, default=None)
    args = p.parse_args()
    L.seed_everything(5)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    model = Net(args.sleep_per_step, args.sleep_until, args.out)
    loader = DataLoader(Noisy(384), batch_size=8, shuffle=True, num_workers=2)
    trainer = L.Trainer(accelerator="cpu", strategy=args.strategy,
                        devices=int(args.devices) if args.devices.isdigit() else args.devices,
                        max_steps=args.max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    if args.out is not None:
        torch.save({"module": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                    "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                    "loops": trainer.fit_loop.state_dict(), "global_step": trainer.global_step,
                    "rng": torch.get_rng_state()}, args.out / f"state_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
