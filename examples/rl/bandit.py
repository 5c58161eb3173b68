"""The environment and the policy both sides share: a contextual bandit with a small policy network.

Each round shows a context (8 numbers) and the agent pulls one of 4 arms; the arm that pays is fixed by the
context (the best of a hidden linear scoring), so a policy that reads the context well earns close to 1 per
round and a random one 1/4. Contexts are drawn from a generator seeded by the batch's index, so a batch is
the same whoever generates it.
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES, ARMS = 8, 4
_HIDDEN_SCORES = torch.randn(FEATURES, ARMS, generator=torch.Generator().manual_seed(0))


def contexts(index: int, rounds: int) -> torch.Tensor:
    return torch.randn(rounds, FEATURES, generator=torch.Generator().manual_seed(10_000 + index))


def rewards(context: torch.Tensor, arms: torch.Tensor) -> torch.Tensor:
    return (arms == (context @ _HIDDEN_SCORES).argmax(dim=1)).float()


class Policy(nn.Module):
    """Logits over the arms. Its BatchNorm's running statistics are buffers: they travel with each published
    version, and a replica plays in ``eval()`` mode with them. (The trainer's ratio of probabilities uses the
    batch's statistics, so it is not exactly 1 for the version that played; the clipping absorbs that.)"""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Linear(hidden, ARMS))

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.net(context)


def log_prob(policy: nn.Module, context: torch.Tensor, arms: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(policy(context), dim=1).gather(1, arms[:, None]).squeeze(1)
