"""Bad input fails before any training, with a message that says what to change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import TRAIN, free_port, run, start

from torchpass_plugins.control.membership import connect_store
from torchpass_plugins.integrations.lightning import TorchPassDDPStrategy


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")},
                               **(env or {})})


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--spares", "-1"], "spares=-1 is not allowed; use an integer >= 0 (flag --spares)"),
     (["--spares", "4"], "leaves no active rank")],
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


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def test_the_store_listens_on_the_endpoint_address_only():
    server = connect_store("127.0.0.1:0", is_master=True, timeout=10)
    assert _listening(server.port) == ["0100007F"]  # 127.0.0.1, not every interface (torch's default)
    client = connect_store(f"127.0.0.1:{server.port}", timeout=10)
    client.set("k", "v")
    assert server.get("k") == b"v"


def test_an_agent_that_cannot_reach_the_store_says_what_to_check():
    port = free_port()  # nobody listens there
    out = _cli("-m", "torchpass_plugins.cli", "launch", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-timeout", "2", str(TRAIN), env={"TORCHPASS_JOIN_TOKEN": "t"}, timeout=60)
    assert out.returncode == 1
    assert f"no store at 127.0.0.1:{port} within 2 s" in out.stderr and "start node 0's agent first" in out.stderr


def test_a_node_with_the_wrong_join_token_is_refused_once_and_stops(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}

    def agent(node: int, token: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torchpass_plugins.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir", str(tmp_path), str(TRAIN), "--num-nodes", "2",
               "--devices", "1"]  # fmt: skip
        return subprocess.Popen(cmd, env={**env, "TORCHPASS_JOIN_TOKEN": token}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    node0 = agent(0, "right")
    try:
        time.sleep(0.5)
        intruder = agent(1, "wrong")
        out, _ = intruder.communicate(timeout=120)
        assert intruder.returncode == 1
        assert "refused this node's workers: wrong join token: set the same TORCHPASS_JOIN_TOKEN" in out
        events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [e["event"] for e in events].count("join_rejected") == 1  # not refilled, not retried
        assert node0.poll() is None  # the job still waits for its own second node
    finally:
        os.killpg(node0.pid, signal.SIGKILL)
        node0.wait()


FEATURE_JOB = Path(__file__).parent / "scripts" / "feature_job.py"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("feature", "strategy", "message"),
    [
        ("iterable", "torchpass_ddp", "reads an IterableDataset"),
        ("manual", "torchpass_fsdp", "manual optimization (automatic_optimization = False) is not supported"),
        ("lbfgs", "torchpass_ddp", "the LBFGS optimizer is not supported"),
        ("capturable", "torchpass_fsdp", "AdamW(capturable=True) cannot be replayed"),
        ("own_sampler", "torchpass_ddp", "a sampler with set_epoch (Lightning's DistributedSampler"),
    ],
)
def test_a_feature_no_spare_could_continue_is_refused_before_training(tmp_path, feature, strategy, message):
    job, codes = run(tmp_path, nproc=3, spares=1, script=FEATURE_JOB,
                     train_args=("--feature", feature, "--strategy", strategy))
    assert codes == [1], job.output()[-3000:]
    assert message in job.output() and "configuration error" in job.output()
    assert job.events("progress") == []  # no step began
    assert len(job.events("worker_started")) == 3  # stopped, not handed to the spare
    assert job.leftovers() == []


@pytest.mark.timeout(240)
def test_an_error_every_spare_repeats_stops_the_job_instead_of_looping(tmp_path):
    job, codes = run(tmp_path, nproc=3, spares=1, script=FEATURE_JOB, train_args=("--feature", "crash_loop"))
    assert codes == [1], job.output()[-3000:]
    assert "two spares promoted to rank 1 failed the same way before completing a step" in job.output()
    assert "rank 1 breaks at step 3" in job.output()
    assert len(job.events("failure_detected")) == 2  # the first rank 1, then its first spare: not a loop
    assert job.leftovers() == []


@pytest.mark.timeout(240)
def test_a_script_that_fails_before_joining_stops_the_job_instead_of_being_started_again_and_again(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\nraise RuntimeError('the dataset is not where the script looks')\n")
    job, codes = run(tmp_path, nproc=2, spares=1, script=script)
    assert codes == [1], job.output()[-3000:]
    assert "RuntimeError: the dataset is not where the script looks" in job.output()
    assert "exited with code 1 before the job started: its script failed before joining it" in job.output()
    started = [e["slot"] for e in job.events("worker_started")]
    assert max(started.count(slot) for slot in set(started)) <= 4  # not started again and again (at most 3 more)
    assert job.leftovers() == []


@pytest.mark.timeout(240)
def test_a_refilled_slot_whose_script_fails_before_joining_is_not_started_again_and_again(tmp_path):
    # The job's first workers train; every later one fails at its start (as a node whose local copy of the
    # data was deleted would): the spare takes the lost rank, and the lost slot is tried three times, not more.
    script = tmp_path / "fails_when_refilled.py"
    script.write_text(
        "import json, os, runpy, sys\n"
        "if not json.loads(os.environ['TORCHPASS_WORKER'])['worker_id'].endswith('-i0'):\n"
        "    sys.exit(3)\n"
        f"sys.argv[0] = {str(TRAIN)!r}\n"
        f"runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n")
    job = start(tmp_path, nproc=3, spares=1, script=script, faults="kill@rank=1,step=3,phase=boundary",
                train_args=("--devices", "2", "--max-steps", "40", "--sleep-per-step", "0.2"))
    try:
        job.wait_until(lambda: job.events("refill_stopped"), "the lost slot to be given up")
        job.full_speed()
        codes = job.wait()
    finally:
        job.kill()
    assert codes == [0], job.output()[-3000:]
    [stopped] = job.events("refill_stopped")
    assert "its last 3 workers failed before joining the job" in stopped["why"]
    lost_slot = [e for e in job.events("worker_started") if e["slot"] == stopped["slot"]]
    assert len(lost_slot) == 4  # the first worker, then three that failed at their start
    assert job.leftovers() == []
