"""The framework internals ``torchpass_plugins._compat`` relies on still have the shape it reads: a new
Lightning (or Python) that moved them fails here, by name, before any job could go wrong."""

from __future__ import annotations

import subprocess
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from torchpass_plugins._compat.lightning import (
    dump_checkpoint,
    load_rank_local_state,
    rank_local_state,
    restore_at_fit_start,
    restoring_a_checkpoint,
    rewind_loops,
)
from torchpass_plugins.testing.chaos.oracle import differences


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


def test_lightnings_checkpoint_routes_dump_and_restore_in_memory():
    done = _fit(3)
    checkpoint = dump_checkpoint(done)
    assert checkpoint["global_step"] == 3 and checkpoint["optimizer_states"] and checkpoint["state_dict"]
    model = Tiny()
    fresh = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    assert not restoring_a_checkpoint(fresh)
    restore_at_fit_start(fresh, checkpoint)
    assert restoring_a_checkpoint(fresh)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    fresh.fit(model, DataLoader(data, batch_size=4))  # restored at step 3 of 3: no step runs
    assert fresh.global_step == 3
    restored, original = model.state_dict(), done.lightning_module.state_dict()
    assert all(torch.equal(restored[k], original[k]) for k in original)


def test_the_fit_loops_progress_rewinds_to_an_earlier_snapshot():
    snapshot = _fit(2).fit_loop.state_dict()
    later = _fit(5)
    rewind_loops(later.fit_loop, snapshot)
    assert later.global_step == 2 and later.fit_loop.state_dict() == snapshot


def test_a_forked_worker_runs_the_interpreters_exit_steps_before_leaving():
    script = ("import atexit, os, threading, time\n"
              "from torchpass_plugins._compat.interpreter import run_exit_steps\n"
              "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
              "atexit.register(lambda: print('atexit ran', flush=True))\n"
              "run_exit_steps()\n"
              "print('then leaving', flush=True)\n"
              "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:3] == ["thread done", "atexit ran", "then leaving"], done.stdout + done.stderr
