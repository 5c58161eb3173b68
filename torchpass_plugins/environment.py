"""``TorchPassEnvironment``: Lightning's view of a worker started by ``torchpass launch``.

Ranks are *logical*: world size counts active ranks only (spares excluded), and a spare that takes over
logical rank ``r`` reports ``r``. The worker joins the job when the environment is created, so a spare
waits right there (its script has built the model already) until it is promoted or released.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from torchpass_plugins.membership import (
    CONFIG_ERROR_EXIT,
    UNRECOVERABLE_EXIT,
    ConfigError,
    JobAborted,
    Unrecoverable,
    WorkerEnv,
    abort_request_key,
)
from torchpass_plugins.runtime import Runtime

log = logging.getLogger(__name__)

_OTHER_LAUNCHERS = {
    "TORCHELASTIC_RUN_ID": "torchrun / accelerate launch",
    "LOCAL_RANK": "another launcher (torchrun, accelerate launch or Lightning's own)",
}
_RUNTIME: Runtime | None = None


class NotUnderTorchPass(RuntimeError):
    """The worker was not started by ``torchpass launch``."""


def current_runtime(timeout: timedelta = timedelta(minutes=5)) -> Runtime:
    """The process's runtime, joined on first use (a spare blocks here until promoted)."""
    global _RUNTIME
    if _RUNTIME is None:
        env = WorkerEnv.from_env()
        if env is None:
            found = next((name for var, name in _OTHER_LAUNCHERS.items() if var in os.environ), None)
            where = f"it was started by {found}" if found else "no torchpass agent started it"
            raise NotUnderTorchPass(
                f"torchpass strategies need workers started by `torchpass launch`, but {where}. "
                "Run: torchpass launch --nproc-per-node N --spares S your_script.py"
            )
        _exit_job_on_config_error()
        runtime = Runtime(env, timeout)
        runtime.join()
        _RUNTIME = runtime
    return _RUNTIME


def _exit_job_on_config_error() -> None:
    """A ``ConfigError`` that reaches the top of a worker exits with ``CONFIG_ERROR_EXIT``, which makes the
    agent stop the whole job with the message instead of handing the same mistake to a spare. An
    ``Unrecoverable`` state hands its message to the coordinator, which stops the job with it. A
    ``JobAborted`` leaves quietly: the agent prints the coordinator's message once for the whole job."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, JobAborted) and _RUNTIME is not None:
            _RUNTIME.before_abort_exit()
        if issubclass(exc_type, Unrecoverable) and _RUNTIME is not None:
            _RUNTIME.member.store.set(abort_request_key(_RUNTIME.env.worker_id), str(exc))
            os._exit(UNRECOVERABLE_EXIT)
        if issubclass(exc_type, JobAborted):
            os._exit(1)
        previous(exc_type, exc, tb)
        if issubclass(exc_type, ConfigError):
            sys.stderr.flush()
            os._exit(CONFIG_ERROR_EXIT)

    sys.excepthook = hook


class TorchPassEnvironment(ClusterEnvironment):
    """Cluster environment whose ranks are the job's stable logical ranks."""

    def __init__(self, timeout: timedelta = timedelta(minutes=5)) -> None:
        self.runtime = current_runtime(timeout)

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self.runtime.env.store.rsplit(":", 1)[0]

    @property
    @override
    def main_port(self) -> int:
        return int(self.runtime.env.store.rsplit(":", 1)[1])

    @staticmethod
    @override
    def detect() -> bool:
        return "TORCHPASS_WORKER_ID" in os.environ

    @override
    def world_size(self) -> int:
        return self.runtime.world_size

    @override
    def set_world_size(self, size: int) -> None:
        if size != self.runtime.world_size:
            raise ConfigError(
                f"torchpass: the Trainer asks for {size} ranks (devices x num_nodes) but the job has "
                f"{self.runtime.world_size} active ranks (processes - spares). Set devices x num_nodes = "
                f"{self.runtime.world_size}, or change --nproc-per-node / --spares."
            )

    @override
    def global_rank(self) -> int:
        return self.runtime.rank

    @override
    def set_global_rank(self, rank: int) -> None:
        if rank != self.runtime.rank:
            raise ConfigError(f"torchpass: logical rank is {self.runtime.rank}, not {rank}")

    @override
    def local_rank(self) -> int:
        return self.runtime.env.local_slot

    @override
    def node_rank(self) -> int:
        return self.runtime.env.node_rank
