"""Lightning's own FSDP2 (``ModelParallelStrategy``, through Fabric, in one process) loads a checkpoint
directory that ``torchpass_fsdp`` wrote: the demo's model and AdamW from its ``state_dict`` and
``optimizer_0``, resharded onto one rank, and the rest from ``meta.pt``. Writes the loaded parameters and
buffers (full tensors), the optimizer's step counts and the checkpoint's ``global_step`` to ``--out``, and
saves it all again as Lightning does to ``--save``."""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchpass_plugins.demo.train import Classifier


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--save", type=Path, required=True)
    args = p.parse_args()
    fabric = L.Fabric(accelerator="cpu", devices=1,
                      strategy=ModelParallelStrategy(shard, data_parallel_size=1, tensor_parallel_size=1))
    fabric.launch()
    model = fabric.setup_module(Classifier())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    rest = fabric.load(args.checkpoint, {"state_dict": model, "optimizer_0": optimizer})
    weights = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in model.state_dict().items()}
    steps = [float(s["step"]) for s in optimizer.state.values()]
    torch.save({"weights": weights, "adam_steps": steps, "global_step": rest["global_step"]}, args.out)
    fabric.save(args.save, {"state_dict": model, "optimizer_0": optimizer, **rest})


if __name__ == "__main__":
    main()
