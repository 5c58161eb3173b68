"""Everything a user configures, as one dataclass tree (Hydra structured config, group ``torchpass``).

``TorchPassConfig`` holds what the launcher needs (spares, health, stragglers, timeouts, run directory,
telemetry) and what the training script needs (strategy mode, replication, snapshots); ``launch_argv``
and ``trainer_kwargs`` turn it into each. ``validate`` names the key and the allowed values of any bad
setting. ``docs/configuration.md`` is generated from these classes (``python -m torchpass_plugins.config``)
and a test fails when it is stale.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Optional

from torchpass_plugins.errors import ConfigError
from torchpass_plugins.health.watch import is_source


@dataclass
class ReplicationConfig:
    """``torchpass_fsdp``: each rank's shard is copied to its ring successor."""

    every_n_steps: int = 1  # refresh interval of the ring replica; 0 turns replication off


@dataclass
class SnapshotConfig:
    """Background job-wide snapshots, the fallback when live recovery is impossible."""

    dir: Optional[str] = None  # path or fsspec URL (s3://..., memory://...); None: no snapshots
    every_n_steps: int = 0  # 0: never
    keep: int = 3  # newest committed snapshots kept
    when_busy: str = "skip"  # the previous one is still being written: skip | wait
    timeout_s: float = 600.0  # the longest one may take to land; past it, at the end of training, it is abandoned


@dataclass
class HealthSettings:
    """The agent's device health watch."""

    source: str = "nvml"  # nvml | file:PATH (injected readings) | off
    interval_s: float = 5.0
    temperature_warn_c: Optional[float] = 85.0
    temperature_migrate_c: Optional[float] = 92.0  # a worker on a hotter GPU moves to a spare


@dataclass
class StragglerConfig:
    window: int = 50  # steps per verdict; 0: off
    factor: float = 1.5  # flagged above factor x the median compute time per step
    policy: str = "warn"  # warn | migrate


@dataclass
class TimeoutConfig:
    collective_s: float = 300.0  # a process group's own timeout (failures are detected sooner)
    heartbeat_s: float = 30.0  # a silent worker is SIGKILLed after this long


@dataclass
class TelemetryConfig:
    metrics_addr: Optional[str] = None  # HOST:PORT of node 0's Prometheus endpoint


@dataclass
class TorchPassConfig:
    enabled: bool = True  # false: plain Lightning, no torchpass code on the path
    mode: str = "ddp"  # ddp | fsdp
    spares: int = 1  # processes that wait to replace failed ones (job-wide)
    run_dir: str = "torchpass_runs/latest"  # events.jsonl and the report go here
    max_restarts: int = 3  # whole-job restarts (from the newest snapshot) when live recovery is impossible
    process_group_backend: Optional[str] = None  # for CUDA tensors: nccl (null: on GPUs) | gloo (ranks sharing a GPU)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    health: HealthSettings = field(default_factory=HealthSettings)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def validate(self) -> TorchPassConfig:
        """Raise ``ConfigError`` naming the first bad key, its value and what is allowed."""

        def bad(key: str, value: Any, allowed: str) -> None:
            raise ConfigError(f"torchpass config: {key}={value!r} is not allowed; use {allowed}")

        choices = {"mode": ("ddp", "fsdp"), "snapshots.when_busy": ("skip", "wait"),
                   "stragglers.policy": ("warn", "migrate")}
        for key, allowed in choices.items():
            value = _get(self, key)
            if value not in allowed:
                bad(key, value, " | ".join(allowed))
        if self.process_group_backend not in (None, "gloo", "nccl"):
            bad("process_group_backend", self.process_group_backend, "null | gloo | nccl")
        for key in ("spares", "max_restarts", "replication.every_n_steps", "snapshots.every_n_steps",
                    "stragglers.window"):
            if _get(self, key) < 0:
                bad(key, _get(self, key), "an integer >= 0")
        if self.snapshots.keep < 1:
            bad("snapshots.keep", self.snapshots.keep, "an integer >= 1")
        if self.snapshots.every_n_steps and not self.snapshots.dir:
            bad("snapshots.dir", self.snapshots.dir, "a path or fsspec URL when snapshots.every_n_steps > 0")
        if self.stragglers.factor <= 1:
            bad("stragglers.factor", self.stragglers.factor, "a number > 1")
        if not is_source(self.health.source):
            bad("health.source", self.health.source, "nvml | file:PATH | off")
        for key in ("health.interval_s", "timeouts.collective_s", "timeouts.heartbeat_s"):
            if _get(self, key) <= 0:
                bad(key, _get(self, key), "a number > 0")
        return self

    def launch_argv(self) -> list[str]:
        """The ``torchpass launch`` flags this config asks for (before the script)."""
        argv = ["--spares", str(self.spares), "--run-dir", self.run_dir, "--max-restarts", str(self.max_restarts),
                "--heartbeat-timeout", str(self.timeouts.heartbeat_s), "--health-source", self.health.source,
                "--health-interval", str(self.health.interval_s), "--straggler-window", str(self.stragglers.window),
                "--straggler-factor", str(self.stragglers.factor), "--straggler-policy", self.stragglers.policy]
        for flag, value in (("--temperature-warn", self.health.temperature_warn_c),
                            ("--temperature-migrate", self.health.temperature_migrate_c),
                            ("--metrics-addr", self.telemetry.metrics_addr)):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    def trainer_kwargs(self) -> dict[str, Any]:
        """``strategy`` and ``callbacks`` for ``lightning.Trainer`` (empty when disabled)."""
        if not self.enabled:
            return {}
        from torchpass_plugins.integrations.lightning import TorchPassDDPStrategy, TorchPassFSDPStrategy
        from torchpass_plugins.integrations.lightning.callback import TorchPassCallback

        if self.mode == "fsdp":
            strategy = TorchPassFSDPStrategy(timeout=self.timeouts.collective_s,
                                             replicate_every_n_steps=self.replication.every_n_steps,
                                             process_group_backend=self.process_group_backend)
        else:
            strategy = TorchPassDDPStrategy(timeout=self.timeouts.collective_s,
                                            process_group_backend=self.process_group_backend)
        s = self.snapshots
        callback = TorchPassCallback(snapshot_dir=s.dir, snapshot_every_n_steps=s.every_n_steps, snapshot_keep=s.keep,
                                     snapshot_when_busy=s.when_busy, snapshot_timeout=s.timeout_s)
        return {"strategy": strategy, "callbacks": [callback]}


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def from_mapping(values: Any) -> TorchPassConfig:
    """A config from a plain or OmegaConf mapping (e.g. Hydra's ``cfg.torchpass``); unknown keys are errors."""

    def build(cls: type, data: Any, prefix: str) -> Any:
        data = dict(data or {})
        known = {f.name: f for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"torchpass config: unknown key {prefix}{key}; known: {', '.join(known)}")
        kwargs = {}
        for name, value in data.items():
            default = known[name].default_factory() if known[name].default_factory is not MISSING else None
            kwargs[name] = build(type(default), value, f"{prefix}{name}.") if is_dataclass(default) else value
        return cls(**kwargs)

    return build(TorchPassConfig, values, "").validate()


