"""``hydra/launcher=torchpass``: a Hydra app with no torchpass code of its own runs each job of a sweep under
its own ``torchpass launch`` (a real multirun, a worker killed in one job, every rank compared with the
failure-free job), and the launcher's decisions (the command line it starts, the settings it refuses)
checked in-process."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from jobs import Job
from omegaconf import open_dict, read_write

from hydra_plugins.torchpass_launcher import launcher
from hydra_plugins.torchpass_launcher.launcher import app_command, config_arguments, job_settings, launch_command
from torchpass_plugins.cli import add_job_flags, add_setting_flags, command
from torchpass_plugins.config import AgentConfig, register_configs
from torchpass_plugins.testing.chaos.oracle import differences

APP = Path(__file__).parent / "scripts" / "hydra_app.py"
STEPS = 12  # the app's trainer.max_steps


def _job_config(tmp_path: Path, overrides: list[str]):
    """The app's config for one job of a sweep in ``tmp_path``, as the launcher composes it."""
    register_configs()
    with initialize_config_dir(config_dir=str(APP.parent / "hydra_app"), version_base="1.3"):
        cfg = compose("app", overrides=[f"hydra.sweep.dir={tmp_path}", *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # as Hydra has it while it composes a sweep
    with read_write(cfg.hydra), open_dict(cfg):
        cfg.hydra.job.num = 0
        cfg.hydra.runtime.output_dir = str(tmp_path / "0")
    return cfg


def test_each_job_starts_active_ranks_plus_spares_with_its_output_directory_as_run_directory(tmp_path):
    cfg = _job_config(tmp_path, ["torchpass.spares=2", "trainer.devices=3"])
    settings, processes = job_settings(cfg)
    assert processes == 5
    config = config_arguments(cfg.hydra)
    assert config == ["--config-name=app", f"--config-path={APP.parent / 'hydra_app'}"]  # the same config
    argv = launch_command(["-m", "mypkg.train"], settings, processes, str(tmp_path / "0"), config,
                          ["trainer.devices=3", "torchpass.spares=2"],
                          ["hydra/launcher=torchpass", "hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path}",
                           "+hydra.job.env_set.X=1", "hydra.verbose=true"])
    launch, app = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert launch[1:5] == ["-m", "torchpass_plugins.cli", "launch", "--nproc-per-node"] and launch[5] == "5"
    assert launch[launch.index("--spares") + 1] == "2"
    assert launch[launch.index("--run-dir") + 1] == str(tmp_path / "0")
    # the job's overrides and the app's Hydra settings reach the workers; the launcher's own do not
    assert app == ["-m", "mypkg.train", *config, "trainer.devices=3", "torchpass.spares=2", "+hydra.job.env_set.X=1",
                   "hydra.verbose=true", "hydra.mode=RUN", f"hydra.run.dir={tmp_path / '0'}",
                   "hydra.output_subdir=null"]
    ns = argparse.ArgumentParser()  # what ``torchpass launch`` makes of it
    add_setting_flags(ns, AgentConfig)
    add_job_flags(ns)
    assert command(ns.parse_args(argv[4:])) == app


def test_a_job_with_torchpass_off_runs_in_process(tmp_path):
    settings, processes = job_settings(_job_config(tmp_path, ["torchpass=off"]))
    assert processes is None and not settings.enabled


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["trainer.devices=auto"], "needs the job's active ranks as an integer, not 'auto': set trainer.devices"),
     (["trainer.num_nodes=2"], "starts the workers of one node, not num_nodes=2"),
     (["torchpass.run_dir=/elsewhere"], "torchpass.run_dir='/elsewhere': under hydra/launcher=torchpass the run "
                                        "directory is the job's output directory"),
     (["torchpass.mode=dpp"], "mode='dpp' is not allowed; use ddp | fsdp")],
)
def test_a_job_that_cannot_start_is_refused_naming_the_setting(tmp_path, overrides, message):
    cfg = _job_config(tmp_path, overrides)
    with pytest.raises(launcher.LaunchRefused, match=re.escape(message)):  # (Hydra's plugin scan re-runs the module)
        job_settings(cfg)


def test_an_app_started_as_a_module_is_started_as_a_module_again():
    as_module = types.SimpleNamespace(__spec__=types.SimpleNamespace(name="mypkg.train"))
    assert app_command(as_module, "/x/mypkg/train.py") == ["-m", "mypkg.train"]
    assert app_command(types.SimpleNamespace(__spec__=None), "train.py") == [str(Path("train.py").resolve())]


