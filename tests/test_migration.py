"""Planned migration: a worker moves to a spare at a step boundary, before anything fails, bit-exact."""

from __future__ import annotations

import json

import pytest
from conftest import STEPS, assert_bit_exact
from jobs import start

TRAIN = ("--devices", "3", "--max-steps", str(STEPS))
FSDP = ("--strategy", "torchpass_fsdp")


def _assert_moved_without_failure(job, rank: int) -> None:
    assert job.events("failure_detected") == []
    [drained] = job.events("drained")
    assert drained["rank"] == rank  # the moving worker left at a step boundary
    [moved] = [e for e in job.events("roster_published") if e["reason"].startswith(f"migrate rank {rank}")]
    assert moved["promoted"] == {"n0-s3-i0": rank}
    assert {e["cause"] for e in job.events("transport_rebuilt") + job.events("recovered") if "cause" in e} <= {
        f"planned migration of rank {rank}", "spare promoted"}


def test_a_hot_gpu_moves_its_worker_to_a_spare_before_any_failure(tmp_path, reference):
    health = tmp_path / "health.json"
    # Rank 0 reaches each boundary from step 4 on half a second late, so the moving worker has left, and
    # the migration's roster is out, before rank 0 reaches the boundary of the move (rank 2 is on time):
    # both still recover as the planned migration.
    job = start(tmp_path, train_args=(*TRAIN, "--sleep-per-step", "0.1"),
                launch_args=("--health-source", f"file:{health}", "--health-interval", "0.2"),
                faults="slow@rank=0,step=4,seconds=0.5")
    try:
        job.wait_until(lambda: len(job.applied(1)) >= 4, "rank 1 to reach step 4")
        health.write_text(json.dumps({"1": {"temperature_c": 95}}))  # "GPU 1 is at 95 C": slot 1, rank 1
        codes = job.wait()
    finally:
        job.kill()
    assert_bit_exact(job, codes, reference())
    [watch] = job.events("health_migrate")
    assert watch["device"] == 1 and "GPU 1 at 95 C" in watch["why"]
    assert job.events("migration_requested")[0]["rank"] == 1
    _assert_moved_without_failure(job, rank=1)
    assert len(job.events("state_received")) == 1  # the spare got the state once, at the boundary
    [late] = [e["position"] for e in job.events("transport_rebuilt") if e["rank"] == 0]
    assert late[1] == 0  # rank 0 met the new roster at the move's boundary, before its first collective


@pytest.mark.parametrize("replication", [(), ("--replicate-every", "0")], ids=["replicated", "replication-off"])
def test_a_straggler_is_flagged_and_moved_to_a_spare(tmp_path, reference, replication):
    # with replication off, a rank's own state goes to its ring successor only at the planned move
    job = start(tmp_path, train_args=(*TRAIN, *FSDP, *replication),
                launch_args=("--straggler-window", "4", "--straggler-policy", "migrate"),
                faults="slow@rank=2,step=1,seconds=0.4")
    try:
        codes = job.wait()
    finally:
        job.kill()
    assert_bit_exact(job, codes, reference(3, FSDP))
    flagged = job.events("straggler")
    assert flagged and flagged[0]["ranks"] == [2] and flagged[0]["step"] in (4, 8)
    assert "straggler: rank 2" in job.events("migration_requested")[0]["why"]
    _assert_moved_without_failure(job, rank=2)
    assert {e["steps_rolled_back"] for e in job.events("recovered")} == {0}
