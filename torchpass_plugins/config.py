"""Everything a user configures, as one dataclass tree (Hydra structured config, group ``torchpass``): the one
place where every default is written.

``TorchPassConfig`` holds what the launcher needs (spares, health, stragglers, timeouts, run directory,
telemetry) and what the training script needs (strategy mode, replication, snapshots); ``AgentConfig`` holds
what only ``torchpass launch`` is told (this node's place in the job). Each field carries its help text, and a
launcher setting its flag: the flags of ``torchpass launch`` and ``python -m torchpass_plugins.run`` are made
from them, as are ``launch_argv``, the agent's ``LaunchConfig`` and the worker's environment. ``trainer_kwargs``
and the shipped strategy and callback YAML are made from one table (``STRATEGIES``, ``CALLBACK``).
``validate`` names the key and the allowed values of any bad setting. ``docs/configuration.md`` and that YAML
are generated (``python -m torchpass_plugins.config``, ``torchpass_plugins/config_files.py``); a test fails
when either is stale.
"""

from __future__ import annotations

import importlib
import sys
import typing
from collections.abc import Iterator
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, Optional

from torchpass_plugins.errors import ConfigError
from torchpass_plugins.health.watch import HealthThresholds, is_source


def setting(default: Any, doc: str, flag: str | None = None, choices: tuple | None = None,
            launch_default: Any = MISSING) -> Any:
    """A field with its help text; ``flag``: the launcher flag that sets it; ``choices``: its allowed values;
    ``launch_default``: what ``torchpass launch`` assumes when the flag is left out, where that differs from the
    config's default (a bare launch is torchrun-like: no spares unless asked for)."""
    metadata = {"doc": doc, "flag": flag, "choices": choices}
    if launch_default is not MISSING:
        metadata["launch_default"] = launch_default
    return field(default=default, metadata=metadata)


@dataclass
class ReplicationConfig:
    """``torchpass_fsdp``: each rank's shard is copied to its ring successor."""

    every_n_steps: int = setting(1, "refresh interval of the ring replica; 0 turns replication off")


@dataclass
class SnapshotConfig:
    """Background job-wide snapshots, the fallback when live recovery is impossible."""

    dir: Optional[str] = setting(None, "path or fsspec URL (s3://..., memory://...); None: no snapshots. Given to "
                                       "torchpass launch, every worker's Trainer gets them, with no callback in its "
                                       "code", "--snapshot-dir")
    every_n_steps: int = setting(0, "a snapshot every N optimizer steps; 0: never", "--snapshot-every")
    keep: int = setting(3, "newest committed snapshots kept")
    when_busy: str = setting("skip", "the previous one is still being written", choices=("skip", "wait"))
    timeout_s: float = setting(600.0, "the longest one may take to land; past it, at the end of training, it is "
                                      "abandoned")


@dataclass
class WeightsConfig:
    """Versions of the weights for processes outside the job (rollout replicas, evaluators), served by
    logical rank 0; subscribers prove the token in ``TORCHPASS_WEIGHTS_TOKEN``."""

    publish: Optional[str] = setting(None, "tcp://HOST:PORT to serve them at; None: not published")
    every_n_steps: int = setting(1, "a version every N optimizer steps (and the last one)")
    dtype: Optional[str] = setting(None, "cast floating tensors as they are published (null: as trained)",
                                   choices=(None, "bfloat16", "float16"))
    storage: Optional[str] = setting(None, "a path or fsspec URL where the newest version is also written, for "
                                     "subscribers that cannot reach the endpoint (null: none)")


@dataclass
class HealthSettings:
    """The agent's device health watch."""

    source: str = setting("nvml", "GPU health readings: nvml, file:PATH (JSON {device: {field: value}}, for "
                                  "drills), or off", "--health-source")
    interval_s: float = setting(5.0, "seconds between health readings", "--health-interval")
    temperature_warn_c: Optional[float] = setting(
        HealthThresholds.temperature_warn_c, "deg C from which a worker's GPU is logged as hot", "--temperature-warn")
    temperature_migrate_c: Optional[float] = setting(
        HealthThresholds.temperature_migrate_c, "deg C from which a worker is moved off its GPU to a spare",
        "--temperature-migrate")


@dataclass
class StragglerConfig:
    window: int = setting(50, "steps per straggler verdict (0: off)", "--straggler-window")
    factor: float = setting(1.5, "a rank whose compute time per step exceeds the median by this factor is a "
                                 "straggler", "--straggler-factor")
    policy: str = setting("warn", "log a straggler, or also move it to a spare", "--straggler-policy",
                          choices=("warn", "migrate"))


@dataclass
class TimeoutConfig:
    collective_s: float = setting(300.0, "a process group's own timeout (failures are detected sooner); the "
                                         "default of every strategy's, TorchPassEnvironment's and TorchPass's "
                                         "timeout=")
    heartbeat_s: float = setting(30.0, "seconds without a beat before a worker (or a node's agent) is written "
                                       "off; a worker is SIGKILLed", "--heartbeat-timeout")


