"""The framework internals ``torchpass_plugins._compat`` relies on still have the shape it reads: a new
Lightning (or Python) that moved them fails here, by name, before any job could go wrong. And importing
torchpass reaches into no process-wide hook: it registers its strategy names through Lightning's registry."""

from __future__ import annotations

import copy
import subprocess
import sys
import types
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from torchpass_plugins._compat.lightning import (
    continue_from_boundary,
    dataloader_with_sampler,
    dump_checkpoint,
    load_rank_local_state,
    optimizers_to_device,
    rank_local_state,
    reopen_epoch_cut_by_fit_end,
    replays_a_batch_end,
    restore_at_fit_start,
    restoring_a_checkpoint,
    rewind_loops,
    users_sampler,
    wait_in_prepare_data,
)
from torchpass_plugins._compat.lightning_trainer import resolve_auto_devices_to_active_ranks
from torchpass_plugins._compat.torch_distributed import carry_name, nccl_options
from torchpass_plugins.errors import ConfigError
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


class Preparing(Tiny):
    def prepare_data(self) -> None:
        pass


def _trainer(steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)),
                      batch_size=4)


def _fit(steps: int) -> L.Trainer:
    trainer = _trainer(steps)
    trainer.fit(Tiny(), _data())
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


def test_a_checkpoint_of_a_fit_stopped_mid_epoch_resumes_inside_that_epoch():
    # 16 batches per epoch: stopped by max_steps after 5, Lightning counts epoch 0 as finished.
    stopped = dump_checkpoint(_fit(5))
    assert stopped["epoch"] == 1 and stopped["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1
    reopen_epoch_cut_by_fit_end(stopped)
    progress = stopped["loops"]["fit_loop"]["epoch_progress"]
    assert stopped["epoch"] == 0 and progress["current"] == progress["total"] == {
        "ready": 1, "started": 1, "processed": 0, "completed": 0}
    whole_epoch = dump_checkpoint(_fit(16))  # stopped after the epoch's last batch: the next epoch is due
    unchanged = copy.deepcopy(whole_epoch)
    reopen_epoch_cut_by_fit_end(whole_epoch)
    assert not differences(unchanged["loops"], whole_epoch["loops"]) and whole_epoch["epoch"] == 1


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


def test_optimizer_state_moves_to_a_device_but_its_step_counter_stays():
    net = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizers_to_device([optimizer], torch.device("meta"))
    state = optimizer.state[net.weight]
    assert state["exp_avg"].device.type == "meta" and state["step"].device.type == "cpu"


def test_a_dataloader_is_rebuilt_around_another_sampler_with_its_other_arguments():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=3, drop_last=True)
    sampler = RandomSampler(loader.dataset)
    rebuilt = dataloader_with_sampler(loader, sampler)
    assert type(rebuilt) is DataLoader and rebuilt.sampler is sampler
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.dataset) == (3, True, loader.dataset)


def test_the_users_sampler_is_found_inside_lightnings_distributed_wrapper():
    mine = SequentialSampler(range(8))
    assert users_sampler(DistributedSamplerWrapper(mine, num_replicas=2, rank=0, shuffle=False)) is mine
    assert users_sampler(mine) is None


class Validated(Tiny):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.cross_entropy(self.net(batch[0]), batch[1]))


def _validating_trainer(*callbacks) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=20, val_check_interval=2, limit_val_batches=1,
                     num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=list(callbacks))


def _before_each_advance(trainer: L.Trainer, before) -> None:
    """What the strategies do: run ``before(loop, fetcher)`` at the start of the epoch loop's ``advance``."""
    loop = trainer.fit_loop.epoch_loop
    original = type(loop).advance.__get__(loop)
    loop.advance = lambda fetcher: (before(loop, fetcher), original(fetcher))


def _once(action):
    """``action`` on the first call only."""
    calls: list[object] = []

    def call(*args) -> None:
        if not calls:
            calls.append(action(*args))

    return call


AFTER_A_VALIDATION = (0, 4)  # (epoch, batches taken in it): validation runs every 2 batches
AT_AN_EPOCHS_START = (1, 0)  # 16 batches per epoch


