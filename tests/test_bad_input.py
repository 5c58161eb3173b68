"""Bad input fails before any training, with a message that says what to change."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from jobs import TRAIN, run

from torchpass_plugins.strategies import TorchPassDDPStrategy


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")},
                               **(env or {})})


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--spares", "-1"], "--spares must be >= 0"), (["--spares", "4"], "leaves no active rank")],
)
def test_launch_rejects_impossible_spares(flags, message):
    result = _cli("-m", "torchpass_plugins.cli", "launch", "--nproc-per-node", "4", *flags, str(TRAIN))
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [({}, "no torchpass agent started it"), ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun / accelerate launch")],
)
def test_strategy_refuses_to_run_outside_torchpass_launch(env, message):
    result = _cli(str(TRAIN), "--max-steps", "1", env=env)
    assert result.returncode != 0
    assert message in result.stderr and "torchpass launch" in result.stderr


def test_unknown_strategy_option_is_a_clear_error():
    with pytest.raises(TypeError, match="bogus"):
        TorchPassDDPStrategy(bogus=1)


@pytest.mark.timeout(240)
def test_devices_not_matching_active_ranks_stop_the_job_before_training(tmp_path):
    job, codes = run(tmp_path, nproc=3, spares=1, train_args=("--devices", "3", "--max-steps", "5"))
    assert codes == [1]
    assert "devices x num_nodes equal the active ranks" in job.output()
    assert "configuration error" in job.output()
    assert job.applied(0) == []
    assert len(job.events("worker_started")) == 3  # stopped, not handed to spares over and over
    assert job.leftovers() == []
