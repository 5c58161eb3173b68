"""The configuration tree: validation names the bad key, Hydra can compose it, the reference is current."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchpass_plugins.config import (
    AgentConfig,
    HealthSettings,
    StragglerConfig,
    TimeoutConfig,
    TorchPassConfig,
    from_mapping,
    in_torchpass_worker,
    register_configs,
)
from torchpass_plugins.config_files import hydra_configs, reference
from torchpass_plugins.control.launch_config import LaunchConfig
from torchpass_plugins.control.worker_env import VARIABLE, WorkerEnv
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.environment import NotUnderTorchPass

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "dpp"}, "mode='dpp' is not allowed; use ddp | fsdp"),
        ({"spares": -1}, "spares=-1 is not allowed; use an integer >= 0"),
        ({"snapshots": {"when_busy": "queue"}}, "snapshots.when_busy='queue' is not allowed; use skip | wait"),
        ({"snapshots": {"every_n_steps": 10}}, "snapshots.dir=None is not allowed; use a path or fsspec URL"),
        ({"health": {"source": "smi"}}, "health.source='smi' is not allowed; use nvml | file:PATH | off"),
        ({"stragglers": {"factor": 0.5}}, "stragglers.factor=0.5 is not allowed; use a number > 1"),
        ({"process_group_backend": "mpi"}, "process_group_backend='mpi' is not allowed; use null | gloo | nccl"),
        ({"snapshot": {"keep": 2}}, "unknown key snapshot; known: enabled, mode, spares"),
        ({"snapshots": {"kep": 2}}, "unknown key snapshots.kep; known: dir, every_n_steps, keep, when_busy"),
    ],
)
def test_a_bad_setting_is_one_clear_error_naming_the_key(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("|", r"\|")):
        from_mapping(values)


def _compose(tmp_path, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_configs()
    (tmp_path / "config.yaml").write_text("defaults:\n  - torchpass: ddp\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        return compose("config", overrides=overrides)


def test_hydra_presets_and_overrides_turn_into_launch_flags_and_trainer_arguments(tmp_path):
    cfg = _compose(tmp_path, ["torchpass=fsdp", "torchpass.spares=2", "torchpass.snapshots.dir=memory://s",
                              "torchpass.snapshots.every_n_steps=5"])
    config = from_mapping(OmegaConf.to_container(cfg.torchpass))
    assert (config.enabled, config.mode, config.spares, config.snapshots.every_n_steps) == (True, "fsdp", 2, 5)
    argv = config.launch_argv()
    assert argv[argv.index("--spares") + 1] == "2" and argv[argv.index("--straggler-policy") + 1] == "warn"
    with pytest.raises(NotUnderTorchPass, match="torchpass launch"):  # the strategies live in workers only
        config.trainer_kwargs()
    off = from_mapping(OmegaConf.to_container(_compose(tmp_path, ["torchpass=off"]).torchpass))
    assert off.trainer_kwargs() == {}  # plain Lightning


def test_hydra_refuses_a_misspelled_key_by_name(tmp_path):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as failure:
        _compose(tmp_path, ["torchpass.snapshot.keep=2"])
    assert "Key 'snapshot' not in 'TorchPassConfig'" in str(failure.value.__cause__)


def test_the_configuration_reference_is_generated_from_the_dataclasses():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == reference(), "stale: run python -m torchpass_plugins.config > docs/configuration.md"


def test_the_strategy_and_callback_yaml_are_generated_from_the_table_trainer_kwargs_uses():
    for name, text in hydra_configs().items():
        committed = (REPO / "configs" / name).read_text()
        assert committed == text, f"stale {name}: run python -m torchpass_plugins.config --write-hydra-configs"


def test_the_launch_flags_are_made_from_the_settings_and_launch_argv_round_trips(monkeypatch):
    from torchpass_plugins import cli

    launched: list[LaunchConfig] = []
    monkeypatch.setattr(cli, "launch", launched.append)
    monkeypatch.delenv("TORCHPASS_JOIN_TOKEN", raising=False)
    cli.main(["launch", "t.py"])
    assert launched[-1] == LaunchConfig.derive(["t.py"], TorchPassConfig(spares=0), AgentConfig(), token="")
    # Every setting that has a flag, away from its default:
    config = TorchPassConfig(spares=2, run_dir="r", max_restarts=1, spare_wait_s=0.0, preload="",
                             health=HealthSettings("off", 1.0, 70.0, 80.0), timeouts=TimeoutConfig(heartbeat_s=9.0),
                             stragglers=StragglerConfig(10, 2.0, "migrate"))
    cli.main(["launch", "--nproc-per-node", "4", "--no-refill", *config.launch_argv(), "t.py", "--x"])
    expected = LaunchConfig.derive(["t.py", "--x"], config, AgentConfig(nproc_per_node=4, refill=False), token="")
    assert launched[-1] == expected


def test_the_worker_is_told_everything_through_one_variable(monkeypatch):
    env = WorkerEnv(store="h:1", token="t", worker_id="n0-s1-i0", world_size=3, node_rank=0, local_slot=1,
                    run_dir="/r", seed=7, heartbeat_interval=0.5, attempt=2, agent_pid=42)
    variables = env.to_env()
    assert list(variables) == [VARIABLE] and WorkerEnv.from_env(variables) == env
    monkeypatch.delenv(VARIABLE, raising=False)
    assert not in_torchpass_worker()
    monkeypatch.setenv(VARIABLE, variables[VARIABLE])
    assert in_torchpass_worker()


def test_one_collective_timeout_per_process_from_the_config_unless_given(monkeypatch):
    """The runtime is one per process: the first caller's timeout used to win silently over a later one."""
    from torchpass_plugins.control import worker

    created: list[timedelta] = []

    class Runtime:
        def __init__(self, env: WorkerEnv, timeout: timedelta) -> None:
            created.append(timeout)

        def join(self) -> None:
            pass

    monkeypatch.setattr(worker, "Runtime", Runtime)
    monkeypatch.setattr(worker, "_RUNTIME", None)
    monkeypatch.setattr(worker, "_TIMEOUT", None)
    env = WorkerEnv(store="h:1", token="t", worker_id="w", world_size=1, node_rank=0, local_slot=0, run_dir="",
                    seed=0, heartbeat_interval=0.5)
    monkeypatch.setenv(VARIABLE, env.to_env()[VARIABLE])
    runtime = worker.current_runtime()
    assert created == [timedelta(seconds=TimeoutConfig.collective_s)]
    assert worker.current_runtime(TimeoutConfig.collective_s) is runtime is worker.current_runtime()
    with pytest.raises(ConfigError, match=r"timeout of 300 s \(the default, torchpass.timeouts.collective_s\), but "
                                          r"a later .* asks for 60 s; .* give each of them the same timeout="):
        worker.current_runtime(60)
    monkeypatch.setattr(worker, "_RUNTIME", None)
    worker.current_runtime(timedelta(seconds=60))
    with pytest.raises(ConfigError, match=r"timeout of 60 s \(the timeout= given first\), .* asks for 300 s"):
        worker.current_runtime(300.0)
    assert created[-1] == timedelta(seconds=60) and len(created) == 2


