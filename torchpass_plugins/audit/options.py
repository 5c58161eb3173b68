"""``torchpass audit``'s settings: where the nodes meet (the launcher's flags) and what is measured."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from torchpass_plugins.config import setting


@dataclass
class AuditOptions:
    """``torchpass audit``'s flags: the launcher's for where the nodes meet, and what to measure."""

    nnodes: int = setting(1, "nodes audited together", "--nnodes")
    node_rank: int = setting(0, "this node's index, 0 to nnodes-1 (node 0 holds the store and writes the report)",
                             "--node-rank")
    nproc_per_node: int = setting(0, "workers on this node, one per device; 0: every GPU, or 2 without one",
                                  "--nproc-per-node")
    rdzv_endpoint: str = setting("127.0.0.1:0", "HOST:PORT of node 0's store (a fixed port for several nodes)",
                                 "--rdzv-endpoint")
    duration: float = setting(30.0, "seconds of compute burn-in on every device at once", "--duration")
    out: str = setting("torchpass_runs/audit", "where audit.json and the PNGs go (node 0)", "--out")
    baseline: Optional[str] = setting(None, "an earlier good run's audit.json: a part far worse than in it fails",
                                      "--baseline")
    health_source: str = setting("nvml", "device health readings: nvml, file:PATH or off", "--health-source")
    message_mb: int = setting(64, "MB sent each way per link, and all-reduced", "--message-mb")
    memory_mb: int = setting(512, "MB copied for the host memory bandwidth", "--memory-mb")
    matmul_size: int = setting(0, "matmul size of the burn-in; 0: 4096 on a GPU, 256 on CPU", "--matmul-size")
    tolerance: float = setting(1.0, "loosen every limit by this factor (ratios divided, margins multiplied): 2 on a "
                                    "shared or busy machine", "--tolerance")
    drill: bool = setting(True, "run the live drill on node 0 (--no-drill: do not)", "--no-drill")
    exclude_bad: bool = setting(False, "print the hostnames of the nodes no finding blames, comma-separated",
                                "--exclude-bad")

    def validate(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.rdzv_endpoint.endswith(":0"):
            raise ValueError("several nodes need a fixed --rdzv-endpoint HOST:PORT that every node reaches")
        if self.duration <= 0 or self.message_mb <= 0 or self.memory_mb <= 0 or self.tolerance < 1:
            raise ValueError("--duration, --message-mb and --memory-mb must be positive, --tolerance at least 1")
        if self.baseline is not None and not Path(self.baseline).is_file():
            raise ValueError(f"--baseline {self.baseline}: no such file (an earlier run's audit.json)")

    def workers(self) -> int:
        import torch  # (here: the command line's parser stays light)

        return self.nproc_per_node or torch.cuda.device_count() or 2
