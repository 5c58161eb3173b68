"""A character-level GPT small enough to train in seconds on a CPU, and the text it learns.

The text is generated (a few thousand sentences from a tiny grammar, the same for a given seed), so the
example needs no download. Nothing here knows about torchpass: it is a plain LightningModule and
LightningDataModule.
"""

from __future__ import annotations

import random

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

ALPHABET = "\n .abcdefghijklmnopqrstuvwxyz"
_WHO = ["the spare", "a worker", "the agent", "rank one", "rank two", "the coordinator", "the donor"]
_DOES = ["takes over", "joins the pool", "sends its state", "applies the step", "waits at the boundary",
         "rebuilds the group", "votes to commit", "replays the batch"]
_WHEN = ["at once", "after the kill", "in generation two", "before the next step", "without a restart"]


def make_text(sentences: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = (f"{rng.choice(_WHO)} {rng.choice(_DOES)} {rng.choice(_WHEN)}." for _ in range(sentences))
    return "\n".join(lines) + "\n"


class Windows(Dataset):
    """Overlapping windows of the encoded text: input ``block`` characters, target shifted by one."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.block : (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class TextDataModule(L.LightningDataModule):
    vocab_size = len(ALPHABET)

    def __init__(self, sentences: int = 2000, block_size: int = 32, batch_size: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        text = make_text(self.hparams.sentences, self.hparams.seed)
        ids = torch.tensor([ALPHABET.index(c) for c in text], dtype=torch.long)
        self.train_set = Windows(ids, self.hparams.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, dim: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.ln(self.blocks(x)))


class GPTModule(L.LightningModule):
    """The network is one child (``self.gpt``), which is also the unit ``torchpass_fsdp`` shards by default."""

    def __init__(self, vocab_size: int, block_size: int = 32, dim: int = 48, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt = TinyGPT(vocab_size, block_size, dim, layers, heads, dropout)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.gpt(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