@dataclass
class TelemetryConfig:
    metrics_addr: Optional[str] = setting(None, "HOST:PORT for node 0's Prometheus endpoint (needs the 'metrics' "
                                                "extra); off by default", "--metrics-addr")


@dataclass
class TorchPassConfig:
    enabled: bool = setting(True, "false: plain Lightning, no torchpass code on the path")
    mode: str = setting("ddp", "the strategy", choices=("ddp", "fsdp"))
    spares: int = setting(1, "workers that wait to replace failed ones (job-wide)", "--spares", launch_default=0)
    run_dir: str = setting("torchpass_runs/latest", "where events.jsonl and the report go (under "
                                                    "hydra/launcher=torchpass: the job's output directory)",
                           "--run-dir")
    max_restarts: int = setting(3, "restarts of the whole job when a failure no spare can fix happens (it resumes "
                                   "from its newest snapshot); 0: stop instead", "--max-restarts")
    spare_wait_s: float = setting(20.0, "when more workers are lost than spares are free, seconds to wait for "
                                        "refilled workers to join the pool before restarting (0: restart at once)",
                                  "--spare-wait")
    preload: str = setting("torch,lightning.pytorch", "modules a per-node fork server imports once; every worker "
                                                      "is forked from it and starts in milliseconds ('': start "
                                                      "each worker as a fresh interpreter)", "--preload")
    process_group_backend: Optional[str] = setting(None, "for CUDA tensors (null: nccl on GPUs; gloo lets ranks "
                                                         "share a GPU)", choices=(None, "gloo", "nccl"))
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    health: HealthSettings = field(default_factory=HealthSettings)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def validate(self) -> TorchPassConfig:
        """Raise ``ConfigError`` naming the first bad key, its value and what is allowed."""

        flags = {key: f.metadata["flag"] for key, f, _ in settings(TorchPassConfig)}

        def bad(key: str, value: Any, allowed: str) -> None:
            flag = f" (flag {flags[key]})" if flags.get(key) else ""
            raise ConfigError(f"torchpass config: {key}={value!r} is not allowed; use {allowed}{flag}")

        for key, f, _ in settings(TorchPassConfig):
            allowed = f.metadata["choices"]
            if allowed is not None and _get(self, key) not in allowed:
                bad(key, _get(self, key), " | ".join("null" if c is None else c for c in allowed))
        for key in ("spares", "max_restarts", "replication.every_n_steps", "snapshots.every_n_steps",
                    "stragglers.window", "spare_wait_s"):
            if _get(self, key) < 0:
                bad(key, _get(self, key), "an integer >= 0" if isinstance(_get(self, key), int) else "a number >= 0")
        if self.snapshots.keep < 1:
            bad("snapshots.keep", self.snapshots.keep, "an integer >= 1")
        if self.weights.every_n_steps < 1:
            bad("weights.every_n_steps", self.weights.every_n_steps, "an integer >= 1")
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
        argv = []
        for key, f, _ in settings(TorchPassConfig):
            if f.metadata["flag"] and _get(self, key) is not None:
                argv += [f.metadata["flag"], str(_get(self, key))]
        return argv

    def trainer_kwargs(self) -> dict[str, Any]:
        """``strategy`` and ``callbacks`` for ``lightning.Trainer`` (empty when disabled): the objects that the
        shipped ``strategy=torchpass_*`` and ``callbacks=torchpass`` YAML instantiate, from the same table."""
        if not self.enabled:
            return {}
        return {"strategy": self._build(*STRATEGIES[self.mode]), "callbacks": [self._build(*CALLBACK)]}

    def _build(self, target: str, arguments: dict[str, str]) -> Any:
        module, _, name = target.rpartition(".")
        return getattr(importlib.import_module(module), name)(**{a: _get(self, k) for a, k in arguments.items()})


