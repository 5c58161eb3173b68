"""Snapshots: committed only by their manifest, verified on load, written in the background, resumed bit-exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import STEPS
from jobs import run

from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.state_parts import ResumedSnapshot
from torchpass_plugins.observe.events import EventLog, read_events
from torchpass_plugins.storage.snapshot_parts import refuse_another_jobs
from torchpass_plugins.storage.snapshot_store import (
    Manifest,
    SnapshotAbandoned,
    SnapshotCorrupted,
    SnapshotStore,
    model_fingerprint,
)
from torchpass_plugins.storage.snapshot_writer import AsyncSnapshotWriter, SnapshotPlan


def _state(value: float) -> dict:
    return {"weights": {"w": torch.full((4, 4), value)}, "step": int(value), "nested": [(1, 2.5), "text"]}


def _commit(store: SnapshotStore, step: int, state: dict | None = None) -> None:
    save = store.save(step, rank=0, world_size=1, writers=[0], state=state or _state(float(step)))
    save.run(dict(save.values), seed=7, model="", timeout=10)


def _torn(store: SnapshotStore, step: int) -> None:
    """A snapshot whose files landed but whose commit did not."""
    _commit(store, step)
    store.fs.rm(f"{store.step_dir(step)}/manifest.json")


def _read(store: SnapshotStore, manifest: Manifest) -> dict:
    state = _state(-1.0)
    store.read(manifest, state)
    return state


def _distcp(store: SnapshotStore, step: int, rank: int = 0) -> str:
    return f"{store.step_dir(step)}/__{rank}_0.distcp"


@pytest.fixture(params=["file", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        yield SnapshotStore(str(tmp_path / "snaps"))
        return
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        yield SnapshotStore(f"s3://snapshots/{tmp_path.name}")
        return
    url = f"memory://snaps-{time.monotonic_ns()}"
    yield SnapshotStore(url)
    store = SnapshotStore(url)
    if store.fs.exists(store.root):
        store.fs.rm(store.root, recursive=True)


def test_round_trip_and_only_committed_snapshots_are_seen(store):
    assert store.load_newest() is None
    _commit(store, 5)
    _torn(store, 10)
    manifest, refused = store.load_newest()
    assert (manifest.step, manifest.seed, refused) == (5, 7, [])
    state = _read(store, manifest)
    assert torch.equal(state["weights"]["w"], torch.full((4, 4), 5.0)) and state["nested"] == [(1, 2.5), "text"]
    assert state["step"] == 5 and store.torn() == [10]
    assert ".metadata" in manifest.files  # a torch Distributed Checkpoint
    plain = {"weights": {"w": torch.zeros(4, 4)}}
    if store.url.startswith("/"):  # a directory: DCP alone reads it
        dcp.load(plain, checkpoint_id=store.step_dir(5), no_dist=True)
        assert torch.equal(plain["weights"]["w"], torch.full((4, 4), 5.0))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_snapshot_is_refused_and_the_previous_one_used(store, damage):
    _commit(store, 5)
    _commit(store, 10)
    path = _distcp(store, 10)
    data = bytearray(store.fs.cat_file(path))
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 3 :]
    store.fs.pipe_file(path, bytes(data))
    manifest, refused = store.load_newest()
    assert manifest.step == 5 and _read(store, manifest)["step"] == 5
    assert len(refused) == 1 and ("checksum" in refused[0] if damage == "flip" else "truncated" in refused[0])


def _save_from_threads(store: SnapshotStore, step: int, states: list[dict]) -> None:
    """The ranks of one job save at once (each in its own thread, as each job's ranks do in theirs)."""
    writers = list(range(len(states)))
    saves = [store.save(step, rank, len(states), writers, state) for rank, state in enumerate(states)]
    threads = [threading.Thread(target=s.run, args=(dict(s.values), 7, "", 30)) for s in saves]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


def test_the_ranks_of_a_job_agree_on_the_newest_snapshot_all_their_files_verify(tmp_path):
    # Each rank verifies a share of the files. Rank 1's own file of the newest is damaged, and rank 0
    # verifies it: both ranks must take the previous snapshot, although rank 1's share verifies.
    store = SnapshotStore(str(tmp_path / "snaps"))
    for step in (4, 8):
        _save_from_threads(store, step, [{f"rank{rank}": _state(float(step + rank))} for rank in (0, 1)])
    manifest = store.manifest(8)
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    path = _distcp(store, 8, rank=1)
    data = bytearray(store.fs.cat_file(path))
    data[-10] ^= 0x01
    store.fs.pipe_file(path, bytes(data))
    verdicts, barrier, found = [True, True], threading.Barrier(2, timeout=30), {}

    def rank_main(rank: int) -> None:
        def everyone(ok: bool) -> bool:  # an all-reduce (min) between two threads
            verdicts[rank] = ok
            barrier.wait()
            agreed = all(verdicts)
            barrier.wait()
            return agreed

        found[rank] = store.load_newest(rank, 2, [m.step for m in store.committed()], everyone)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    (m0, refused0), (m1, refused1) = found[0], found[1]
    assert (m0.step, m1.step) == (4, 4)
    assert "checksum" in refused0[0] and "another rank" in refused1[0]
    theirs = {"rank1": _state(-1.0)}
    store.read(m0, theirs)
    assert theirs["rank1"]["step"] == 5


def test_a_snapshot_that_waits_for_a_lost_rank_is_abandoned_once_the_roster_changes(tmp_path):
    store = SnapshotStore(str(tmp_path / "snaps"))
    save = store.save(4, rank=0, world_size=2, writers=[0, 1], state=_state(4.0))  # rank 1 was lost unwritten
    verdicts = iter([None, None, "the job's roster changed while it was being saved"])
    with pytest.raises(SnapshotAbandoned, match="roster changed"):  # long before the 600 s timeout
        save.run(dict(save.values), 7, "", timeout=600, abandoned=lambda: next(verdicts))
    assert store.committed() == [] and store.torn() == [4]


def test_snapshots_refuse_arbitrary_pickles(store):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    _commit(store, 3, {"x": Evil()})
    with pytest.raises(SnapshotCorrupted, match=r"cannot be loaded: UnpicklingError: Weights only load failed"):
        store.read(store.manifest(3), {"x": None})


def test_retention_keeps_the_newest_and_drops_torn_leftovers(store):
    for step in (2, 4, 6):
        _commit(store, step)
    _torn(store, 5)  # older than the newest committed
    _torn(store, 8)  # in flight: newer than the newest committed, so kept
    assert store.retain(keep=2) == [2, 5]
    assert [m.step for m in store.committed()] == [4, 6] and store.torn() == [8]


def test_sigkill_during_a_write_leaves_the_previous_snapshot_loadable(tmp_path):
    store = SnapshotStore(str(tmp_path / "snaps"))
    _commit(store, 1)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import torch; from torchpass_plugins.storage.snapshot_store import SnapshotStore\n"
        f"s = SnapshotStore({str(tmp_path / 'snaps')!r})\n"
        "save = s.save(2, 0, 1, [0], {'big': torch.zeros(200 * 2**20)})\n"  # 800 MB: still being written
        "save.run(dict(save.values), 0, '', 10)\n"
    )])
    partial = Path(_distcp(store, 2))
    try:
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size > 2**20):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.001)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    manifest, refused = store.load_newest()
    assert manifest.step == 1 and refused == [] and store.torn() == [2]


