"""A user's ``LightningCLI`` script, run by the tests under ``torchpass launch``: the demo's classifier and
augmenting loader as a ``LightningDataModule``, the strategy and callback chosen on the command line
(``fit --trainer.strategy=torchpass_ddp --trainer.callbacks+=torchpass_plugins.TorchPassCallback``). With
``--out DIR`` first, every logical rank records there the optimizer steps it applied and writes its full
state at the end (``state_rank{r}.pt``)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from torchpass_plugins.demo.train import Augmented, Classifier, make_dataset, rank_state


class NoisyData(L.LightningDataModule):
    """The demo's data set, read by loader workers that add random noise to each sample."""

    def __init__(self, batch_size: int = 8, workers: int = 2, noise: float = 0.05) -> None:
        super().__init__()
        self.batch_size, self.workers, self.noise = batch_size, workers, noise

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Augmented(make_dataset(), self.noise), batch_size=self.batch_size, shuffle=True,
                          num_workers=self.workers)


class RecordingCLI(LightningCLI):
    out: Path | None = None

    def before_fit(self) -> None:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.model.out_dir = self.out

    def after_fit(self) -> None:
        if self.out is not None:
            torch.save(rank_state(self.trainer, self.model), self.out / f"state_rank{self.trainer.global_rank}.pt")


def main() -> None:
    if sys.argv[1:2] == ["--out"]:
        RecordingCLI.out = Path(sys.argv[2])
        del sys.argv[1:3]
    RecordingCLI(Classifier, NoisyData, seed_everything_default=7, save_config_callback=None)


if __name__ == "__main__":
    main()
