"""``torchrun`` / ``accelerate launch`` with ``-m torchpass_plugins.run``: their agent kills every process
when one exits, so each process they start is a one-slot torchpass supervisor; a worker's loss is then
survived as under ``torchpass launch``."""

from __future__ import annotations

import sys

import pytest
from conftest import STEPS, assert_bit_exact
from jobs import TRAIN, free_port, run_command

from torchpass_plugins.run import config_from_torchrun

TORCHRUN_ENV = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
                "TORCHELASTIC_RUN_ID": "job7"}


def test_each_process_of_torchrun_becomes_a_one_slot_agent_of_one_job():
    config = config_from_torchrun(["--spares", "1", "train.py", "--lr", "3"], TORCHRUN_ENV)
    assert (config.nnodes, config.node_rank, config.nproc_per_node, config.first_slot) == (4, 2, 1, 2)
    assert (config.world_size, config.rdzv_endpoint) == (3, "127.0.0.1:29511")
    assert config.command == ["train.py", "--lr", "3"]
    assert config.external_store and config.token == config_from_torchrun(["t.py"], TORCHRUN_ENV).token
    with pytest.raises(SystemExit):
        config_from_torchrun(["t.py"], {})  # not under torchrun: told to use torchpass launch


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_a_kill_under_torchrun_or_accelerate_launch_is_survived(tmp_path, reference, launcher):
    port = str(free_port())
    runner = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", port],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_port", port],
    }[launcher]
    cmd = [*runner, "-m", "torchpass_plugins.run", "--spares", "1", "--run-dir", str(tmp_path), str(TRAIN),
           "--out", str(tmp_path / "out"), "--devices", "3", "--max-steps", str(STEPS)]
    job, codes = run_command(tmp_path, cmd, "kill@rank=1,step=5,phase=reduce")
    assert_bit_exact(job, codes, reference())
    assert [e["rank"] for e in job.events("failure_detected")] == [1]