@dataclass
class AgentConfig:
    """This node's place in the job and its agent's pace: flags only, not Hydra keys. Under torchrun,
    ``python -m torchpass_plugins.run`` takes the layout from torchrun and the rest from these defaults."""

    nproc_per_node: int = setting(1, "worker processes on this node, spares included", "--nproc-per-node")
    nnodes: int = setting(1, "nodes of the job", "--nnodes")
    node_rank: int = setting(0, "this node's index among them", "--node-rank")
    rdzv_endpoint: str = setting("127.0.0.1:0", "HOST:PORT of node 0's store, which listens on HOST's interface "
                                                "only (port 0: any free); with --rdzv-backend etcd, the etcd "
                                                "members' client addresses, HOST:PORT,HOST:PORT,...", "--rdzv-endpoint")
    rdzv_backend: str = setting("c10d", "the job's store: c10d (a TCPStore served by node 0's agent) or etcd (an "
                                        "etcd v3 cluster, which outlives any one node)", "--rdzv-backend",
                                choices=("c10d", "etcd"))
    rdzv_id: str = setting("", "with --rdzv-backend etcd: the job's name in the cluster, its keys' prefix; a "
                               "name no earlier run used (a resubmitted job too)", "--rdzv-id")
    etcd_cacert: str = setting("", "with --rdzv-backend etcd: the CA certificate file that signed the members' "
                                   "certificates (the members are then reached over https)", "--etcd-cacert")
    etcd_cert: str = setting("", "with --rdzv-backend etcd: this node's client certificate file, for members that "
                                 "ask for one (with --etcd-key)", "--etcd-cert")
    etcd_key: str = setting("", "with --rdzv-backend etcd: the client certificate's private key file", "--etcd-key")
    etcd_user: str = setting("", "with --rdzv-backend etcd: the etcd user (auth enabled); its password is read from "
                                 "TORCHPASS_ETCD_PASSWORD", "--etcd-user")
    rdzv_timeout_s: float = setting(300.0, "seconds an agent tries to reach node 0's store", "--rdzv-timeout")
    heartbeat_interval_s: float = setting(0.5, "seconds between a worker's heartbeats and its agent's checks",
                                          "--heartbeat-interval")
    refill: bool = setting(True, "restart failed slots as spares (--no-refill: do not)", "--no-refill")
    interfaces: str = setting("", "this node's network interfaces the job's collectives may take, in order of "
                                  "preference, comma-separated, each on a subnet of its own (eth1,eth0); the same "
                                  "count on every node. A link that fails on one is left for the next, no worker "
                                  "replaced. 'all': every interface up with an IPv4 address, loopback aside, by "
                                  "name. Empty: one path, gloo's choice", "--interfaces")
    link_grace_s: float = setting(5.0, "with --interfaces: seconds a path may be down (a flap) before the job leaves "
                                       "it for the next", "--link-grace")
    seed: Optional[int] = setting(None, "job seed for per-step RNG (default: from PL_GLOBAL_SEED)", "--seed")
    lend: bool = setting(False, "this job is of low priority: jobs launched with --borrow on its nodes may take "
                                "its devices when they lose a worker and no spare of theirs joins in time (it gets "
                                "each back once the borrower can do without it)", "--lend")
    borrow: bool = setting(False, "when this job loses a worker and has no spare free, borrow a device of a job "
                                  "launched with --lend on that node", "--borrow")
    lend_registry: str = setting("/tmp/torchpass-lenders", "the directory where lending jobs list themselves (in "
                                                           "a subdirectory per user), the same for every job of a "
                                                           "node", "--lend-registry")
    yield_timeout_s: float = setting(30.0, "with --borrow: seconds a lender has to yield a device; past them the "
                                           "job falls back as with no spare (restart from its snapshot)",
                                     "--yield-timeout")
    protect: bool = setting(False, "protect a script written without torchpass: a Lightning Trainer that asks for "
                                   "strategy 'ddp', 'fsdp' or 'auto' runs on torchpass_ddp / torchpass_fsdp with "
                                   "this launch's spares; what cannot be protected is refused before training",
                            "--protect")


# The strategy (per mode) and the callback that ``trainer_kwargs`` builds and the shipped YAML instantiates:
# each class and, for each of its arguments, the setting it takes.
STRATEGIES = {
    "ddp": ("torchpass_plugins.TorchPassDDPStrategy",
            {"timeout": "timeouts.collective_s", "process_group_backend": "process_group_backend"}),
    "fsdp": ("torchpass_plugins.TorchPassFSDPStrategy",
             {"timeout": "timeouts.collective_s", "replicate_every_n_steps": "replication.every_n_steps",
              "process_group_backend": "process_group_backend"}),
}
CALLBACK = ("torchpass_plugins.TorchPassCallback",
            {"snapshot_dir": "snapshots.dir", "snapshot_every_n_steps": "snapshots.every_n_steps",
             "snapshot_keep": "snapshots.keep", "snapshot_when_busy": "snapshots.when_busy",
             "snapshot_timeout": "snapshots.timeout_s", "publish_weights": "weights.publish",
             "publish_every_n_steps": "weights.every_n_steps", "publish_dtype": "weights.dtype",
             "publish_storage": "weights.storage"})


def settings(cls: type, prefix: str = "") -> Iterator[tuple[str, Field, type]]:
    """Every leaf setting of a config class: its dotted key, its field and its value type (``Optional[X]``: X)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.default_factory is not MISSING:
            yield from settings(hints[f.name], f"{prefix}{f.name}.")
            continue
        kind = hints[f.name]
        yield f"{prefix}{f.name}", f, next((a for a in typing.get_args(kind) if a is not type(None)), kind)


def in_torchpass_worker() -> bool:
    """Whether this process is a worker that ``torchpass launch`` (or its torchrun supervisor) started: the Hydra
    launcher's run callback hands a run to ``torchpass launch`` only when it is not, and an Accelerate loop is
    protected only when it is."""
    from torchpass_plugins.control.worker_env import WorkerEnv

    return WorkerEnv.from_env() is not None


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


if __name__ == "__main__":
    from torchpass_plugins.config_files import main

    sys.exit(main(sys.argv[1:]))
