"""The training state's parts, in-process: the layout torch's distributed state dicts have, without their
side effect, and a round trip through the values every mechanism moves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from torchpass_plugins.core.training_state import (
    MODEL,
    OPTIMIZER,
    TRAINER,
    Held,
    ModelState,
    OptimizerState,
    capture,
)
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.state_parts import ResumedSnapshot
from torchpass_plugins.storage.snapshot_parts import snapshot_values
from torchpass_plugins.storage.snapshot_store import SnapshotStore


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(16, 4, generator=gen)).square().mean().backward()
        optimizer.step()


def test_reading_the_optimizer_state_before_its_first_step_changes_nothing():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = OptimizerState(model, [optimizer]).state_dict()
    assert state["state"] == {} and not optimizer.state
    assert state["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    get_optimizer_state_dict(model, [optimizer])  # torch's own steps it once (lr 0) to create the state
    assert optimizer.state, "torch's behaviour changed: reconsider OptimizerState"


def test_the_optimizer_part_has_the_layout_of_torchs_distributed_state_dict():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, optimizer, 2)
    ours, torchs = OptimizerState(model, [optimizer]).state_dict(), get_optimizer_state_dict(model, [optimizer])
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys()
    for name, values in torchs["state"].items():
        assert ours["state"][name].keys() == values.keys()
        assert all(torch.equal(ours["state"][name][k], v) for k, v in values.items())


def test_a_state_loaded_into_another_process_continues_bit_equal():
    model, other = _model(), _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.5)
    # A parameter that has not stepped yet has no optimizer state: the receiver drops what it had.
    model[2].weight.requires_grad_(False)
    _train(model, optimizer, 3)
    _train(other, other_optimizer, 1, seed=7)
    model[2].weight.requires_grad_(True)
    values = copy.deepcopy(capture({MODEL: ModelState(model), OPTIMIZER: OptimizerState(model, [optimizer])}))
    assert "2.weight" not in values[OPTIMIZER]["state"]
    ModelState(other).load_state_dict(values[MODEL])
    OptimizerState(other, [other_optimizer]).load_state_dict(values[OPTIMIZER])
    assert other_optimizer.param_groups[0]["lr"] == 0.01 and other[2].weight not in other_optimizer.state
    _train(model, optimizer, 2, seed=3)
    _train(other, other_optimizer, 2, seed=3)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_model_state_of_another_model_is_refused_by_name():
    values = ModelState(_model()).state_dict()
    values["extra.weight"] = torch.zeros(1)
    try:
        ModelState(_model()).load_state_dict(values)
    except RuntimeError as exc:
        assert "unexpected ['extra.weight']" in str(exc)
    else:
        raise AssertionError("loaded a state with an unexpected entry")


def test_the_loading_template_has_the_stored_entries_only():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    stored = {"state.0.weight.step": (torch.Size([]), torch.float32),
              "state.0.weight.exp_avg": (torch.Size([8, 4]), torch.float32),
              "state.gone.weight.step": (torch.Size([]), torch.float32),
              "param_groups.0.lr": None, "param_groups.0.params": None}
    template = OptimizerState(model, [optimizer]).loading_template(lambda: stored)
    assert list(template["state"]) == ["0.weight"]
    assert template["state"]["0.weight"]["exp_avg"].shape == (8, 4)
    assert template["param_groups"] == [{"lr": 0.01, "params": [n for n, _ in model.named_parameters()]}]


def test_a_snapshot_resumes_an_optimizer_whose_parameters_had_not_all_stepped(tmp_path):
    # The snapshot holds no optimizer state for a parameter that was frozen so far: the resumed optimizer
    # has none either (none made up), and both runs go on bit-equal once it trains.
    model, fresh = _model(), _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    model[2].weight.requires_grad_(False)
    _train(model, optimizer, 2)
    model[2].weight.requires_grad_(True)
    store = SnapshotStore(str(tmp_path / "snapshots"))
    parts = {MODEL: ModelState(model), OPTIMIZER: OptimizerState(model, [optimizer]), TRAINER: Held({"step": 2})}
    save = store.save(2, rank=0, world_size=1, writers=[0], state=snapshot_values(parts, rank=0))
    save.run(dict(save.values), seed=7, model="", timeout=30)

    resumed = ResumedSnapshot(store, store.manifest(2), rank=0)
    into = {MODEL: ModelState(fresh), OPTIMIZER: OptimizerState(fresh, [fresh_optimizer])}
    resumed.load_model(into)
    resumed.load_optimizers(into)
    assert resumed.trainer == {"step": 2} and resumed.own is None
    assert fresh[2].weight not in fresh_optimizer.state and fresh_optimizer.param_groups[0]["lr"] == 0.01
    _train(model, optimizer, 2, seed=3)
    _train(fresh, fresh_optimizer, 2, seed=3)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


class _WithExtraState(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.calls = 0

    def get_extra_state(self) -> dict:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        self.calls = state["calls"]


def test_a_modules_extra_state_and_an_optimizers_own_dtype_move_as_they_are():
    source, target = _WithExtraState(), _WithExtraState()
    source.calls = 5
    ModelState(target).load_state_dict(copy.deepcopy(ModelState(source).state_dict()))
    assert target.calls == 5 and torch.equal(target.weight, source.weight)
    # An optimizer that keeps its state in another dtype than the parameter's: the state keeps its dtype.
    optimizer, other = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (source, target))
    optimizer.state[source.weight]["momentum_buffer"] = torch.ones(2, 2, dtype=torch.float64)
    OptimizerState(target, [other]).load_state_dict(OptimizerState(source, [optimizer]).state_dict())
    assert other.state[target.weight]["momentum_buffer"].dtype == torch.float64


def test_an_optimizer_of_parameters_outside_the_module_is_refused_by_name():
    stray = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match="not one of the module's"):
        OptimizerState(_model(), [torch.optim.SGD([stray], lr=0.1)]).state_dict()
