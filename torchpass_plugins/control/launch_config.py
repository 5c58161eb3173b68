"""What one node's agent runs by, derived from the settings (``TorchPassConfig``, ``AgentConfig``): it has no
defaults of its own, so a default is written once, in ``torchpass_plugins/config.py``."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from torchpass_plugins.config import AgentConfig, TorchPassConfig
from torchpass_plugins.control.etcd_gateway import PASSWORD_VARIABLE, Credentials, address
from torchpass_plugins.control.links import all_interfaces, interface_address
from torchpass_plugins.health.watch import HealthConfig, HealthThresholds


@dataclass
class LaunchConfig:
    """The job's supervision settings, this node's place in it, and how this agent joined it."""

    command: list[str]
    nproc_per_node: int
    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    rdzv_backend: str  # c10d: node 0's agent serves a TCPStore; etcd: an etcd cluster at rdzv_endpoint
    rdzv_id: str
    rdzv_timeout: float  # how long an agent tries to reach node 0's store
    etcd: Credentials  # TLS files and user for an etcd store
    spares: int
    run_dir: str
    heartbeat_timeout: float
    heartbeat_interval: float
    refill: bool
    token: str
    seed: int | None
    max_restarts: int
    spare_wait: float  # seconds to wait for a refilled spare when more ranks are lost than spares free
    health: HealthConfig
    straggler_window: int
    straggler_factor: float
    straggler_migrate: bool
    metrics_addr: str | None  # HOST:PORT of node 0's Prometheus endpoint
    preload: tuple[str, ...]  # imported once per node by a fork server, which forks every worker (empty: none)
    first_slot: int  # index of this agent's first slot (its workers' local rank / GPU)
    external_store: bool  # the store at rdzv_endpoint is someone else's (torchrun's): only connect
    interfaces: tuple[str, ...]  # the node's network paths, in order (empty: one, gloo's choice)
    link_grace: float  # seconds a path may be down before the job leaves it
    protect: bool  # a script written without torchpass gets torchpass's strategy (``--protect``)
    snapshot_dir: str  # every worker's Trainer snapshots there ('': only where the script asks)
    snapshot_every: int
    lend: bool  # other jobs of its nodes launched with --borrow may take its devices
    borrow: bool  # it may take a lender's device when it has no spare free
    lend_registry: str
    yield_timeout: float  # how long a lender has to yield a device

    @classmethod
    def derive(cls, command: list[str], job: TorchPassConfig, agent: AgentConfig, *, token: str,
               first_slot: int = 0, external_store: bool = False) -> LaunchConfig:
        """``token``: the job's join token ('' on a single node: the agent draws one). The job's settings are
        checked here, once (:meth:`TorchPassConfig.validate`); :meth:`validate` checks the layout."""
        job.validate()
        thresholds = HealthThresholds(temperature_warn_c=job.health.temperature_warn_c,
                                      temperature_migrate_c=job.health.temperature_migrate_c)
        return cls(
            command=list(command), nproc_per_node=agent.nproc_per_node, nnodes=agent.nnodes,
            node_rank=agent.node_rank, rdzv_endpoint=agent.rdzv_endpoint, rdzv_backend=agent.rdzv_backend,
            rdzv_id=agent.rdzv_id, rdzv_timeout=agent.rdzv_timeout_s,
            etcd=Credentials(*(str(Path(f).resolve()) if f else "" for f in (agent.etcd_cacert, agent.etcd_cert,
                                                                              agent.etcd_key)), agent.etcd_user),
            spares=job.spares, run_dir=job.run_dir, heartbeat_timeout=job.timeouts.heartbeat_s,
            heartbeat_interval=agent.heartbeat_interval_s, refill=agent.refill, token=token, seed=agent.seed,
            max_restarts=job.max_restarts, spare_wait=job.spare_wait_s,
            health=HealthConfig(source=job.health.source, interval_s=job.health.interval_s, thresholds=thresholds),
            straggler_window=job.stragglers.window, straggler_factor=job.stragglers.factor,
            straggler_migrate=job.stragglers.policy == "migrate", metrics_addr=job.telemetry.metrics_addr,
            preload=tuple(m for m in job.preload.split(",") if m.strip()), first_slot=first_slot,
            external_store=external_store,
            interfaces=(all_interfaces() if agent.interfaces.strip() == "all" else
                        tuple(i.strip() for i in agent.interfaces.split(",") if i.strip())),
            link_grace=agent.link_grace_s, protect=agent.protect, snapshot_dir=job.snapshots.dir or "",
            snapshot_every=job.snapshots.every_n_steps, lend=agent.lend, borrow=agent.borrow,
            lend_registry=agent.lend_registry, yield_timeout=agent.yield_timeout_s,
        )

    @property
    def store_address(self) -> str | None:
        """Where every process of the job finds an etcd store (``etcd://HOST:PORT,.../ID``); ``None`` for
        node 0's TCPStore, whose port is known once it listens."""
        return address(self.rdzv_endpoint, self.rdzv_id, self.etcd) if self.rdzv_backend == "etcd" else None

    @property
    def processes(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def world_size(self) -> int:
        return self.processes - self.spares

    def _validate_credentials(self) -> None:
        files = {"--etcd-cacert": self.etcd.cacert, "--etcd-cert": self.etcd.cert, "--etcd-key": self.etcd.key}
        for flag, path in files.items():
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if bool(self.etcd.cert) != bool(self.etcd.key):
            raise ValueError("--etcd-cert and --etcd-key go together: a client certificate and its private key")
        if self.etcd.user and not os.environ.get(PASSWORD_VARIABLE):
            raise ValueError(f"--etcd-user {self.etcd.user} needs its password in {PASSWORD_VARIABLE}")

    def validate(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError("--nproc-per-node and --nnodes must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.spares >= self.processes:
            raise ValueError(
                f"--spares {self.spares} leaves no active rank among {self.processes} processes "
                f"({self.nnodes} node(s) x {self.nproc_per_node}); use fewer spares or more processes"
            )
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("--heartbeat-timeout must exceed the heartbeat interval")
        if self.nnodes > 1 and not self.token:
            raise ValueError("multi-node jobs need the same join token on every node: set TORCHPASS_JOIN_TOKEN")
        if self.rdzv_backend == "etcd":
            members = self.rdzv_endpoint.split(",")
            if not all(m.rpartition(":")[2].isdigit() and not m.endswith(":0") and "/" not in m for m in members):
                raise ValueError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]: the etcd "
                                 f"members' client addresses, without a scheme, not {self.rdzv_endpoint!r}")
            if not self.rdzv_id or "/" in self.rdzv_id:
                raise ValueError("--rdzv-backend etcd needs --rdzv-id NAME (no '/'): a name no earlier run used "
                                 "in this etcd cluster, whose keys would otherwise be read as this run's")
            self._validate_credentials()
        elif self.etcd != Credentials():
            raise ValueError("--etcd-cacert, --etcd-cert, --etcd-key and --etcd-user apply to --rdzv-backend etcd only")
        elif self.nnodes > 1 and self.rdzv_endpoint.endswith(":0"):
            raise ValueError("multi-node jobs need a fixed --rdzv-endpoint HOST:PORT reachable from every node")
        if not self.command:
            raise ValueError("no training script given")
        if self.lend and self.borrow:
            raise ValueError("--lend and --borrow: a job either lends its devices (low priority) or borrows them")
        if self.yield_timeout <= 0:
            raise ValueError(f"--yield-timeout must be > 0, not {self.yield_timeout:g}")
        if len(set(self.interfaces)) < len(self.interfaces):
            raise ValueError(f"--interfaces names an interface twice: {','.join(self.interfaces)}")
        for name in self.interfaces:
            interface_address(name)  # ValueError naming it, before any worker starts
        if self.metrics_addr is not None:
            if importlib.util.find_spec("prometheus_client") is None:
                raise ValueError("--metrics-addr needs prometheus-client: pip install 'torchpass-plugins[metrics]'")
            if not self.metrics_addr.rpartition(":")[2].isdigit():
                raise ValueError(f"--metrics-addr must be HOST:PORT, not {self.metrics_addr!r}")
