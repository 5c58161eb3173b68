"""A plain Accelerate loop (``examples/accelerate/train.py``: AdamW with two parameter groups, gradient
clipping, a scheduler, a shuffled loader through ``prepare`` with augmentation in two workers, gradient
accumulation 2, dropout, an evaluation per epoch through ``gather_for_metrics``, a stateful object of the
script's own) under ``accelerate launch`` with the torchpass supervisor, in fp32 and bf16: a killed worker
is replaced live and every rank ends with the failure-free run's full state, bit for bit."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from jobs import REPO, Job, free_port, run, run_command, service_port
from scripts.weights_follower import digest

from torchpass_plugins.control.worker_env import VARIABLE as WORKER_VARIABLE
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.accelerate.loop import TorchPass, UnprotectedRunWarning
from torchpass_plugins.integrations.accelerate.prepared import check_layout, check_loader
from torchpass_plugins.testing.chaos.oracle import differences
from torchpass_plugins.weights.wire import TOKEN_VARIABLE

pytestmark = pytest.mark.xdist_group("accelerate")  # one worker: the module's failure-free references are made once

EXAMPLE = REPO / "examples" / "accelerate" / "train.py"
CONFIG = REPO / "examples" / "accelerate" / "accelerate_config.yaml"  # 4 processes, bf16
FOLLOWER = REPO / "tests" / "scripts" / "weights_follower.py"
STEPS = 16  # 2 passes over 768 samples, 3 ranks x 16 per batch, 2 micro-batches per step


def _accelerate(run_dir: Path, processes: int, spares: int, faults: str = "", precision: str = "no",
                config: Path | None = None, train_args: tuple[str, ...] = ()) -> Job:
    """``accelerate launch`` with these settings as flags, or (``config``) with those of a config file."""
    settings = (["--config_file", str(config)] if config is not None else
                ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision",
                 precision, "--dynamo_backend", "no"])
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *settings, "--main_process_port", str(free_port()),
           "-m", "torchpass_plugins.run", "--spares", str(spares), "--run-dir", str(run_dir),
           str(EXAMPLE), "--out", str(run_dir / "out"), *train_args]  # fmt: skip
    job, codes = run_command(run_dir, cmd, faults)
    assert codes == [0], job.output()[-4000:]
    assert job.leftovers() == []
    return job


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    """Under ``torchpass launch`` (quicker to start): the launcher does not change the result."""
    job, codes = run(Path(tmp_path_factory.mktemp("accelerate-reference")), nproc=3, spares=0, script=EXAMPLE)
    assert codes == [0], job.output()[-3000:]
    return job


@pytest.fixture(scope="module")
def failure_free_bf16(tmp_path_factory, failure_free):
    job = _accelerate(Path(tmp_path_factory.mktemp("accelerate-reference-bf16")), 3, 0, precision="bf16")
    assert differences(failure_free.state(0), job.state(0))  # autocast did run in bf16
    return job


@pytest.mark.parametrize(("fault", "precision"), [("kill@rank=1,step=9,phase=reduce", "no"),
                                                  ("kill@rank=0,step=3,phase=boundary", "bf16")])
def test_a_killed_worker_of_an_accelerate_loop_is_replaced_bit_exactly(tmp_path, request, fault, precision):
    expected = request.getfixturevalue("failure_free_bf16" if precision == "bf16" else "failure_free")
    job = _accelerate(tmp_path, processes=4, spares=1, faults=fault, precision=precision)
    assert [e["rank"] for e in job.events("failure_detected")] == [int(fault.split("rank=")[1][0])]
    assert len(job.events("state_received")) == 1
    assert job.final()["applied"] == expected.final()["applied"] == STEPS
    assert_same_state(job, expected)
    for rank in range(3):  # every optimizer step applied exactly once on every logical rank
        assert job.applied(rank) == list(range(STEPS)), f"rank {rank} applied {job.applied(rank)}"


def test_the_settings_of_an_accelerate_config_file_reach_the_job_unchanged(tmp_path, failure_free_bf16):
    """``accelerate launch --config_file`` with the example's file (4 processes, bf16): 3 ranks and a spare,
    in bf16 (the bf16 reference differs from the fp32 one), and a killed worker replaced bit-exactly."""
    job = _accelerate(tmp_path, processes=4, spares=1, faults="kill@rank=2,step=5,phase=reduce", config=CONFIG)
    assert len(job.events("worker_started")) >= 4 and len(job.events("state_received")) == 1
    assert_same_state(job, failure_free_bf16)
    for rank in range(3):
        assert job.applied(rank) == list(range(STEPS)), f"rank {rank} applied {job.applied(rank)}"


def test_gradient_accumulation_set_for_accelerate_reaches_the_job_unchanged(tmp_path, monkeypatch):
    """Accelerate's own setting, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4`` (over the script's 2), with the
    config file: a kill between micro-batches, and every rank ends as the failure-free run with the
    script's ``--accumulation 4`` (half as many optimizer steps as with 2)."""
    expected = _accelerate(tmp_path / "failure-free", 3, 0, precision="bf16", train_args=("--accumulation", "4"))
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    job = _accelerate(tmp_path / "killed", processes=4, spares=1, faults="kill@rank=1,step=3,phase=data,micro=2",
                      config=CONFIG)
    assert [e["rank"] for e in job.events("failure_detected")] == [1]
    assert_same_state(job, expected)
    for rank in range(3):
        assert job.applied(rank) == expected.applied(rank) == list(range(STEPS // 2)), f"rank {rank}"


@pytest.mark.timeout(300)
def test_a_loop_that_lost_more_workers_than_spares_resumes_from_the_launchs_snapshot_bit_exactly(tmp_path,
                                                                                                failure_free):
    """No spare: the loss restarts the job, which resumes mid-pass from the newest snapshot every rank
    verifies (the script's own ``Best`` with the rest) and ends with the failure-free run's full state."""
    snapshots = tmp_path / "snapshots"
    job, codes = run(tmp_path, nproc=3, spares=0, script=EXAMPLE, faults="kill@rank=1,step=11,phase=reduce",
                     launch_args=("--snapshot-dir", str(snapshots), "--snapshot-every", "3", "--spare-wait", "0"))
    assert codes == [0], job.output()[-4000:]
    assert len(job.events("job_restarting")) == 1
    resumed = {e["step"] for e in job.events("snapshot_resumed")}
    assert len(resumed) == 1 and resumed <= {6, 9}, resumed  # 6 if rank 1 died before 9 landed
    assert len(job.events("snapshot_resumed")) == 3  # every rank
    [step] = resumed
    assert f"torchpass: resuming from the snapshot of step {step} in {snapshots}" in job.output()
    assert job.final()["applied"] == STEPS
    assert_same_state(job, failure_free)
    assert {e["step"] for e in job.events("snapshot_committed")} >= {3, 6, 12, 15}


def assert_same_state(job: Job, expected: Job) -> None:
    """Every rank's model, optimizer, scheduler, the script's own state and RNG, as in ``expected``."""
    for rank in range(3):
        found = differences(expected.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "differs from the failure-free run:\n" + "\n".join(found[:20])


def test_a_rank_lost_in_an_evaluation_gather_no_one_completed_never_yields_local_data(tmp_path, failure_free):
    """The evaluation after epoch 0's last step: rank 1 dies before its second ``gather_for_metrics``. No
    survivor completed that gather and a spare enters only at a step boundary, so no survivor may go on
    with a result of fewer ranks: the job says so and restarts (from the start: this loop writes no
    snapshots), and ends with the failure-free run's state."""
    job = _accelerate(tmp_path, processes=4, spares=1, faults="kill@rank=1,step=7,phase=collective,micro=1")
    [restart] = job.events("job_restart")
    assert "no other rank had completed" in restart["message"]
    printed = [line for line in job.output().splitlines() if line.startswith("epoch 0:")]
    [expected] = [line for line in failure_free.output().splitlines() if line.startswith("epoch 0:")]
    assert printed and set(printed) == {expected}  # no value of fewer ranks was ever printed
    assert_same_state(job, failure_free)


def test_without_a_supervisor_the_loop_runs_unprotected_after_one_warning(monkeypatch):
    monkeypatch.delenv(WORKER_VARIABLE, raising=False)
    with pytest.warns(UnprotectedRunWarning, match="the loss of any worker will end the job"):
        tp = TorchPass()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing more is said
        tp.track(object(), model=torch.nn.Linear(2, 2))
        assert list(tp.epochs(2)) == [0, 1]
        assert list(tp.batches([1, 2, 3])) == [1, 2, 3]


def test_a_loader_a_spare_could_not_reposition_is_refused_with_the_fix():
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(8.0))
    plain = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=2, shuffle=True))
    with pytest.raises(ConfigError, match="use_seedable_sampler=True"):
        check_loader(plain)
    seeded = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    check_loader(seeded.prepare(DataLoader(data, batch_size=2, shuffle=True)))
    stateful = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                            use_stateful_dataloader=True))
    with pytest.raises(ConfigError, match="drop use_stateful_dataloader=True"):
        check_loader(stateful.prepare(DataLoader(data, batch_size=2, shuffle=True)))