def _resumed_from_a_boundary(at: tuple[int, int], continue_at_boundary: bool) -> tuple[dict, dict]:
    """A run, and a second one restored from the first one's state at the start of the ``advance`` taking
    batch ``at`` (as a spare receives it); both fit loops' final state."""
    uninterrupted, taken = _validating_trainer(), {}

    def take(loop, fetcher) -> None:
        if (uninterrupted.current_epoch, loop.batch_progress.current.ready) == at:
            taken.setdefault("state", dump_checkpoint(uninterrupted))

    _before_each_advance(uninterrupted, take)
    uninterrupted.fit(Validated(), _data(), _data())
    resumed = _validating_trainer()
    restore_at_fit_start(resumed, taken["state"])
    if continue_at_boundary:
        _before_each_advance(resumed, _once(lambda loop, fetcher: continue_from_boundary(loop)))
    resumed.fit(Validated(), _data(), _data())
    return uninterrupted.fit_loop.state_dict(), resumed.fit_loop.state_dict()


@pytest.mark.parametrize("at", [AFTER_A_VALIDATION, AT_AN_EPOCHS_START], ids=["after-validation", "epoch-start"])
def test_a_loop_restored_at_a_boundary_goes_on_as_the_uninterrupted_one(at):
    uninterrupted, resumed = _resumed_from_a_boundary(at, continue_at_boundary=True)
    assert resumed == uninterrupted
    # Lightning alone resumes it as a checkpoint saved inside the batch's end: that end is replayed
    uninterrupted, replayed = _resumed_from_a_boundary(at, continue_at_boundary=False)
    stepped = "epoch_loop.state_dict"
    assert replayed[stepped]["_batches_that_stepped"] == uninterrupted[stepped]["_batches_that_stepped"] + 1


class _SaveOnValidationEnd(L.Callback):
    """Where a user's ``ModelCheckpoint(monitor=...)`` saves: inside the batch's end."""

    def __init__(self) -> None:
        self.saved: dict | None = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_step == 4 and self.saved is None:
            self.saved = dump_checkpoint(trainer)


def test_a_users_checkpoint_saved_at_a_validations_end_is_replayed_before_a_batch_is_taken():
    saver = _SaveOnValidationEnd()
    _validating_trainer(saver).fit(Validated(), _data(), _data())
    resumed, seen = _validating_trainer(), []
    restore_at_fit_start(resumed, saver.saved)
    _before_each_advance(resumed, lambda loop, fetcher: seen.append(
        (replays_a_batch_end(loop, fetcher), loop.batch_progress.total.ready)))
    resumed.fit(Validated(), _data(), _data())
    assert seen[:3] == [(True, 4), (False, 4), (False, 5)]  # the replay takes no batch; then one a time


def test_prepare_data_waits_through_the_strategys_own_wait():
    waited = []
    trainer = _trainer(1)
    wait_in_prepare_data(trainer, waited.append)
    trainer.fit(Preparing(), _data())
    assert waited == ["prepare_data.0"]


