"""A user's Lightning script with many features on at once, run by the tests under ``torchpass launch``: a
``LightningDataModule`` whose ``prepare_data`` writes the data set, loader workers with random augmentation
(a ``DataLoader`` or torchdata's ``StatefulDataLoader``), BatchNorm, two parameter groups, two LR
schedulers, a torchmetrics metric and ``sync_dist`` values logged per step and per epoch, gradient
clipping, accumulation, validation every few batches with ``ModelCheckpoint`` and ``EarlyStopping``,
several epochs; ``--sync-batchnorm`` synchronizes the BatchNorm over the ranks. Every logical rank writes
its full state at the end (``state_rank{r}.pt``), callbacks' state included, so a run with a failure is
compared with the failure-free run rank by rank."""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from torchpass_plugins import TorchPassCallback, TorchPassFSDPStrategy
from torchpass_plugins.demo.train import precision_arguments, rank_state, record_applied


class Noisy(Dataset):
    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        return x + 0.05 * torch.randn_like(x), y


class Data(L.LightningDataModule):
    def __init__(self, root: Path, workers: int, persistent: bool, stateful: bool) -> None:
        super().__init__()
        self.root, self.workers, self.persistent = root, workers, persistent
        self.loader = DataLoader
        if stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.loader = StatefulDataLoader

    def prepare_data(self) -> None:  # once per node, while the other ranks wait
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.root / "data.pt").exists():
            g = torch.Generator().manual_seed(3)
            x = torch.randn(288, 16, generator=g)
            torch.save((x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 0).long()), self.root / "data.pt")

    def setup(self, stage: str) -> None:
        x, y = torch.load(self.root / "data.pt")
        self.train, self.val = TensorDataset(x[:240], y[:240]), TensorDataset(x[240:], y[240:])

    def train_dataloader(self):
        return self.loader(Noisy(self.train), batch_size=4, shuffle=True, num_workers=self.workers,
                          persistent_workers=self.persistent and self.workers > 0)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=8)


class Model(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 3)
        self.train_acc = MulticlassAccuracy(num_classes=3)
        self.val_acc = MulticlassAccuracy(num_classes=3)

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, on_epoch=True)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        with record_applied(optimizer, self.out / f"applied_rank{self.global_rank}.txt", self.trainer.global_step):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def configure_optimizers(self):
        opt = torch.optim.AdamW([{"params": self.body.parameters(), "lr": 2e-3},
                                 {"params": self.head.parameters(), "lr": 5e-3, "weight_decay": 0.0}])
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        decay = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return [opt], [{"scheduler": warmup, "interval": "step"}, {"scheduler": decay, "interval": "step"}]


def full_state(trainer: L.Trainer, model: L.LightningModule, out: Path) -> dict:
    """:func:`rank_state`, and the callbacks' state with this run's directory taken out of the paths."""
    state = rank_state(trainer, model)
    callbacks = {}
    for callback in trainer.callbacks:
        if isinstance(callback, (ModelCheckpoint, EarlyStopping)):
            text = repr(sorted(callback.state_dict().items())).replace(str(out), "OUT")
            callbacks[type(callback).__name__] = text
    state["callbacks"] = callbacks
    state["batchnorm"] = type(model.body[1]).__name__
    return state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--strategy", default="torchpass_ddp")
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument("--stateful-loader", action="store_true", help="torchdata's StatefulDataLoader for training")
    p.add_argument("--sync-batchnorm", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(11)
    strategy = args.strategy
    if strategy == "torchpass_fsdp":
        strategy = TorchPassFSDPStrategy(auto_wrap_policy={nn.Linear})
    trainer = L.Trainer(
        accelerator="cpu", strategy=strategy, devices=args.devices, **precision_arguments(args.precision, "cpu"),
        max_epochs=args.epochs, accumulate_grad_batches=args.accumulate, gradient_clip_val=0.5,
        val_check_interval=12, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, sync_batchnorm=args.sync_batchnorm,
        callbacks=[TorchPassCallback(),
                   ModelCheckpoint(dirpath=args.out / "checkpoints", monitor="val_loss", save_top_k=2),
                   EarlyStopping(monitor="val_loss", patience=50)],
    )
    model = Model(args.out)
    trainer.fit(model, datamodule=Data(args.out / "data", args.workers, args.persistent_workers, args.stateful_loader))
    torch.save(full_state(trainer, model, args.out), args.out / f"state_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
