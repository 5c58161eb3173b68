"""The data of the unmodified scripts: samples of a fixed random problem, each with random noise added as it
loads (in the loader's workers), as augmentation does."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Noisy(Dataset):
    def __init__(self, samples: int, features: int = 12) -> None:
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(samples, features, generator=g)
        self.y = (self.x @ torch.randn(features, 3, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.05 * torch.randn_like(self.x[i]), self.y[i]
