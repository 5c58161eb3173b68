"""The trainer: a Lightning script that learns the bandit from the replicas' batches (a clipped
policy-gradient step, as PPO's) and publishes its weights after every optimizer step.

The torchpass lines are the strategy and ``TorchPassCallback(publish_weights=...)``: logical rank 0 serves
each version at the endpoint, whichever process holds the rank. Each rank reads the batches its sampler
reads (batch ``k`` feeds step ``k // ranks``), waiting for a replica to write one that is not there yet.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch
from bandit import Policy, log_prob
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import torchpass_plugins  # noqa: F401  (registers "torchpass_ddp")
from torchpass_plugins import TorchPassCallback


class Rollouts(Dataset):
    """Batch ``k`` is the file ``batch{k:05d}.pt`` in ``root``, waited for until a replica writes it."""

    def __init__(self, root: Path, batches: int, patience_s: float = 300.0) -> None:
        self.root, self.batches, self.patience_s = root, batches, patience_s

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        path, deadline = self.root / f"batch{index:05d}.pt", time.monotonic() + self.patience_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica wrote {path} within {self.patience_s} s")
            time.sleep(0.01)
        return torch.load(path)


class Learner(L.LightningModule):
    def __init__(self, rollouts: Path, steps: int, lr: float = 0.02, clip: float = 0.2) -> None:
        super().__init__()
        self.policy, self.lr, self.clip = Policy(), lr, clip
        self.rollouts, self.steps = rollouts, steps

    def train_dataloader(self) -> DataLoader:
        """Rank ``r`` of ``n`` reads batches ``r, r + n, r + 2n...`` in order (the replicas write them in that
        order): a sampler that does not shuffle, made here, where the rank is known (a spare's too)."""
        ranks = self.trainer.world_size
        rollouts = Rollouts(self.rollouts, self.steps * ranks)
        in_order = DistributedSampler(rollouts, num_replicas=ranks, rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(rollouts, batch_size=1, sampler=in_order)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        batch = {key: value[0] for key, value in batch.items()}  # the loader's batches hold one file each
        ratio = torch.exp(log_prob(self.policy, batch["context"], batch["arm"]) - batch["log_prob"])
        advantage = batch["reward"] - batch["reward"].mean()
        clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
        self.log("reward", batch["reward"].mean(), sync_dist=True, prog_bar=True)
        return -torch.min(ratio * advantage, clipped * advantage).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=self.lr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("rollouts", type=Path)
    p.add_argument("--publish", required=True, help="tcp://HOST:PORT")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes the trained weights here")
    args = p.parse_args()
    L.seed_everything(3)
    learner = Learner(args.rollouts, args.steps)
    trainer = L.Trainer(
        accelerator="cpu", strategy="torchpass_ddp", devices=args.ranks, max_steps=args.steps,
        use_distributed_sampler=False,
        callbacks=[TorchPassCallback(publish_weights=args.publish, publish_every_n_steps=1)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(learner)
    if trainer.global_rank == 0:
        torch.save(learner.policy.state_dict(), args.out)


if __name__ == "__main__":
    main()
