"""What the agent tells each worker it starts: one dataclass, passed as one JSON environment variable.

The straggler settings' defaults are the configuration's (``StragglerConfig``); the agent always sets them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from torchpass_plugins.config import StragglerConfig
from torchpass_plugins.control.etcd_gateway import members_of

VARIABLE = "TORCHPASS_WORKER"


@dataclass(frozen=True)
class WorkerEnv:
    store: str  # HOST:PORT of the job's store, or etcd://HOST:PORT,.../NAME
    token: str
    worker_id: str
    world_size: int
    node_rank: int
    local_slot: int
    run_dir: str
    seed: int
    heartbeat_interval: float
    attempt: int = 0  # restarts of the whole job so far
    straggler_window: int = StragglerConfig.window
    straggler_factor: float = StragglerConfig.factor
    agent_pid: int = 0  # the process that started this worker (the agent or its fork server); 0: none to follow
    interfaces: tuple[str, ...] = ()  # the node's network paths, in order (``--interfaces``); empty: gloo's choice
    protect: bool = False  # ``--protect``: a Trainer asking for Lightning's own strategy gets torchpass's
    spares: int = 0  # the job's spares (what a protected job is told it has)
    snapshot_dir: str = ""  # ``--snapshot-dir``: the Trainer snapshots there with no callback in the script
    snapshot_every: int = 0
    borrow: bool = False  # ``--borrow``: a rank lost with no spare free may go to a device borrowed from another job

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerEnv | None:
        """The settings of this worker, or None in a process no torchpass agent started."""
        text = environ.get(VARIABLE)
        if not text:
            return None
        fields = json.loads(text)
        return cls(**{**fields, "interfaces": tuple(fields.get("interfaces", ()))})

    @property
    def store_host_port(self) -> tuple[str, int]:
        """An address of the job's store (an etcd cluster's first member), for what asks for one
        (``MASTER_ADDR``/``MASTER_PORT``, Lightning's ``main_address``)."""
        host, port = members_of(self.store)[0].rsplit(":", 1)
        return host, int(port)

    def to_env(self) -> dict[str, str]:
        return {VARIABLE: json.dumps(asdict(self))}
