"""The configuration tree: validation names the bad key, Hydra can compose it, the reference is current."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchpass_plugins.config import TorchPassConfig, from_mapping, reference, register_configs
from torchpass_plugins.environment import NotUnderTorchPass
from torchpass_plugins.membership import ConfigError

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
        ({"snapshot": {"keep": 2}}, "unknown key snapshot; known: enabled, mode, spares"),
        ({"snapshots": {"kep": 2}}, "unknown key snapshots.kep; known: dir, every_n_steps, keep, when_busy"),
    ],
)
def test_a_bad_setting_is_one_clear_error_naming_the_key(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("|", r"\|")):
        from_mapping(values)


def test_hydra_composes_the_schema_and_the_config_turns_into_launch_flags_and_trainer_arguments(tmp_path):
    register_configs()
    from hydra import compose, initialize_config_dir

    (tmp_path / "config.yaml").write_text("defaults:\n  - torchpass: schema\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose("config", overrides=["torchpass.mode=fsdp", "torchpass.spares=2",
                                           "torchpass.snapshots.dir=memory://s", "torchpass.snapshots.every_n_steps=5"])
    config = from_mapping(OmegaConf.to_container(cfg.torchpass))
    assert (config.mode, config.spares, config.snapshots.every_n_steps) == ("fsdp", 2, 5)
    argv = config.launch_argv()
    assert argv[argv.index("--spares") + 1] == "2" and argv[argv.index("--straggler-policy") + 1] == "warn"
    with pytest.raises(NotUnderTorchPass, match="torchpass launch"):  # the strategies live in workers only
        config.trainer_kwargs()
    assert TorchPassConfig(enabled=False).trainer_kwargs() == {}


def test_the_configuration_reference_is_generated_from_the_dataclasses():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == reference(), "stale: run python -m torchpass_plugins.config > docs/configuration.md"
