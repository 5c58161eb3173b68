"""The guarantee, end to end: real workers under ``torchpass launch``, real SIGKILL/SIGSTOP, gloo groups.

Each scenario must end with the same weights, bit for bit, as the failure-free run, with every
optimizer step applied exactly once on every logical rank, and no process left behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import STEPS, assert_bit_exact
from jobs import run, start
from PIL import Image

TRAIN = ("--devices", "3", "--max-steps", str(STEPS))
pytestmark = pytest.mark.timeout(300)


def recovered_ranks(job) -> set[int]:
    return {e["rank"] for e in job.events("recovered")}


def test_sigkill_of_a_nonzero_rank_from_outside(tmp_path, reference):
    wide = ("--hidden", "256")  # a hidden weight of 256 KiB: large enough to travel in place, and to land
    job = start(tmp_path, train_args=(*TRAIN, *wide, "--sleep-per-step", "0.8"))  # room for the spare's look
    try:
        job.wait_until(lambda: job.events("landing_prepared"), "the spare to prepare its landing")
        os.kill(job.pid_of_rank(1), signal.SIGKILL)
        job.full_speed()
        codes = job.wait()
    finally:
        job.kill()
    assert_bit_exact(job, codes, reference(3, wide), killed_from_outside=(1,))
    assert [e["promoted"] for e in job.events("roster_published")][1] == {"n0-s3-i0": 1}
    [received] = job.events("state_received")
    assert recovered_ranks(job) == {0, 1, 2}
    # While it waited, the spare allocated the state's large tensors announced by rank 0, and received into them.
    landing = next(e for e in job.events("landing_prepared") if e["source"] == "n0-s3-i0")
    assert 0 < landing["bytes"] <= received["bytes"] and landing["time"] < received["time"]


# (a loss in the forward, the backward or the reduction changes no result: test_engine.py drives the protocol
# through every phase in-process, and the bucketed reduction below does it with real jobs)
@pytest.mark.parametrize(
    ("fault", "what"),
    [
        ("kill@rank=0,step=6,phase=boundary", "the worker holding logical rank 0"),
        ("kill@rank=1,step=9,phase=commit", "a kill between reduction and commit"),
        ("kill@rank=1,step=5,phase=optimizer", "a kill during optimizer.step (after the commit)"),
        ("exit@rank=2,step=3,phase=boundary", "a crash (os._exit)"),
        ("raise@rank=1,step=4,phase=boundary", "an exception that kills the worker"),
    ],
)
def test_injected_failure(tmp_path, reference, fault, what):
    job, codes = run(tmp_path, train_args=TRAIN, faults=fault)
    assert_bit_exact(job, codes, reference())
    assert len(job.events("failure_detected")) == 1, what


def test_kill_during_a_bucketed_reduction(tmp_path, reference):
    # 5 kB buckets: the model's gradient spans several buckets, issued while backward runs.
    bucketed = ("--bucket-cap-mb", "0.005")
    job, codes = run(tmp_path, train_args=(*TRAIN, *bucketed), faults="kill@rank=1,step=6,phase=reduce")
    assert_bit_exact(job, codes, reference(3, bucketed))


def test_failure_right_after_a_validation_run(tmp_path, reference):
    # Validation every 6 batches (sync_dist logging inside); step 3 starts right after the first one.
    val = ("--val-every", "6")
    job, codes = run(tmp_path, train_args=(*TRAIN, *val), faults="kill@rank=2,step=3,phase=boundary")
    assert_bit_exact(job, codes, reference(3, val))


@pytest.mark.parametrize("hang", ["stop", "spin"], ids=["sigstop", "gil-holding-loop"])
def test_hang_is_detected_by_the_heartbeat(tmp_path, reference, hang):
    """A stopped process, and one spinning in a loop that never releases the GIL (its heartbeat thread
    starves): both fall silent, and the agent replaces them after ``--heartbeat-timeout``."""
    job, codes = run(tmp_path, train_args=TRAIN, faults=f"{hang}@rank=1,step=5,phase=boundary",
                     launch_args=("--heartbeat-timeout", "3"))
    assert_bit_exact(job, codes, reference())
    assert [e["worker"] for e in job.events("hang_detected")] == ["n0-s1-i0"]


def test_two_failures_with_two_spares(tmp_path, reference):
    job, codes = run(tmp_path, nproc=5, spares=2, train_args=TRAIN, launch_args=("--no-refill",),
                     faults="kill@rank=1,step=4,phase=reduce;kill@rank=2,step=11,phase=boundary")
    assert_bit_exact(job, codes, reference())
    assert len(job.events("failure_detected")) == 2
    # ``torchpass report``: its numbers are the log's, and the timeline is a real 1000 x 500 PNG.
    out = subprocess.run([sys.executable, "-m", "torchpass_plugins.cli", "report", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = dict(re.findall(r"^[│|] (\S[^│|]*?)\s+[│|] (\S+)\s+[│|]$", out, re.MULTILINE))
    assert (rows["Failures"], rows["Recoveries"], rows["Steps reached"], rows["Steps lost"]) == ("2", "2", "20", "0")
    sent = [e["bytes"] for e in job.events("state_sent")]
    assert len(sent) == 2 and all(f"{b:,}" in out for b in sent), out
    assert 0 < float(rows["Goodput"]) <= 1
    with Image.open(tmp_path / "timeline.png") as png:
        assert (png.format, png.size) == ("PNG", (1000, 500))


def test_second_failure_after_the_pool_was_refilled(tmp_path, reference):
    job = start(tmp_path, train_args=(*TRAIN, "--sleep-per-step", "0.5"), faults="kill@rank=1,step=2,phase=reduce")
    try:
        job.wait_until(lambda: job.events("spare_joined"), "the refilled spare to join")
        assert len(job.applied(2)) < STEPS, "training ended before the pool was refilled"
        os.kill(job.pid_of_rank(2), signal.SIGKILL)
        job.full_speed()
        codes = job.wait()
    finally:
        job.kill()
    assert_bit_exact(job, codes, reference(), killed_from_outside=(2,))
    promoted = [e["promoted"] for e in job.events("roster_published")][1:]
    assert promoted == [{"n0-s3-i0": 1}, {"n0-s1-i1": 2}]


def test_two_nodes_survive_a_loss_on_either_node(tmp_path, reference):
    # 2 agents x 2 slots, 2 spares: ranks 0-1 start on node 0, the spares are node 1's slots. The second
    # kill of rank 1 hits the node-1 worker that replaced it.
    train = ("--devices", "1", "--num-nodes", "2", "--max-steps", str(STEPS))
    job, codes = run(tmp_path, nproc=2, spares=2, nnodes=2, train_args=train, launch_args=("--no-refill",),
                     faults="kill@rank=1,step=4,phase=reduce;kill@rank=1,step=12,phase=boundary")
    assert_bit_exact(job, codes, reference(2, ("--devices", "1", "--num-nodes", "2")), world=2)
    lost = [e["worker"] for e in job.events("failure_detected")]
    assert lost == ["n0-s1-i0", "n1-s0-i0"]


def test_a_rank_that_stalls_the_collectives_is_found_and_replaced(tmp_path, reference):
    # Alive and beating, but never entering the next collective: the others' collectives time out, they
    # report it, and the one that did not is evicted and replaced.
    train = (*TRAIN, "--collective-timeout", "4")
    job, codes = run(tmp_path, train_args=train, faults="stall@rank=1,step=6,phase=boundary")
    assert_bit_exact(job, codes, reference())
    stalled = job.events("collective_stalled")
    assert [e["workers"] for e in stalled] == [["n0-s1-i0"]] and len(stalled[0]["timed_out"]) == 2
    assert [e["worker"] for e in job.events("worker_evicted")] == ["n0-s1-i0"]
    assert [e["rank"] for e in job.events("failure_detected")] == [1]


def _three_nodes(tmp_path, sleep_per_step: float):
    """3 agents x 1 slot: rank 0 on node 0 (which hosts the store and the coordinator), rank 1 on node 1, the
    spare on node 2."""
    train = ("--devices", "1", "--num-nodes", "2", "--max-steps", str(STEPS), "--sleep-per-step", str(sleep_per_step))
    return start(tmp_path, nproc=1, spares=1, nnodes=3, train_args=train, launch_args=("--heartbeat-timeout", "3"))


def test_a_lost_node_with_its_agent_is_replaced_by_a_spare_on_another_node(tmp_path, reference):
    # Node 1 dies whole: its agent and its worker at once, so no agent reports the exit.
    job = _three_nodes(tmp_path, sleep_per_step=0.2)
    try:
        job.wait_until(lambda: len(job.applied(1)) >= 5, "rank 1 to train")
        job.kill_node(1)
        job.full_speed()
        codes = job.wait()
    finally:
        job.kill()
    assert codes[1] == -signal.SIGKILL  # the lost node's agent; the others end the job normally
    assert_bit_exact(job, [codes[0], codes[2]], reference(2, ("--devices", "1", "--num-nodes", "2")), world=2,
                     killed_from_outside=(1,))
    assert [e["node"] for e in job.events("node_lost")] == [1]
    assert [e["worker"] for e in job.events("failure_detected")] == ["n1-s0-i0"]


def test_a_lost_node_started_again_refills_the_spare_pool_and_a_later_failure_uses_it(tmp_path, reference):
    # As above; then node 1's agent starts again (a replacement machine): its worker joins the empty spare
    # pool, and when rank 0 is killed later, that worker takes the rank.
    job = _three_nodes(tmp_path, sleep_per_step=1.0)
    try:
        job.wait_until(lambda: len(job.applied(1)) >= 2, "rank 1 to train")
        job.kill_node(1)
        job.wait_until(lambda: job.events("node_lost"), "node 1 to be written off")
        job.start_node(1)
        job.wait_until(lambda: job.events("spare_joined"), "node 1's new worker to join the spare pool")
        assert len(job.applied(0)) < STEPS - 2, "too late in training for a second failure"
        os.kill(job.pid_of_rank(0), signal.SIGKILL)
        job.full_speed()
        codes = job.wait()
    finally:
        job.kill()
    assert_bit_exact(job, codes, reference(2, ("--devices", "1", "--num-nodes", "2")), world=2,
                     killed_from_outside=(0, 1))
    assert [e["node"] for e in job.events("node_rejoined")] == [1]
    assert job.events("spare_joined")[0]["worker"] == "n1-s0-i1"  # named anew: never reused
    assert [e["rank"] for e in job.events("failure_detected")] == [1, 0]
    assert job.events("roster_published")[-1]["ranks"] == ["n1-s0-i1", "n2-s0-i0"]


def test_more_failures_than_spares_stop_the_job_clearly(tmp_path):
    job, codes = run(tmp_path, train_args=TRAIN, launch_args=("--no-refill", "--max-restarts", "0"),
                     faults="kill@rank=1,step=3,phase=boundary;kill@rank=2,step=8,phase=boundary")
    assert codes == [1]
    assert job.output().count("torchpass: job aborted: 2 worker(s) lost") + job.output().count(
        "torchpass: job aborted: 1 worker(s) lost") == 1, job.output()[-3000:]
    assert "but 0 spare(s) left" in job.output() and "--spares" in job.output()
    assert "Traceback" not in job.output()
    assert len(job.events("job_aborted")) >= 1
    assert job.leftovers() == []


def test_sigterm_to_the_agent_stops_every_worker(tmp_path):
    job = start(tmp_path, train_args=(*TRAIN, "--sleep-per-step", "0.2"))
    try:
        job.wait_until(lambda: len(job.applied(0)) >= 2, "training to start")
        job.agents[0].send_signal(signal.SIGTERM)
        codes = job.wait(timeout=60)
    finally:
        job.kill()
    assert codes == [128 + signal.SIGTERM]
    assert job.events("agent_signalled")
    assert job.leftovers() == []
