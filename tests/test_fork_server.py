"""``torchpass fork-server``: the suite's jobs fork their agents' fork servers from one that imported torch
and Lightning once (``tests/conftest.py`` starts it, and every job test runs that way). Here: what an agent
decides, and that a forked fork server serves as the agent's own would (its workers' output in the agent's
log, nothing left behind)."""

from __future__ import annotations

import os

import pytest
from jobs import run

from torchpass_plugins.control import fork_server
from torchpass_plugins.control.zygote import Zygote

pytestmark = pytest.mark.timeout(300)


def _started(job) -> list[dict]:
    return job.events("fork_server_started")


def test_a_job_forks_its_fork_server_from_the_shared_one_and_one_preloading_otherwise_starts_its_own(tmp_path):
    job, codes = run(tmp_path / "shared", nproc=3, spares=1, train_args=("--devices", "2", "--max-steps", "3"),
                     faults="kill@rank=1,step=1,phase=backward")
    assert codes == [0], job.output()[-3000:]
    [started] = _started(job)
    assert started["shared"] and started["pid"] != job.agents[0].pid
    assert job.output().count("Seed set to") >= 3  # the workers' output reached the agent's log (a spare's too)
    assert len(job.events("recovered")) >= 2 and job.leftovers() == []

    job, codes = run(tmp_path / "own", nproc=2, spares=0, train_args=("--devices", "2", "--max-steps", "3"),
                     launch_args=("--preload", "torch"))  # not what the shared one imported
    assert codes == [0], job.output()[-3000:]
    assert [e["shared"] for e in _started(job)] == [False]
    assert job.leftovers() == []


def test_an_agent_whose_import_time_environment_differs_starts_its_own(monkeypatch):
    """OpenMP sizes its pool from OMP_NUM_THREADS as torch is imported: a fork server that imported it
    otherwise would give the workers another pool, and other rounding."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # (the suite's, and its fork server's, is 1)
    zygote = Zygote(["torch", "lightning.pytorch"])
    try:
        assert not zygote.shared
    finally:
        zygote.close()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    zygote = Zygote(["torch", "lightning.pytorch"])
    try:
        assert zygote.shared and os.environ[fork_server.VARIABLE]
    finally:
        zygote.close()
        assert zygote.proc.wait(timeout=10) == -1  # ended with the agent's connection