def test_writer_copies_stable_tensors_in_the_background_and_the_rest_at_once(tmp_path):
    landed = threading.Event()

    class SlowStore(SnapshotStore):
        def save(self, *args):
            save = super().save(*args)
            run = save.run
            save.run = lambda *a: landed.wait(30) and run(*a)
            return save

    store = SlowStore(str(tmp_path / "snaps"))
    events = EventLog(tmp_path / "events.jsonl")
    writer = AsyncSnapshotWriter(SnapshotPlan(store, rank=0, world_size=1, writers=[0], seed=3), events)
    param, buffer = torch.zeros(8), torch.zeros(8)
    assert writer.start(4, {"param": param, "buffer": buffer}, stable={param.data_ptr()})
    buffer.add_(1)  # the forward updates a buffer right away: the snapshot has its value at the boundary
    writer.fence()
    param.add_(1)  # the optimizer step, after the fence
    assert not writer.start(5, {"param": param, "buffer": buffer}, stable=set())  # one in flight: skipped
    landed.set()
    writer.close()
    manifest, _ = store.load_newest()
    state = {"param": torch.ones(8), "buffer": torch.ones(8)}
    store.read(manifest, state)
    assert torch.equal(state["param"], torch.zeros(8)) and torch.equal(state["buffer"], torch.zeros(8))
    names = [e["event"] for e in read_events(tmp_path)]
    assert names.count("snapshot_committed") == 1 and names.count("snapshot_skipped") == 1


