"""The configuration tree: validation names the bad key, Hydra can compose it, the reference is current."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchpass_plugins.config import TorchPassConfig, from_mapping, reference, register_configs
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