def test_an_accelerator_that_does_not_see_the_jobs_ranks_is_refused():
    from types import SimpleNamespace

    runtime = SimpleNamespace(world_size=3, rank=1)
    with pytest.raises(ConfigError, match=r"sees 1 process\(es\).*Accelerator\(cpu=True\)"):
        check_layout(SimpleNamespace(num_processes=1, process_index=0), runtime)
    check_layout(SimpleNamespace(num_processes=3, process_index=1), runtime)


@pytest.mark.timeout(400)
def test_rank_0_of_a_loop_that_publishes_weights_is_killed_mid_publication_and_the_versions_go_on(
        tmp_path, failure_free, monkeypatch):
    """``TorchPass(publish_weights=...)``: rank 0 dies in the middle of sending a version to a follower; the
    spare that takes the rank over goes on publishing, the follower gets every version whole and in order,
    the last one the trained weights, and the training is the failure-free run's."""
    monkeypatch.setenv(TOKEN_VARIABLE, "a-token")
    endpoint, received = f"tcp://127.0.0.1:{service_port()}", tmp_path / "received.txt"
    follower = subprocess.Popen([sys.executable, str(FOLLOWER), endpoint, str(received), "--final", str(STEPS),
                                 "--patience", "120"], stdout=subprocess.PIPE, text=True)
    assert follower.stdout.readline() == "following\n"  # before the job starts (which may take less time)
    try:
        job, codes = run(tmp_path / "job", nproc=4, spares=1, script=EXAMPLE, faults="kill@rank=0,step=9,phase=publish",
                         train_args=("--publish-weights", endpoint))
        assert codes == [0], job.output()[-3000:]
        follower.wait(timeout=60)
    finally:
        follower.kill()
        follower.wait()
    [failure] = job.events("failure_detected")
    assert failure["rank"] == 0
    published = {e["version"] for e in job.events("weights_published")}
    assert len(set(range(STEPS + 1)) - published) <= 1  # only the version the kill cut off may be missing
    lines = [line.split() for line in received.read_text().splitlines()]
    versions = [int(version) for version, _ in lines]
    assert versions == sorted(set(versions)) and versions[-1] == STEPS, versions
    final = torch.load(job.out / "final.pt", weights_only=True)["weights"]
    assert lines[-1][1] == digest(final)  # the trained weights, bit for bit
    for rank in range(3):
        assert differences(failure_free.state(rank), job.state(rank)) == [], f"rank {rank}"
