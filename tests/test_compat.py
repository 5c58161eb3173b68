"""The Lightning internals ``torchpass_plugins._compat.lightning`` relies on still have the shape it reads:
a new Lightning that moved them fails here, by name, before any job could go wrong."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from torchpass_plugins._compat.lightning import load_rank_local_state, rank_local_state
from torchpass_plugins.chaos.oracle import differences


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.acc = MulticlassAccuracy(num_classes=3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.acc(logits, y)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.log("acc", self.acc, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(steps: int) -> L.Trainer:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    return trainer


def test_a_ranks_logging_state_moves_to_another_process_whole():
    source, target = _fit(5), _fit(2)
    state = rank_local_state(source)
    assert state["results"] and state["metrics"] and state["logger"]["callback"]
    assert differences(state, rank_local_state(target))  # 5 steps logged against 2
    load_rank_local_state(target, state)
    assert not differences(state, rank_local_state(target))
    assert not differences(dict(source.callback_metrics), dict(target.callback_metrics))