def test_a_python_process_group_carries_a_named_cpu_backend():
    group = dist.ProcessGroup(0, 1)
    carry_name(group, timedelta(seconds=5))
    assert isinstance(group._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch has no NCCL (CPU build)")
def test_nccl_options_take_the_collective_timeout():
    assert nccl_options(timedelta(seconds=7))._timeout == timedelta(seconds=7)


def test_importing_torchpass_takes_no_process_wide_hook_and_registers_once_lightning_is_there():
    script = ("import sys\n"
              "hooks = (list(sys.meta_path), sys.excepthook)\n"
              "import torchpass_plugins\n"
              "assert (list(sys.meta_path), sys.excepthook) == hooks and 'lightning' not in sys.modules\n"
              "from lightning.pytorch.strategies import StrategyRegistry\n"
              "assert 'torchpass_ddp' not in StrategyRegistry\n"
              "torchpass_plugins.register_strategies()\n"
              "print(sorted(n for n in StrategyRegistry if n.startswith('torchpass')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "['torchpass_ddp', 'torchpass_fsdp']", done.stdout + done.stderr
    after = subprocess.run([sys.executable, "-c", "import lightning, torchpass_plugins\n"
                            "from lightning.pytorch.strategies import StrategyRegistry\n"
                            "print('torchpass_fsdp' in StrategyRegistry)"], capture_output=True, text=True, timeout=120)
    assert after.stdout.strip() == "True", after.stdout + after.stderr


@pytest.mark.parametrize(
    ("devices", "strategy", "num_nodes", "expected"),
    [("auto", "torchpass_ddp", 2, 3),  # 6 active ranks over 2 nodes
     ("auto", types.SimpleNamespace(strategy_name="torchpass_fsdp"), 1, 6),  # a strategy object
     (2, "torchpass_ddp", 3, 2),  # an explicit count stays (the strategy refuses a mismatch)
     ("auto", "ddp", 1, 1)],  # Lightning's own strategies: Lightning's "auto" (one CPU device)
)
def test_devices_auto_with_a_torchpass_strategy_is_the_jobs_active_ranks_per_node(monkeypatch, devices, strategy,
                                                                                 num_nodes, expected):
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    monkeypatch.setattr(_AcceleratorConnector, "_set_devices_flag_if_auto_passed",
                        _AcceleratorConnector._set_devices_flag_if_auto_passed)  # restored afterwards
    resolve_auto_devices_to_active_ranks(6, ("torchpass_ddp", "torchpass_fsdp"))
    connector = types.SimpleNamespace(_devices_flag=devices, _strategy_flag=strategy, _num_nodes_flag=num_nodes,
                                      accelerator=CPUAccelerator())
    _AcceleratorConnector._set_devices_flag_if_auto_passed(connector)
    assert connector._devices_flag == expected


def test_devices_auto_that_cannot_split_the_active_ranks_evenly_over_the_nodes_is_refused(monkeypatch):
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    monkeypatch.setattr(_AcceleratorConnector, "_set_devices_flag_if_auto_passed",
                        _AcceleratorConnector._set_devices_flag_if_auto_passed)
    resolve_auto_devices_to_active_ranks(5, ("torchpass_ddp",))
    connector = types.SimpleNamespace(_devices_flag="auto", _strategy_flag="torchpass_ddp", _num_nodes_flag=2)
    with pytest.raises(ConfigError, match="cannot split the job's 5 active ranks evenly over num_nodes=2"):
        _AcceleratorConnector._set_devices_flag_if_auto_passed(connector)


def test_every_trainer_and_accelerator_built_is_seen_before_it_initializes_anything():
    script = ("import sys\n"
              "from torchpass_plugins._compat.accelerate import before_accelerator\n"
              "from torchpass_plugins._compat.lightning_trainer import rewrite_trainer_arguments\n"
              "seen = []\n"
              "before_accelerator(lambda: seen.append('accelerator'))\n"
              "assert 'accelerate' not in sys.modules  # patched as it is imported\n"
              "def rewrite(arguments):\n"
              "    seen.append(arguments)\n"
              "    return dict(arguments, max_steps=7), lambda trainer: seen.append(trainer.max_steps)\n"
              "rewrite_trainer_arguments(rewrite)\n"
              "import lightning as L\n"
              "class Mine(L.Trainer):\n"
              "    def __init__(self, **kwargs):\n"
              "        super().__init__(logger=False, **kwargs)\n"
              "Mine(accelerator='cpu', strategy='auto', enable_progress_bar=False)\n"
              "from accelerate import Accelerator\n"
              "Accelerator(cpu=True)\n"
              "print(seen)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == (
        "[{'logger': False, 'accelerator': 'cpu', 'strategy': 'auto', 'enable_progress_bar': False}, 7, "
        "'accelerator']"), done.stdout + done.stderr


def test_what_accelerate_prepares_and_each_pass_over_a_prepared_loader_are_seen():
    """The prepared objects reach the hook before the script; a pass over the loader goes through ``passes``
    (whose ``plain()`` yields what Accelerate would), another loader and Accelerate's skipping copy do not."""
    script = ("import torch\n"
              "from torch.utils.data import DataLoader\n"
              "from accelerate import Accelerator\n"
              "from torchpass_plugins._compat.accelerate import after_prepare, is_prepared_loader, iterate_through\n"
              "seen = []\n"
              "def passes(loader, plain):\n"
              "    seen.append('pass')\n"
              "    return plain()\n"
              "def prepared(accelerator, objects):\n"
              "    seen.append([type(o).__name__ for o in objects])\n"
              "    iterate_through(objects[0], passes)\n"
              "accelerator = Accelerator(cpu=True)\n"
              "after_prepare(prepared)\n"
              "ours, other = accelerator.prepare(DataLoader(list(range(6)), batch_size=2),\n"
              "                                  DataLoader(list(range(4)), batch_size=2))\n"
              "assert is_prepared_loader(ours) and not is_prepared_loader([])\n"
              "batches = [b.tolist() for b in ours] + [b.tolist() for b in ours]\n"
              "assert batches == [[0, 1], [2, 3], [4, 5]] * 2, batches\n"
              "assert [b.tolist() for b in other] == [[0, 1], [2, 3]]\n"
              "assert [b.tolist() for b in accelerator.skip_first_batches(ours, 1)] == [[2, 3], [4, 5]]\n"
              "print(seen)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[['DataLoaderShard', 'DataLoaderShard'], 'pass', 'pass']", (
        done.stdout + done.stderr)
