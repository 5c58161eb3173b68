"""``torchpass_fsdp`` end to end: real processes, FSDP2 over gloo, real SIGKILLs, ring-replicated shards."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import STEPS, assert_bit_exact
from jobs import run
from torch.distributed.checkpoint import FileSystemReader

from torchpass_plugins.demo.train import Classifier
from torchpass_plugins.storage.snapshot_store import SnapshotStore
from torchpass_plugins.testing.chaos.oracle import differences

FSDP = ("--strategy", "torchpass_fsdp")
TRAIN = ("--devices", "3", "--max-steps", str(STEPS), *FSDP)


def test_kill_mid_step_restores_the_shard_from_its_replica(tmp_path, reference):
    job, codes = run(tmp_path, train_args=TRAIN, faults="kill@rank=1,step=5,phase=reduce")
    assert_bit_exact(job, codes, reference(3, FSDP))
    recovered = job.events("recovered")
    assert {e["rank"] for e in recovered} == {0, 1, 2}
    assert {(e["restore_step"], e["steps_rolled_back"]) for e in recovered} == {(5, 0)}
    [shard] = [e for e in job.events("state_received") if e["kind"] == "shard"]
    assert (shard["rank"], shard["src"]) == (1, 2)  # rank 1's replica lives on its ring successor


def test_replicating_every_4_steps_replays_the_logged_steps_and_rolls_nothing_back(tmp_path, reference):
    fp16 = (*FSDP, "--precision", "16-mixed")  # the gradient scaler's state changes every step too
    job, codes = run(tmp_path, train_args=(*TRAIN, "--precision", "16-mixed", "--replicate-every", "4"),
                     faults="kill@rank=1,step=6,phase=reduce")
    assert all(code == 0 for code in codes), job.output()[-4000:]
    assert {(e["restore_step"], e["steps_rolled_back"]) for e in job.events("recovered")} == {(6, 0)}
    # Rank 1's replica is of step 4: its successor replayed the gradients of steps 4 and 5 it had logged.
    [sent] = [e for e in job.events("state_sent") if e["kind"] == "shard"]
    assert (sent["rank"], sent["steps_replayed"]) == (2, 2)
    # Each holder logged at least two steps' gradients of its predecessor's shard (the shard sent is its
    # weights and two Adam moments: three shard-sized tensors), and the event reports it.
    [shard] = [e for e in job.events("state_received") if e["kind"] == "shard"]
    memory = job.events("replica_memory")
    assert sorted(e["rank"] for e in memory) == [0, 1, 2]
    assert all(e["log_bytes"] > 2 * shard["bytes"] / 3 for e in memory), memory
    expected = reference(3, fp16)
    for rank in range(3):
        found = differences(expected.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "\n".join(found[:10])
        assert job.applied(rank) == list(range(STEPS))
    assert job.leftovers() == []


EVERY_PHASE = ("boundary", "data", "forward", "backward", "reduce", "commit", "optimizer", "replicate")


@pytest.mark.parametrize("every", [1, 4])
def test_a_kill_in_every_phase_of_a_step_rolls_no_survivor_back(tmp_path, reference, every):
    """One job, one SIGKILL in each phase of a step (the replication round's included), two steps apart,
    of rank 0 as often as of the others. Every recovery restores the step the job was at: the event log
    shows no applied step rolled back, each rank applied every step once, and every rank ends bit-exact."""
    kills = ";".join(f"kill@rank={i % 3},step={2 + 2 * i},phase={phase}" for i, phase in enumerate(EVERY_PHASE))
    job, codes = run(tmp_path, nproc=5, spares=2, train_args=(*TRAIN, "--replicate-every", str(every)), faults=kills)
    assert codes == [0], job.output()[-4000:]
    assert len(job.events("failure_detected")) == len(EVERY_PHASE), job.events("failure_detected")
    recovered = job.events("recovered")
    assert {e["steps_rolled_back"] for e in recovered} == {0}, recovered
    for rank in range(3):
        assert job.applied(rank) == list(range(STEPS)), f"rank {rank} applied {job.applied(rank)}"
    expected = reference(3, FSDP)
    for rank in range(3):
        found = differences(expected.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "\n".join(found[:10])
    assert job.leftovers() == []


@pytest.mark.parametrize("phase", ["backward", "commit"])
def test_two_ranks_lost_at_once_apart_in_the_ring_roll_no_survivor_back(tmp_path, reference, phase):
    """Ranks 0 and 2 of 4 SIGKILLed in the same step: neither holds the other's replica, so each lost shard
    comes from its own ring successor, and the survivors go on from the step the job was at."""
    world = ("--devices", "4", "--max-steps", str(STEPS), *FSDP)
    job, codes = run(tmp_path, nproc=6, spares=2, train_args=world,
                     faults=f"kill@rank=0,step=5,phase={phase};kill@rank=2,step=5,phase={phase}")
    assert_bit_exact(job, codes, reference(4, FSDP), world=4)
    assert {(e["restore_step"], e["steps_rolled_back"]) for e in job.events("recovered")} == {(5, 0)}
    shards = {(e["rank"], e["src"]) for e in job.events("state_received") if e["kind"] == "shard"}
    assert shards == {(0, 1), (2, 3)}


def test_a_rank_lost_with_its_replica_holder_falls_back_to_the_newest_sharded_snapshot(tmp_path, reference):
    # Rank 2 dies after rank 1's replacement was published: the recovery itself meets a second failure, and
    # rank 1's shard exists nowhere in memory. The job restarts and every rank loads its shards from the snapshot.
    snapshots = tmp_path / "snapshots"
    train = (*TRAIN, "--snapshot-dir", str(snapshots), "--snapshot-every", "2", "--snapshot-when-busy", "wait")
    job, codes = run(tmp_path, nproc=5, spares=2, train_args=train, launch_args=("--no-refill",),
                     faults="kill@rank=1,step=5,phase=reduce;kill@rank=2,step=5,phase=survivor")
    assert codes == [0], job.output()[-3000:]
    [restart] = job.events("job_restarting")
    assert "logical rank 1 and its replica holder, rank 2, were lost together" in restart["message"]
    resumed = job.events("snapshot_resumed")
    assert len(resumed) == 3 and len({(e["step"], e["steps_lost"]) for e in resumed}) == 1
    step = resumed[0]["step"]
    assert step in (2, 4) and resumed[0]["steps_lost"] == 5 - step  # step 5 never committed
    for manifest in SnapshotStore(str(snapshots)).committed():
        # one DCP checkpoint: each rank wrote its shards
        assert sorted(manifest.files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    final, expected = job.final(), reference(3, FSDP).final()
    assert final["global_step"] == STEPS and final["adam_steps"] == expected["adam_steps"]
    for name, tensor in expected["weights"].items():
        assert torch.equal(final["weights"][name], tensor), f"{name} differs from the failure-free run"
    assert "Traceback" not in job.output()
    assert job.leftovers() == []


def test_model_aware_mode_moves_fewer_bytes_to_the_same_result(tmp_path, reference):
    frozen = (*FSDP, "--max-steps", "8", "--freeze-first")
    failure_free = reference(3, frozen)
    sent = {}
    for mode, extra in (("transparent", ()), ("model_aware", ("--model-aware",))):
        job, codes = run(tmp_path / mode, train_args=("--devices", "3", *frozen, *extra),
                         faults="kill@rank=1,step=5,phase=reduce")
        assert_bit_exact(job, codes, failure_free, steps=8)
        [shard] = [e for e in job.events("state_received") if e["kind"] == "shard"]
        sent[mode] = shard["bytes"]
    assert sent["model_aware"] < sent["transparent"]


def test_a_checkpoint_goes_through_lightnings_own_fsdp2_and_back_and_continues_bit_exact(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    job, codes = run(tmp_path / "save", nproc=3, spares=0,
                     train_args=("--devices", "3", "--max-steps", "4", *FSDP, "--save-checkpoint", str(ckpt)))
    assert codes == [0], job.output()[-3000:]
    saved, save_job = job.final(), job
    # ModelParallelStrategy's layout: DCP shards of the model and each optimizer, and meta.pt with the rest.
    stored = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert (ckpt / "meta.pt").is_file() and {name.split(".")[0] for name in stored} == {"state_dict", "optimizer_0"}
    loaded, rewritten = tmp_path / "model_parallel.pt", tmp_path / "by_lightning"
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / "model_parallel_load.py"), str(ckpt),
                           "--out", str(loaded), "--save", str(rewritten)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    by_lightning = torch.load(loaded)
    assert (by_lightning["global_step"], by_lightning["adam_steps"]) == (4, saved["adam_steps"])
    buffers = {name for name, _ in Classifier().named_buffers()}
    for name, tensor in saved["weights"].items():  # its 3 ranks' shards, loaded into 1: every value the same
        got = by_lightning["weights"][name]
        if name in buffers:  # DCP keeps one rank's copy of what is not sharded (FSDP's buffers differ by rank)
            assert any(torch.equal(got, save_job.state(rank)["module"][name]) for rank in range(3)), name
        else:
            assert torch.equal(got, tensor), name

    # What Lightning wrote from it, continued to the end by torchpass_fsdp with each rank's own buffers (which
    # Lightning's strategy does not write: copied in), ends on every rank as the uninterrupted run. (And a
    # snapshot an earlier attempt left half-written is deleted as the job starts: its parts are not this job's.)
    for own in ckpt.glob("buffers_rank*.pt"):
        shutil.copy(own, rewritten)
    torn = tmp_path / "snapshots" / "step-000000009"
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(b"an earlier attempt's part")
    job, codes = run(tmp_path / "load", nproc=3, spares=0,
                     train_args=(*TRAIN, "--resume", str(rewritten), "--snapshot-dir", str(tmp_path / "snapshots")))
    assert codes == [0], job.output()[-3000:]
    assert not torn.exists()
    expected = reference(3, FSDP)
    for rank in range(3):
        found = differences(expected.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "\n".join(found[:10])
