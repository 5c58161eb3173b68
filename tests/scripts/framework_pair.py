"""The demo's model and data trained under torchpass, or under Lightning's own ``ddp`` or plain FSDP2
(``ModelParallelStrategy``), for the second oracle (``test_against_the_frameworks.py``). Nothing random
differs by design between them: no dropout and no augmentation (torchpass draws those streams per step
and per position, the frameworks per process), so what remains is the arithmetic: the same gradients,
averaged over the same batches, applied by the same optimizer. Rank 0 writes its parameters and buffers
to ``--out``/``weights.pt``."""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from torchpass_plugins import TorchPassCallback, TorchPassFSDPStrategy
from torchpass_plugins.demo.train import Classifier, make_dataset


class ShardedClassifier(Classifier):
    def configure_model(self) -> None:
        """Under plain FSDP2, the units ``torchpass_fsdp(auto_wrap_policy={nn.Linear})`` makes: each
        ``nn.Linear``, then each child holding parameters outside them (the BatchNorm's, in ``net``)."""
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        mesh = self.device_mesh["data_parallel"]
        linears = [m for m in self.modules() if isinstance(m, nn.Linear)]
        for module in linears:
            fully_shard(module, mesh=mesh)
        in_units = {id(p) for m in linears for p in m.parameters()}
        for child in self.children():
            if any(id(p) not in in_units for p in child.parameters()):
                fully_shard(child, mesh=mesh)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "fsdp2", "torchpass_ddp", "torchpass_fsdp"], required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(7)
    model = ShardedClassifier()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    # The bias just before a BatchNorm has no true gradient (the norm subtracts it again): what it gets is
    # rounding noise, which Adam turns into full-sized steps of either sign. Frozen, as it could be removed.
    model.net[0].bias.requires_grad_(False)
    strategy = args.strategy
    if strategy == "torchpass_fsdp":
        strategy = TorchPassFSDPStrategy(auto_wrap_policy={nn.Linear})
    elif strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu", strategy=strategy, devices=3, max_steps=30, accumulate_grad_batches=2,
        gradient_clip_val=1.0, callbacks=[TorchPassCallback()] if args.strategy.startswith("torchpass") else [],
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(make_dataset(), batch_size=8, shuffle=True, num_workers=2))
    # Sharded parameters are gathered to full tensors (a collective: every rank takes part).
    state = {k: getattr(v, "full_tensor", lambda v=v: v)().detach().clone() for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(state, args.out / "weights.pt")


if __name__ == "__main__":
    main()
