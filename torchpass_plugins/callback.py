"""``TorchPassCallback``: optional; attaches the run's event log to this worker's recoveries."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from torchpass_plugins.events import EventLog


class TorchPassCallback(Callback):
    """Writes the worker side of ``RUN_DIR/events.jsonl`` (recoveries, state moved, steps retried).

    The strategy works without it; with it, every phase of a recovery is logged with its duration.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None) -> None:
        self.run_dir = run_dir

    def attach(self, runtime) -> None:
        """Called by the torchpass strategy as it sets up, before any recovery can happen."""
        run_dir = Path(self.run_dir or runtime.env.run_dir)
        runtime.events = EventLog(run_dir / "events.jsonl", source=f"rank{runtime.rank}")
        runtime.events.emit("worker_ready", worker=runtime.env.worker_id, rank=runtime.rank, spare=runtime.is_spare)
