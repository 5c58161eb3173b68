"""The coordinator moves between agents of an etcd job (leadership): a real 3-member etcd cluster on
127.0.0.1, the leader's lease, the fence that keeps a deposed leader from writing, a successor that goes on
from its predecessor's saved state, and whole jobs that lose the coordinating agent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import STEPS, assert_bit_exact
from jobs import start

from torchpass_plugins.control.coordinator import Coordinator
from torchpass_plugins.control.etcd_store import Deposed, EtcdStore
from torchpass_plugins.control.leadership import BATCH_KEY, LEADER_KEY, JournaledInbox
from torchpass_plugins.control.protocol import Exit, Join, Roster, join_key, roster_key, send
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.timeout(120)
CANDIDATE = Path(__file__).parent / "scripts" / "candidate.py"


@pytest.fixture
def cluster(tmp_path):
    with EtcdCluster(tmp_path) as members:
        yield members


def _store(cluster, prefix: str = "job") -> EtcdStore:
    return EtcdStore(cluster.endpoints, prefix=prefix, timeout=timedelta(seconds=20))


def _lead(store: EtcdStore, ttl: float = 2.0) -> tuple[int, EtcdStore]:
    lease = store.grant_lease(ttl)
    created = store.create_leased(LEADER_KEY, "candidate", lease)
    assert created is not None
    return lease, store.fenced(LEADER_KEY, created)


def test_a_leader_whose_lease_ran_out_cannot_write_once_another_won(cluster):
    store = _store(cluster)
    store.queue_push("inbox", b"m")
    _, old = _lead(store, ttl=1.0)
    old.set("roster/1", b"old")  # while it holds the key, its writes land
    assert store.create_leased(LEADER_KEY, "rival", store.grant_lease(5)) is None  # one leader at a time
    deadline = time.monotonic() + 10
    while store.check([LEADER_KEY]):  # not renewed: etcd ends the lease and deletes the key
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _, new = _lead(store, ttl=5.0)
    writes = {"set": lambda: old.set("roster/2", b"stale"), "add": lambda: old.add("n", 1),
              "compare_set": lambda: old.compare_set("roster/1", "old", "stale"),
              "write": lambda: old.write({"roster/2": b"stale"}, []), "delete": lambda: old.delete_key("roster/1"),
              "queue_take": lambda: old.queue_take("inbox", "batch"), "queue_pop": lambda: old.queue_pop("inbox")}
    for name, write in writes.items():
        with pytest.raises(Deposed):
            write()
            pytest.fail(f"{name} went through")
    assert store.get("roster/1") == b"old" and not store.check(["roster/2", "n", "batch"])
    assert store.queue_len("inbox") == 1
    new.set("roster/2", b"new")  # the new leader writes
    assert new.queue_take("inbox", "batch") == [b"m"] and store.check(["batch"])


def test_a_paused_leader_that_resumes_cannot_publish_and_stands_again(cluster, tmp_path):
    """Two candidate processes; the leader is paused (SIGSTOP: cut off, as a partition would) past its
    lease. The other takes over; once resumed, the old leader's next write fails and it does not lead."""
    endpoints = ",".join(cluster.endpoints)
    store = _store(cluster, prefix="candidates")
    logs = [tmp_path / f"candidate{i}.log" for i in range(2)]
    procs = []
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, str(CANDIDATE), endpoints, str(i),
                                               "1"], stdout=out, stderr=subprocess.STDOUT))
            if i == 0:
                _wait(lambda: store.check(["published"]), "candidate 0 to lead")
        assert store.get("published") == b"0"
        procs[0].send_signal(signal.SIGSTOP)
        _wait(lambda: store.get("published") == b"1", "candidate 1 to take over")
        procs[0].send_signal(signal.SIGCONT)
        time.sleep(2.0)  # the resumed one runs its loop: every write it tries is refused
        assert store.get("published") == b"1"
        old, new = (log.read_text() for log in logs)
        assert "no longer coordinates" in old and old.count("elected") == 1, old  # it stepped down
        assert new.count("elected") == 1, new
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def _join(store, worker: str) -> None:
    store.set(join_key(worker), "tok")
    send(store, Join(worker))


def test_a_successor_goes_on_from_the_saved_state_and_handles_the_batch_left_over(cluster):
    """The first coordinator publishes the first roster, then dies having taken a failure report off the
    inbox but before handling it: its successor restores the saved state and handles that batch."""
    store = _store(cluster)
    workers = ("n0-s0-i0", "n1-s0-i0", "n2-s0-i0")
    for w in workers:
        _join(store, w)
    lease, fenced = _lead(store)
    first = Coordinator(fenced, "tok", processes=3, world_size=2, events=EventLog(None))
    inbox = JournaledInbox(fenced, over=threading.Event())
    first.handle(inbox.take())
    inbox.handled(first.state())
    assert Roster.from_json(store.get(roster_key(0))).ranks == workers[:2]
    send(store, Exit(workers[0], -9, "signal 9"))
    assert len(inbox.take()) == 1 and store.check([BATCH_KEY])  # taken, then the leader dies
    store.revoke_lease(lease)

    _, successor_store = _lead(store)
    inbox = JournaledInbox(successor_store, over=threading.Event())
    successor = Coordinator(successor_store, "tok", processes=3, world_size=2, events=EventLog(None))
    successor.restore(inbox.predecessor_state())
    assert successor.gen == 0 and list(successor.spares) == [workers[2]]
    successor.handle(inbox.take())
    inbox.handled(successor.state())
    assert Roster.from_json(store.get(roster_key(1))).ranks == (workers[2], workers[1])
    assert json.loads(store.get(f"assign/{workers[2]}")) == {"gen": 1, "rank": 0}
    assert not store.check([BATCH_KEY])


@pytest.mark.timeout(360)
def test_losing_the_coordinating_node_during_a_recovery_moves_the_coordinator_and_its_rank(tmp_path, reference):
    """Six nodes of one slot: ranks 0-3 on nodes 0-3, spares on nodes 4 and 5; node 0's agent coordinates.
    Rank 2 is killed; while the others recover from it, node 0 dies whole (its agent and rank 0's worker,
    so nobody reports that exit). Another agent takes over, finishes the recovery and replaces rank 0."""
    train = ("--devices", "1", "--num-nodes", "4", "--max-steps", str(STEPS))
    with EtcdCluster(tmp_path / "etcd") as etcd:
        job = start(tmp_path / "job", nproc=1, spares=2, nnodes=6, faults="kill@rank=2,step=6,phase=backward",
                    train_args=(*train, "--sleep-per-step", "0.2"),
                    launch_args=("--heartbeat-timeout", "3", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                                 ",".join(etcd.endpoints), "--rdzv-id", "failover"), node_0_first="coordinator_elected")
        try:
            job.wait_until(lambda: job.events("failure_detected"), "rank 2's loss to be handled")
            assert [e["node"] for e in job.events("coordinator_elected")] == [0]
            job.kill_node(0)
            job.full_speed()
            codes = job.wait()
        finally:
            job.kill()
    assert codes[0] == -signal.SIGKILL  # the lost node's agent; the others end the job normally
    assert_bit_exact(job, codes[1:], reference(4, ("--devices", "1", "--num-nodes", "4")), world=4,
                     killed_from_outside=(0,))
    elected = job.events("coordinator_elected")
    assert elected[0]["node"] == 0 and elected[1]["node"] != 0 and elected[1]["took_over"], elected
    assert [e["node"] for e in job.events("node_lost")] == [0]
    assert sorted(e["rank"] for e in job.events("failure_detected")) == [0, 2]
