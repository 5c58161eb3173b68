"""The training script both benchmarks launch: one model and data set, two strategies.

``--strategy torchpass_ddp`` or ``torchpass_fsdp`` runs under ``torchpass launch``; ``--strategy ddp`` is plain
Lightning under ``torchrun``. Model, data, seed and optimizer are identical, so any difference comes from the strategy
and the launcher. Each logical rank appends every optimizer step it completes, with wall-clock and
``perf_counter`` times, to ``OUT/steps_rank{r}.txt``: the drivers compute regain times and step times
from these lines, not from file modification times.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _bench_data import add_run_args, claim, make_dataset, mlp, pin_to_core
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader


class MLP(L.LightningModule):
    """A plain MLP; width and depth set the step time (a few million parameters: tens of ms on CPU)."""

    def __init__(self, features: int, hidden: int, depth: int, classes: int, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = mlp(features, hidden, depth, classes)

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (plain FSDP2): shard as ``torchpass_fsdp`` does with
        ``auto_wrap_policy={nn.Linear}``: each ``nn.Linear`` one unit, FSDP2's defaults. The LightningModule
        is sharded last, as users do; it holds no parameters and ``training_step`` calls ``self.net``, so
        under both strategies each layer runs as its own FSDP2 root."""
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        mesh = self.device_mesh["data_parallel"]
        for module in self.net.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class StepRecorder(Callback):
    """Records completed optimizer steps and marks (then, under plain DDP, performs) the injected kill.

    The kill mark is written on the victim right before it dies, in the last micro-batch of the step in
    flight and before that step's gradient all-reduce completes: under torchpass after the backward (the
    runtime's ``TORCHPASS_FAULTS`` kill follows inside the all-reduce it issues next); under plain DDP,
    whose all-reduce runs inside backward, this callback SIGKILLs the process just before the backward. A
    marker file makes the kill happen once per run, so a restarted or replacing worker does not die again.
    """

    def __init__(self, out: Path, kill_rank: int, kill_step: int, self_kill: bool, save_weights: bool = False) -> None:
        self.out, self.kill_rank, self.kill_step, self.self_kill = out, kill_rank, kill_step, self_kill
        self.save_weights = save_weights
        self._seen: int | None = None
        self._file: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen = trainer.global_step
        self._file = open(self.out / f"steps_rank{trainer.global_rank}.txt", "a", buffering=1)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        # Plain DDP all-reduces inside backward: die before it, or the survivors would apply the step.
        if self.self_kill and self._in_flight(trainer):
            self._mark()
            if claim(self.out / "kill.fired"):
                os.kill(os.getpid(), signal.SIGKILL)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # torchpass all-reduces after backward; the runtime's injected kill follows right after this mark.
        if not self.self_kill and self._in_flight(trainer):
            self._mark()

    def _in_flight(self, trainer: L.Trainer) -> bool:
        """On the victim rank, in the last micro-batch of the kill step (earlier ones only accumulate)."""
        if (trainer.global_rank, trainer.global_step) != (self.kill_rank, self.kill_step):
            return False
        return trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0

    def _mark(self) -> None:
        with open(self.out / f"kill_marks_rank{self.kill_rank}.txt", "a") as f:
            f.write(f"{self.kill_step} {time.time():.6f} {os.getpid()}\n")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step != self._seen:
            self._seen = step
            self._file.write(f"{step - 1} {time.time():.6f} {time.perf_counter():.6f} {os.getpid()}\n")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._file is not None:
            self._file.close()
        if self.save_weights:  # the final weights, to compare runs with and without a failure
            torch.save(pl_module.net.state_dict(), self.out / f"weights_rank{trainer.global_rank}.pt")


class SaveTimer(Callback):
    """Calls ``trainer.save_checkpoint`` at the boundary of every ``every``-th step and records how long the
    loop was held: the synchronous baseline (or, with ``AsyncCheckpointIO``, that plugin's stall)."""

    def __init__(self, out: Path, every: int) -> None:
        self.out, self.every = out, every

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.every == 0 and (trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1) % (
                trainer.accumulate_grad_batches) == 0:
            t0 = time.perf_counter()
            trainer.save_checkpoint(self.out / "saves" / f"step-{step}.ckpt")
            with open(self.out / f"saves_rank{trainer.global_rank}.txt", "a") as f:
                f.write(f"{step} {time.perf_counter() - t0:.6f}\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategy", choices=("torchpass_ddp", "torchpass_fsdp", "ddp", "fsdp2"), required=True)
    p.add_argument("--replicate-every", type=int, default=1, help="torchpass_fsdp: ring replica interval (0: off)")
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="gpu: one GPU per rank, NCCL")
    add_run_args(p)
    p.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N steps + last.ckpt (0: off)")
    p.add_argument("--snapshot-dir", default=None, help="torchpass: background snapshots to this URL")
    p.add_argument("--save-every", type=int, default=0, help="trainer.save_checkpoint every N steps (0: off)")
    p.add_argument("--async-io", action="store_true", help="with --save-every: Lightning's AsyncCheckpointIO")
    p.add_argument("--save-weights", action="store_true", help="write OUT/weights_rank{r}.pt at the end")
    p.add_argument("--publish-weights", default=None, help="torchpass: publish the weights every step at this URL")
    args = p.parse_args(argv)
    if args.pin:
        pin_to_core()

    args.out.mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = [
        StepRecorder(args.out, args.kill_rank, args.kill_step, self_kill=args.strategy == "ddp",
                     save_weights=args.save_weights)
    ]
    strategy: Any = args.strategy
    if args.strategy.startswith("torchpass"):
        import torchpass_plugins  # registers the names; a spare blocks in the Trainer until promoted

        callbacks.append(torchpass_plugins.TorchPassCallback(
            snapshot_dir=args.snapshot_dir, snapshot_every_n_steps=args.save_every if args.snapshot_dir else 0,
            publish_weights=args.publish_weights))
        if args.strategy == "torchpass_fsdp":
            strategy = torchpass_plugins.TorchPassFSDPStrategy(
                auto_wrap_policy={nn.Linear}, replicate_every_n_steps=args.replicate_every
            )
    if args.strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    plugins: list[Any] = []
    if args.save_every and not args.snapshot_dir:
        callbacks.append(SaveTimer(args.out, args.save_every))
        if args.async_io:
            plugins.append(AsyncCheckpointIO())
    ckpt_path = None
    if args.ckpt_every:
        ckpt_dir = args.out / "ckpt"
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, save_last=True))
        if (ckpt_dir / "last.ckpt").exists():
            ckpt_path = "last"

    L.seed_everything(args.seed, verbose=False)
    model = MLP(args.features, args.hidden, args.depth, args.classes)
    # Twice the samples the run needs, so max_steps (not the end of an epoch) ends it even after a
    # mid-epoch restart that starts the loader over.
    samples = 2 * args.batch_size * args.devices * args.accumulate * args.max_steps
    loader = DataLoader(make_dataset(samples, args.features, args.classes, args.seed), batch_size=args.batch_size,
                        shuffle=True)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        strategy=strategy,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        plugins=plugins,
        enable_checkpointing=bool(args.ckpt_every),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
