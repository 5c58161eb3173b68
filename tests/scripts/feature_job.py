"""A user's training script with one Lightning feature switched on (``--feature``), run by the tests under
``torchpass launch``: a feature torchpass cannot continue bit for bit must be refused before training."""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from torchpass_plugins import TorchPassCallback

FEATURES = ("iterable", "manual", "lbfgs", "capturable", "crash_loop", "own_sampler")


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(1000):
            yield torch.randn(8, generator=g), torch.randint(0, 2, (), generator=g)


class Model(L.LightningModule):
    def __init__(self, feature: str) -> None:
        super().__init__()
        self.feature = feature
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
        self.head = nn.Linear(2, 2)
        self.automatic_optimization = feature != "manual"

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.feature == "crash_loop" and self.global_rank == 1 and self.global_step >= 3:
            raise RuntimeError("rank 1 breaks at step 3, whichever process holds it")
        loss = nn.functional.cross_entropy(self.head(self.net(x)), y)
        if self.feature == "manual":  # GAN-style: two optimizers, two steps per batch
            for opt in self.optimizers():
                opt.zero_grad()
                self.manual_backward(loss, retain_graph=True)
                opt.step()
            return None
        return loss

    def configure_optimizers(self):
        if self.feature == "manual":
            return [torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]
        if self.feature == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if self.feature == "capturable":  # torchpass_fsdp's gradient log could not replay its steps
            return torch.optim.AdamW(self.parameters(), capturable=True)
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--feature", choices=FEATURES, required=True)
    p.add_argument("--strategy", default="torchpass_ddp")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = Stream() if args.feature == "iterable" else TensorDataset(torch.randn(256, 8, generator=g),
                                                                     torch.randint(0, 2, (256,), generator=g))
    trainer = L.Trainer(strategy=args.strategy, devices=args.devices, accelerator="cpu", max_steps=8,
                        callbacks=[TorchPassCallback()],
                        use_distributed_sampler=args.feature != "own_sampler",  # its SequentialSampler stays
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Model(args.feature), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
