"""Small pieces with no training: per-step RNG, fault specs, launch validation."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch

from torchpass_plugins.config import AgentConfig, TorchPassConfig
from torchpass_plugins.control.etcd_gateway import PASSWORD_VARIABLE
from torchpass_plugins.control.launch_config import LaunchConfig
from torchpass_plugins.control.protocol import Roster
from torchpass_plugins.core import rng
from torchpass_plugins.core.step_signals import StepSignals
from torchpass_plugins.testing.faults import Fault


def test_step_seeds_are_distinct_and_stable():
    seeds = {rng.step_seed(7, r, s) for r in range(4) for s in range(1000)}
    assert len(seeds) == 4000
    assert rng.step_seed(7, 1, 5) == rng.step_seed(7, 1, 5)


def test_reseed_reproduces_every_stream():
    rng.reseed(3, 1, 10)
    first = (torch.rand(3), random.random())
    torch.rand(100)
    rng.reseed(3, 1, 10)
    again = (torch.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1]


def test_fault_parse():
    assert Fault.parse("kill@rank=1,step=5,phase=reduce") == Fault("kill", 1, 5, "reduce")
    assert Fault.parse("stop@rank=0,step=2") == Fault("stop", 0, 2, "boundary")
    with pytest.raises(ValueError, match="phases"):
        Fault.parse("kill@rank=1,step=5,phase=nowhere")
    between = Fault.parse("kill@rank=2,step=4,phase=data,micro=2")
    assert between == Fault("kill", 2, 4, "data", micro=2) and str(between) == "kill@rank=2,step=4,phase=data,micro=2"
    assert [between.matches(2, 4, "data", reached) for reached in range(4)] == [False, False, True, False]
    assert Fault.parse("kill@rank=2,step=4,phase=data").matches(2, 4, "data", 3)  # no micro: any time


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"spares": 4}, "leaves no active rank"),
        ({"nproc_per_node": 0}, "at least 1"),
        ({"nnodes": 2, "node_rank": 2, "token": "t", "rdzv_endpoint": "h:1"}, "--node-rank"),
        ({"nnodes": 2, "rdzv_endpoint": "h:1"}, "TORCHPASS_JOIN_TOKEN"),
        ({"nnodes": 2, "token": "t"}, "fixed --rdzv-endpoint"),
        ({"heartbeat_timeout": 0.1}, "--heartbeat-timeout"),
    ],
)
def test_launch_config_rejects_impossible_layouts(changes, message):
    derived = LaunchConfig.derive(["train.py"], TorchPassConfig(spares=0), AgentConfig(nproc_per_node=4), token="")
    config = dataclasses.replace(derived, **changes)
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_launch_config_counts_active_ranks():
    config = LaunchConfig.derive(["t.py"], TorchPassConfig(spares=2),
                                 AgentConfig(nproc_per_node=3, nnodes=2, rdzv_endpoint="h:29500"), token="t")
    config.validate()
    assert (config.processes, config.world_size) == (6, 4)


def test_every_event_the_code_emits_is_documented():
    root = Path(__file__).resolve().parents[1]
    emitted = {m for f in (root / "torchpass_plugins").rglob("*.py")
               for m in re.findall(r'emit\(\s*"([a-z_]+)"', f.read_text())}
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", (root / "docs" / "events.md").read_text(), re.MULTILINE))
    assert len(emitted) > 30
    assert emitted <= documented, f"undocumented events: {sorted(emitted - documented)}"
    assert documented <= emitted | {"time", "event", "source"}, f"documented, never emitted: {documented - emitted}"


def test_a_state_that_crossed_host_memory_goes_back_to_each_tensors_device_type():
    from torchpass_plugins.core.tree import device_kinds, onto_device_kinds
    from torchpass_plugins.testing.chaos.oracle import differences

    state = {"metric": torch.zeros(2, device="meta"), "logged": [torch.ones(1), 3]}
    kinds = device_kinds(state)
    assert kinds == ["meta", "cpu"]
    received = {"metric": torch.zeros(2), "logged": [torch.ones(1), 3]}  # as a transfer hands it out
    assert differences(state, received) == ["/metric: on cpu instead of meta"]
    back = onto_device_kinds(received, kinds)
    assert back["metric"].device.type == "meta" and back["logged"][0].device.type == "cpu" and back["logged"][1] == 3


def test_an_etcd_store_needs_member_addresses_and_a_fresh_job_name():
    def layout(**agent) -> LaunchConfig:
        agent_config = AgentConfig(rdzv_backend="etcd", nproc_per_node=3, **agent)
        return LaunchConfig.derive(["train.py"], TorchPassConfig(), agent_config, token="t")

    layout(rdzv_endpoint="127.0.0.1:2379,127.0.0.1:2380", rdzv_id="run-7").validate()
    with pytest.raises(ValueError, match="--rdzv-id NAME"):
        layout(rdzv_endpoint="127.0.0.1:2379").validate()
    with pytest.raises(ValueError, match="without a scheme"):
        layout(rdzv_endpoint="http://127.0.0.1:2379", rdzv_id="run-7").validate()


def test_etcd_credentials_are_checked_before_the_job_and_carried_to_every_process(tmp_path, monkeypatch):
    def layout(**agent) -> LaunchConfig:
        agent_config = AgentConfig(rdzv_backend="etcd", rdzv_endpoint="127.0.0.1:2379", rdzv_id="run-7", **agent)
        return LaunchConfig.derive(["train.py"], TorchPassConfig(spares=0), agent_config, token="t")

    ca, cert, key = (tmp_path / name for name in ("ca.crt", "c.crt", "c.key"))
    for f in (ca, cert, key):
        f.write_text("x")
    monkeypatch.delenv(PASSWORD_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=r"--etcd-cacert .*no such file"):
        layout(etcd_cacert=str(tmp_path / "missing.crt")).validate()
    with pytest.raises(ValueError, match="go together"):
        layout(etcd_cacert=str(ca), etcd_cert=str(cert)).validate()
    with pytest.raises(ValueError, match=PASSWORD_VARIABLE):
        layout(etcd_user="trainer").validate()
    with pytest.raises(ValueError, match="apply to --rdzv-backend etcd only"):
        dataclasses.replace(layout(etcd_user="trainer"), rdzv_backend="c10d").validate()
    monkeypatch.setenv(PASSWORD_VARIABLE, "pw")
    config = layout(etcd_cacert=str(ca), etcd_cert=str(cert), etcd_key=str(key), etcd_user="trainer")
    config.validate()
    assert "pw" not in config.store_address  # the password stays in the environment
    assert config.store_address.startswith("etcd://127.0.0.1:2379/run-7?cacert=")
    assert "user=trainer" in config.store_address


def test_a_group_replaced_by_the_agreed_migration_is_recovered_as_that_migration():
    # The moving worker leaves at the boundary without waiting for the others (its rank-state copy goes
    # through a mailbox): a rank that reaches the boundary later finds the migration's roster out already.
    rosters = {0: Roster(0, ("a", "b", "c")), 1: Roster(1, ("a", "spare", "c"), reason="migrate rank 1: hot")}
    member = type("Member", (), {"latest_gen": 0, "roster": lambda self, gen: rosters[gen]})()
    group = type("Group", (), {"gen": 0, "rank": 0})()
    signals = StepSignals(type("Env", (), {"straggler_window": 0, "world_size": 3})(), member, group, None)
    signals.drain = (6, 1, "b")  # agreed in the vote of step 5
    assert signals.replaced_by_drain(6) is None  # no newer roster: not replaced
    member.latest_gen = 1
    assert signals.replaced_by_drain(6) == 1
    assert signals.replaced_by_drain(5) is None  # not at the agreed boundary: a failure
    rosters[1] = Roster(1, ("a", "b", "spare"), reason="replace rank(s) [2]")
    assert signals.replaced_by_drain(6) is None  # another rank was lost
    rosters[1] = Roster(1, ("a", "spare", "c"), reason="replace rank(s) [1]")
    assert signals.replaced_by_drain(6) is None  # the moving worker died before it left: a failure