def _start(tmp_path: Path, args: list[str], faults: str) -> Job:
    """``python -m hydra_app ARGS`` from the app's directory, as a user runs an app that is not installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    env.update(OMP_NUM_THREADS="1", TORCHPASS_FAULTS=faults)
    log = tmp_path / "hydra.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", APP.stem, *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=APP.parent, env=env, start_new_session=True)
    return Job(tmp_path, agents=[proc], logs=[log])


@pytest.mark.timeout(300)
def test_a_multirun_of_two_jobs_survives_a_kill_in_one_and_matches_the_other_on_every_rank(tmp_path):
    # The jobs differ only in background snapshots, which do not change training: the kill strikes rank 0 in
    # job 1's snapshot thread, and job 0 is its failure-free run. The app is a module, and its jobs change
    # into their output directories (hydra.job.chdir), which its workers are started from too.
    supervisor = _start(tmp_path, ["-m", "torchpass.snapshots.every_n_steps=0,4", "hydra.job.chdir=true",
                                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], "kill@rank=0,step=5,phase=snapshot")
    jobs = [Job(tmp_path / "sweep" / str(n)) for n in (0, 1)]
    try:
        assert supervisor.wait(timeout=250) == [0], supervisor.output()[-4000:]
    finally:
        supervisor.kill()
    assert [job.leftovers() for job in jobs] == [[], []]
    failure_free, killed = jobs
    assert failure_free.events("failure_detected") == []
    assert [(e["rank"], e["code"]) for e in killed.events("failure_detected")] == [(0, -9)]
    assert list(next(e for e in killed.events("roster_published") if e["gen"] == 1)["promoted"].values()) == [0]
    for job in jobs:
        assert job.events("agent_started")[0]["slots"] == 3  # trainer.devices 2 + torchpass.spares 1
        assert job.events("job_finished")[-1]["outcome"] == "done"
        assert (job.run_dir / ".hydra" / "config.yaml").exists()  # Hydra's files and the event log: one place
    for rank in range(2):
        assert killed.applied(rank) == failure_free.applied(rank) == list(range(STEPS))  # each step once
        assert differences(killed.state(rank), failure_free.state(rank)) == [], f"rank {rank}"


@pytest.mark.timeout(200)
def test_a_plain_run_whose_launch_fails_fails_and_never_trains_in_the_supervisor(tmp_path):
    supervisor = _start(tmp_path, [f"hydra.run.dir={tmp_path / 'run'}"], "bogus")  # the workers refuse it
    try:
        assert supervisor.wait(timeout=150) == [1], supervisor.output()[-4000:]
    finally:
        supervisor.kill()
    output = supervisor.output()
    assert "TORCHPASS_FAULTS" in output and "torchpass launch exited with code" in output
    assert "NotUnderTorchPass" not in output and not (tmp_path / "run" / "out" / "state_rank0.pt").exists()
    assert supervisor.leftovers() == []


@pytest.mark.timeout(200)
def test_ctrl_c_during_a_sweep_stops_the_sweep_not_only_its_job(tmp_path):
    supervisor = _start(tmp_path, ["-m", "trainer.max_steps=400,401", f"hydra.sweep.dir={tmp_path / 'sweep'}"], "")
    first = Job(tmp_path / "sweep" / "0", agents=supervisor.agents)  # (its wait ends if the supervisor does)
    try:
        first.wait_until(lambda: len(first.events("worker_ready")) == 2, "job 0 training", timeout=120)
        os.kill(supervisor.agents[0].pid, signal.SIGINT)  # the supervisor alone, as a terminal's Ctrl-C reaches it
        codes = supervisor.wait(timeout=100)
    finally:
        supervisor.kill()
    assert codes != [0]
    assert [e for e in first.events("job_finished") if e["outcome"] == "done"] == []  # its workers were stopped
    time.sleep(1)
    assert not (tmp_path / "sweep" / "1").exists()  # and the next job never started
    assert first.leftovers() == [] and supervisor.leftovers() == []


@pytest.mark.timeout(200)
def test_a_job_that_cannot_go_on_stops_once_although_hydras_main_catches_every_error(tmp_path):
    # One active rank: a kill leaves no peer with its state. The worker raises Unrecoverable, which Hydra's
    # main catches and exits 1 on; the job must still stop with the reason (no restart allowed), not hand
    # the rank to one spare after another.
    supervisor = _start(tmp_path, ["trainer.devices=1", "torchpass.max_restarts=0",
                                   f"hydra.run.dir={tmp_path / 'run'}"], "kill@rank=0,step=3")
    job = Job(tmp_path / "run")
    try:
        assert supervisor.wait(timeout=150) != [0]
    finally:
        supervisor.kill()
    assert len(job.events("failure_detected")) <= 2
    assert "every rank lost its state at once" in job.output() + supervisor.output()
    assert supervisor.leftovers() == [] and job.leftovers() == []
