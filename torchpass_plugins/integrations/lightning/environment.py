"""``TorchPassEnvironment``: Lightning's view of a worker started by ``torchpass launch``.

Ranks are *logical*: world size counts active ranks only (spares excluded), and a spare that takes over
logical rank ``r`` reports ``r``. The worker joins the job when the environment is created, so a spare
waits right there (its script has built the model already) until it is promoted or released.
"""

from __future__ import annotations

from datetime import timedelta

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from torchpass_plugins.config import in_torchpass_worker
from torchpass_plugins.control.worker import NotUnderTorchPass, current_runtime
from torchpass_plugins.errors import ConfigError

__all__ = ["NotUnderTorchPass", "TorchPassEnvironment"]

class TorchPassEnvironment(ClusterEnvironment):
    """Cluster environment whose ranks are the job's stable logical ranks."""

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        self.runtime = current_runtime(timeout)

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self.runtime.env.store_host_port[0]

    @property
    @override
    def main_port(self) -> int:
        return self.runtime.env.store_host_port[1]

    @staticmethod
    @override
    def detect() -> bool:
        return in_torchpass_worker()

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
