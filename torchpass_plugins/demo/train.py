"""The demo's training script: a plain Lightning script, as a user would write it.

It uses a shuffled map-style dataset (Lightning's DistributedSampler) read by loader workers that add random
noise to every sample, batch normalization, dropout, AdamW, a per-step LR scheduler, gradient accumulation,
``self.log(..., sync_dist=True, on_epoch=True)`` and a torchmetrics metric; the only torchpass lines are the
import and ``strategy="torchpass_ddp"``. With ``--out DIR`` it writes the final weights (rank 0), and for
every logical rank the optimizer steps it applied and its full state at the end (``state_rank{r}.pt``:
parameters and buffers, optimizer, schedulers, loop progress, metric states, ``callback_metrics``, RNG), so
runs can be compared bit for bit, rank by rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

import torchpass_plugins  # noqa: F401  (registers "torchpass_ddp" and "torchpass_fsdp")
from torchpass_plugins import TorchPassCallback, TorchPassDDPStrategy, TorchPassFSDPStrategy
from torchpass_plugins.integrations.lightning.fsdp_state import trainable_only


def make_dataset(samples: int = 480, features: int = 16, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w + 0.1 * torch.randn(samples, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Augmented(Dataset):
    """Random noise added to each sample as it is read (in the loader's worker processes), as vision and
    audio pipelines augment their inputs."""

    def __init__(self, base: TensorDataset, noise: float) -> None:
        self.base, self.noise = base, noise

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        return (x + self.noise * torch.randn_like(x) if self.noise else x), y


class Classifier(L.LightningModule):
    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, classes),
        )
        self.train_acc = MulticlassAccuracy(num_classes=classes)
        self.out_dir: Path | None = None
        self.sleep_per_step = 0.0
        self.sleep_until: Path | None = None  # once this file exists, no more sleeping

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True, on_epoch=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.sleep_per_step and not (self.sleep_until is not None and self.sleep_until.exists()):
            time.sleep(self.sleep_per_step)  # stands in for a bigger model, so failures land mid-run

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        if self.out_dir is None:
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        with record_applied(optimizer, self.out_dir / f"applied_rank{self.global_rank}.txt", self.trainer.global_step):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=10_000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _local(obj):
    """``obj`` with each sharded tensor replaced by this rank's shard (every rank saves its own state)."""
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    return obj.detach().clone() if isinstance(obj, torch.Tensor) else obj


@contextlib.contextmanager
def record_applied(optimizer, path: Path, step: int):
    """Append ``step`` to ``path`` as the optimizer has applied it or, if a loss scaler skipped it, once the
    step is over: the test oracle's record of the steps each rank applied, each exactly once in a run that
    rolls nothing back."""
    recorded = []

    def applying(*_) -> None:
        recorded.append(step)
        with open(path, "a") as f:
            f.write(f"{step} {time.time()}\n")

    handle = getattr(optimizer, "optimizer", optimizer).register_step_post_hook(applying)
    try:
        yield
    finally:
        handle.remove()
    if not recorded:
        applying()


def rank_state(trainer: L.Trainer, model: L.LightningModule) -> dict:
    """Everything this rank holds that a run with failures must end with exactly as the failure-free run."""
    return _local({
        "module": model.state_dict(),  # parameters and buffers (batch-norm statistics)
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "loops": trainer.fit_loop.state_dict(),
        "metric_states": {name: dict(m.metric_state) for name, m in model.named_modules() if isinstance(m, Metric)},
        "callback_metrics": dict(trainer.callback_metrics),
        "rng": torch.get_rng_state(),
        "precision": trainer.precision_plugin.state_dict(),  # the loss scaler's scale and growth tracker
    })


def precision_arguments(precision: str, accelerator: str) -> dict:
    """Trainer arguments for ``precision``: on CPU, Lightning's 16-mixed runs without a loss scaler, so the
    demo gives it one explicitly (its state must move to a spare with the rest, as on a GPU)."""
    if precision == "16-mixed" and accelerator == "cpu":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    return {"precision": precision}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--max-epochs", type=int, default=-1, help="stop after this many epochs (-1: max-steps only)")
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64, help="width of the hidden layers")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes per rank")
    p.add_argument("--persistent-workers", action="store_true", help="keep the loader workers across epochs")
    p.add_argument("--noise", type=float, default=0.05, help="random noise the loader workers add to each sample")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    p.add_argument("--sleep-until", type=Path, default=None,
                   help="stop sleeping per step once this file exists (a test's faults are done)")
    p.add_argument("--val-every", type=int, default=0, help="validate every N training batches (0: never)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="gradient bucket size (several buckets)")
    p.add_argument("--collective-timeout", type=float, default=None,
                   help="seconds per collective (default: torchpass.timeouts.collective_s)")
    p.add_argument("--strategy", choices=["torchpass_ddp", "torchpass_fsdp"], default="torchpass_ddp")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu",
                   help="gpu: each process on its slot's GPU (with one GPU per node: --devices 1 --num-nodes N)")
    p.add_argument("--process-group-backend", choices=["gloo", "nccl"], default=None,
                   help="for CUDA tensors (default nccl; gloo lets several ranks share one GPU)")
    p.add_argument("--deterministic", action="store_true", help="Trainer(deterministic=True): bit-exact on a GPU")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true",
                   help="16-mixed scales the loss with a GradScaler (on CPU too)")
    p.add_argument("--replicate-every", type=int, default=1, help="torchpass_fsdp: ring replica refresh interval")
    p.add_argument("--freeze-first", action="store_true", help="freeze the first layer (a frozen backbone)")
    p.add_argument("--model-aware", action="store_true", help="torchpass_fsdp: move only trainable state")
    p.add_argument("--save-checkpoint", type=Path, default=None, help="trainer.save_checkpoint(PATH) after fit")
    p.add_argument("--resume", type=Path, default=None, help="fit(ckpt_path=PATH)")
    p.add_argument("--snapshot-dir", default=None, help="background snapshots to this path or fsspec URL")
    p.add_argument("--snapshot-every", type=int, default=0, help="snapshot every N optimizer steps")
    p.add_argument("--snapshot-when-busy", choices=["skip", "wait"], default="skip")
    p.add_argument("--snapshot-timeout", type=float, default=600.0, help="the longest a snapshot may take to land")
    p.add_argument("--publish-weights", default=None, help="serve versions of the weights at tcp://HOST:PORT")
    p.add_argument("--publish-every", type=int, default=1, help="a version every N optimizer steps")
    args = p.parse_args(argv)

    L.seed_everything(7)
    model = Classifier(hidden=args.hidden)
    model.sleep_per_step, model.sleep_until = args.sleep_per_step, args.sleep_until
    if args.freeze_first:
        model.net[0].requires_grad_(False)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        model.out_dir = args.out
    loader = DataLoader(Augmented(make_dataset(), args.noise), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, persistent_workers=args.persistent_workers and args.workers > 0)
    val = DataLoader(make_dataset(96), batch_size=args.batch_size) if args.val_every else None
    strategy = args.strategy
    if args.strategy == "torchpass_fsdp":
        strategy = TorchPassFSDPStrategy(auto_wrap_policy={nn.Linear}, replicate_every_n_steps=args.replicate_every,
                                         state_filter=trainable_only if args.model_aware else None,
                                         timeout=args.collective_timeout,
                                         process_group_backend=args.process_group_backend)
    elif args.bucket_cap_mb or args.collective_timeout or args.process_group_backend:
        strategy = TorchPassDDPStrategy(bucket_cap_mb=args.bucket_cap_mb or 4.0, timeout=args.collective_timeout,
                                        process_group_backend=args.process_group_backend)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        deterministic=args.deterministic or None,
        **precision_arguments(args.precision, args.accelerator),
        strategy=strategy,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        accumulate_grad_batches=args.accumulate,
        callbacks=[TorchPassCallback(snapshot_dir=args.snapshot_dir, snapshot_every_n_steps=args.snapshot_every,
                                     snapshot_when_busy=args.snapshot_when_busy,
                                     snapshot_timeout=args.snapshot_timeout,
                                     publish_weights=args.publish_weights,
                                     publish_every_n_steps=args.publish_every)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=args.progress,
        enable_model_summary=False,
        val_check_interval=args.val_every or None,
        limit_val_batches=None if args.val_every else 0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader, val, ckpt_path=args.resume)
    if args.save_checkpoint is not None:
        trainer.save_checkpoint(args.save_checkpoint)
    # Sharded parameters are gathered to full tensors (a collective: every rank takes part).
    state = {k: getattr(v, "full_tensor", lambda v=v: v)().detach().clone() for k, v in model.state_dict().items()}
    if args.out is not None:
        torch.save(rank_state(trainer, model), args.out / f"state_rank{trainer.global_rank}.pt")
    if args.out is not None and trainer.global_rank == 0:
        opt_state = trainer.optimizers[0].state_dict()["state"]
        torch.save({"weights": state, "global_step": trainer.global_step,
                    "adam_steps": [float(s["step"]) for s in opt_state.values()], "pid": os.getpid()},
                   args.out / "final.pt")


if __name__ == "__main__":
    main()