def test_a_job_that_lost_more_workers_than_spares_restarts_and_resumes_bit_exact_from_s3(tmp_path, reference,
                                                                                          s3_env):
    url = f"s3://snapshots/{tmp_path.name}"
    train = ("--max-steps", str(STEPS), "--snapshot-dir", url, "--snapshot-every", "4", "--snapshot-when-busy", "wait")
    job, codes = run(tmp_path, nproc=3, spares=0, train_args=train, launch_args=("--spare-wait", "0"),
                     faults="kill@rank=1,step=14,phase=reduce")
    assert codes == [0], job.output()[-3000:]
    [restart] = job.events("job_restarting")
    assert restart["attempt"] == 1 and "0 spare(s) left" in restart["message"]
    # The newest snapshot committed before the kill: 12, or 8 if rank 1 died before its part of 12 landed.
    resumed = job.events("snapshot_resumed")
    [(step, lost)] = {(e["step"], e["steps_lost"]) for e in resumed}
    assert len(resumed) == 3 and step in (8, 12) and lost == 14 - step
    assert f"resuming from the snapshot of step {step}" in job.output() and f"{lost} step(s) lost" in job.output()
    final, expected = job.final(), reference(3).final()
    assert final["global_step"] == STEPS and final["adam_steps"] == expected["adam_steps"]
    for name, tensor in expected["weights"].items():
        assert torch.equal(final["weights"][name], tensor), f"{name} differs from the failure-free run"
    for rank in range(3):  # the lost steps were applied before the failure, and again after the resume
        assert job.applied(rank) == [*range(14), *range(step, STEPS)], f"rank {rank} applied {job.applied(rank)}"
    assert [m.step for m in SnapshotStore(url).committed()] == [8, 12, 16]  # the newest 3 are kept
    assert job.leftovers() == []


def test_a_job_of_another_size_resumes_resharded_and_one_of_another_model_is_refused_untouched(tmp_path, reference):
    # Three torchpass_fsdp ranks write the snapshot of step 4 and go on. A job of another model is refused
    # before it reads or deletes anything. Two ranks resume from it with nothing left to train: they end
    # with the state of step 4 of a three-rank run, loaded into two ranks' shards.
    snaps, fsdp = tmp_path / "snaps", ("--strategy", "torchpass_fsdp")
    train = (*fsdp, "--snapshot-dir", str(snaps), "--snapshot-every", "4", "--snapshot-when-busy", "wait")
    job, codes = run(tmp_path / "three", nproc=3, spares=0, train_args=(*train, "--devices", "3", "--max-steps", "6"))
    assert codes == [0], job.output()[-3000:]
    before = sorted((p.relative_to(snaps), p.stat().st_mtime_ns) for p in snaps.rglob("*"))
    two = (*train, "--devices", "2", "--max-steps", "4")
    job, codes = run(tmp_path / "other-model", nproc=2, spares=0, train_args=(*two, "--hidden", "32"))
    assert codes != [0]
    assert "was written by another job (a model whose parameters have other names, shapes" in job.output()
    assert "Give this job its own snapshot directory" in job.output()
    assert sorted((p.relative_to(snaps), p.stat().st_mtime_ns) for p in snaps.rglob("*")) == before
    assert not job.events("snapshot_resumed") and not job.events("snapshot_committed")
    job, codes = run(tmp_path / "two", nproc=2, spares=0, train_args=two)
    assert codes == [0], job.output()[-3000:]
    resumed = job.events("snapshot_resumed")
    assert sorted((e["rank"], e["step"], e["written_by"]) for e in resumed) == [(0, 4, 3), (1, 4, 3)]
    assert "written by 3 ranks, loaded into 2" in job.output()
    final, expected = job.final(), reference(3, (*fsdp, "--max-steps", "4")).final()
    assert final["global_step"] == 4 and final["adam_steps"] == expected["adam_steps"]
    for name, tensor in expected["weights"].items():
        assert torch.equal(final["weights"][name], tensor), f"{name} differs from step 4 of the three-rank run"
    assert job.leftovers() == []


def test_a_snapshot_of_another_model_is_refused():
    ours, theirs = torch.nn.Linear(4, 2), torch.nn.Linear(4, 3)
    manifest = Manifest(3, world_size=2, seed=0, files={}, created=0.0, model=model_fingerprint(theirs))
    assert model_fingerprint(ours) == model_fingerprint(torch.nn.Linear(4, 2))  # values do not matter
    with pytest.raises(ConfigError, match=r"another job .*a model whose parameters have other names, shapes"):
        refuse_another_jobs(manifest, "s3://b/x", model=model_fingerprint(ours))
    refuse_another_jobs(replace(manifest, model=model_fingerprint(ours)), "s3://b/x", model_fingerprint(ours))


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem that fills up: a 320 kB tmpfs, room for one of the demo's snapshots (mounting needs
    root, which CI has)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_fails_snapshots_not_the_job_and_the_newest_committed_one_still_loads(tmp_path, small_disk):
    train = ("--max-steps", "12", "--snapshot-dir", str(small_disk), "--snapshot-every", "2", "--devices", "2")
    job, codes = run(tmp_path, nproc=2, spares=0, train_args=train)
    assert codes == [0], job.output()[-3000:]
    failed = job.events("snapshot_failed")
    assert failed and any("No space left on device" in e["error"] for e in failed), failed
    store = SnapshotStore(str(small_disk))
    committed = store.committed()
    assert committed, "the first snapshot fits on the disk"
    manifest, refused = store.load_newest()
    assert manifest.step == committed[-1].step and not refused
    assert ResumedSnapshot(store, manifest, rank=0).trainer["global_step"] == manifest.step
