"""The tests run real jobs through the helpers the chaos matrix uses too."""

from pathlib import Path

from torchpass_plugins.testing.chaos.jobs import (
    JOB_TIMEOUT,
    TRAIN,
    Job,
    alive,
    free_port,
    run,
    run_command,
    service_port,
    start,
)

REPO = Path(__file__).resolve().parents[1]

__all__ = ["JOB_TIMEOUT", "REPO", "TRAIN", "Job", "alive", "free_port", "run", "run_command", "service_port", "start"]