def register_configs() -> None:
    """Register the schema ``torchpass_schema`` in Hydra's ConfigStore. The presets ``torchpass=ddp|fsdp|off``
    are the shipped YAML files (``configs/torchpass/``), which extend it, so an override is typed by
    ``TorchPassConfig`` and a misspelled key is refused by Hydra with its name. The search-path plugin
    (``hydra_plugins/torchpass_searchpath``) calls this before every composition; presets of the same name
    here would shadow nothing and only trip Hydra's deprecated automatic schema matching."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="torchpass_schema", node=TorchPassConfig)


def reference() -> str:
    """The configuration reference, generated from the dataclasses and their comments."""
    import inspect

    lines = ["# Configuration reference", "",
             "Generated from `torchpass_plugins/config.py` by `python -m torchpass_plugins.config > "
             "docs/configuration.md`; a test fails when it is stale. Keys are under `torchpass.` in Hydra.", ""]

    def comments(cls: type) -> dict[str, str]:
        found = {}
        for line in inspect.getsource(cls).splitlines():
            name, _, rest = line.strip().partition(":")
            if "#" in rest and name.isidentifier():
                found[name] = rest.split("#", 1)[1].strip()
        return found

    def section(cls: type, prefix: str) -> None:
        doc = (cls.__doc__ or "").strip()
        title = prefix.rstrip(".") or "torchpass"
        lines.extend([f"## `{title}`", ""] + ([doc, ""] if doc and not doc.startswith(cls.__name__ + "(") else []))
        lines.extend(["| key | default | meaning |", "|---|---|---|"])
        nested = []
        notes = comments(cls)
        for f in fields(cls):
            if f.default_factory is not MISSING:
                nested.append((f.default_factory, f"{prefix}{f.name}."))
                continue
            meaning = notes.get(f.name, "").replace("|", "\\|")  # a pipe would end the table cell
            lines.append(f"| `{prefix}{f.name}` | `{f.default!r}` | {meaning} |")
        lines.append("")
        for factory, sub in nested:
            section(factory, sub)

    section(TorchPassConfig, "")
    lines.extend(_presets())
    return "\n".join(lines)


def _presets() -> list[str]:
    """The shipped presets (``configs/torchpass/*.yaml``), each as the settings it changes."""
    from importlib.resources import files

    import yaml

    lines = ["## Presets", "",
             "`torchpass=NAME` picks one of the YAML files of the config group `torchpass` that ships with the "
             "package (`configs/torchpass/`, found by Hydra through the search-path plugin); each is the schema "
             "above with these settings:", ""]
    for path in sorted(files("torchpass_plugins.configs").joinpath("torchpass").iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            settings = yaml.safe_load(path.read_text())
            changed = ", ".join(f"`{yaml.safe_dump({k: v}).strip()}`" for k, v in settings.items() if k != "defaults")
            lines.append(f"- `torchpass={path.name[:-5]}`: {changed}")
    return [*lines, ""]


if __name__ == "__main__":
    sys.stdout.write(reference())