def test_the_search_path_plugin_serves_the_shipped_groups_to_any_app(tmp_path):
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    assert "TorchPassSearchPathPlugin" in [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]
    cfg = _compose(tmp_path, ["torchpass=fsdp", "+trainer=lightning"])  # tmp_path defines neither group
    assert OmegaConf.get_type(cfg.torchpass) is TorchPassConfig and cfg.torchpass.mode == "fsdp"
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    assert (REPO / "torchpass_plugins" / "configs").resolve() == REPO / "configs"  # installed through this link


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("ddp", TorchPassConfig(mode="ddp")), ("fsdp", TorchPassConfig(mode="fsdp")),
     ("off", TorchPassConfig(enabled=False))],
)
def test_each_yaml_preset_is_the_schema_with_its_one_setting(tmp_path, preset, expected):
    cfg = _compose(tmp_path, [f"torchpass={preset}"])
    assert OmegaConf.get_type(cfg.torchpass) is TorchPassConfig
    assert from_mapping(OmegaConf.to_container(cfg.torchpass)) == expected


def test_enabled_false_on_any_preset_is_the_off_preset(tmp_path):
    config = from_mapping(OmegaConf.to_container(_compose(tmp_path, ["torchpass.enabled=false"]).torchpass))
    assert config == TorchPassConfig(enabled=False) and config.trainer_kwargs() == {}  # plain Lightning


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_the_strategy_and_callback_configs_build_what_trainer_kwargs_builds(tmp_path, monkeypatch, mode):
    """The instantiate-style configs (strategy=torchpass_*, callbacks=torchpass) and ``trainer_kwargs`` pass the
    same classes the same arguments (recorded: building the real strategy needs a torchpass worker)."""
    import hydra.utils

    import torchpass_plugins.integrations.lightning
    import torchpass_plugins.integrations.lightning.callback

    calls: list[tuple[str, dict]] = []
    for module, name in ((torchpass_plugins.integrations.lightning, "TorchPassDDPStrategy"),
                         (torchpass_plugins.integrations.lightning, "TorchPassFSDPStrategy"),
                         (torchpass_plugins.integrations.lightning.callback, "TorchPassCallback")):
        monkeypatch.setattr(module, name, lambda name=name, **kwargs: calls.append((name, kwargs)))
    settings = ["torchpass.timeouts.collective_s=60", "torchpass.replication.every_n_steps=3",
                "torchpass.snapshots.keep=2", "torchpass.snapshots.dir=memory://s",
                "torchpass.snapshots.every_n_steps=5"]
    cfg = _compose(tmp_path, [f"torchpass={mode}", f"+strategy=torchpass_{mode}", "+callbacks=torchpass", *settings])
    from_mapping(OmegaConf.to_container(cfg.torchpass)).trainer_kwargs()
    from_kwargs = sorted(calls, key=str)
    calls.clear()
    hydra.utils.instantiate(cfg.strategy)
    hydra.utils.instantiate(cfg.callbacks.torchpass)
    assert sorted(calls, key=str) == from_kwargs and len(from_kwargs) == 2
