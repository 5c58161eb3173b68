"""The job's store on a real 3-member etcd cluster (127.0.0.1): TCPStore's semantics, process groups that
rendezvous through it, what losing members does (one: nothing; two: waits for a quorum), and a job that
runs on it through a kill."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import STEPS, assert_bit_exact
from jobs import start

from torchpass_plugins.control.etcd_gateway import PASSWORD_VARIABLE, Gateway, address
from torchpass_plugins.control.etcd_store import EtcdStore, open_address
from torchpass_plugins.testing.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path):
    with EtcdCluster(tmp_path) as members:
        yield members


def test_it_keeps_the_semantics_of_torchs_tcpstore(cluster):
    store = EtcdStore(cluster.endpoints, prefix="job1", timeout=timedelta(seconds=10))
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n") == b"5"
    assert store.compare_set("c", "x", "y") == b"x"  # absent, something else expected: unchanged
    assert not store.check(["c"])
    assert store.compare_set("c", "", "first") == b"first"  # absent, absence expected: set
    assert store.compare_set("c", "other", "second") == b"first"  # a mismatch returns what is there
    assert store.compare_set("c", "first", "second") == b"second"
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["never"], timedelta(seconds=0.3))
    late = threading.Timer(0.3, store.set, args=("late", b"v"))
    late.start()
    assert store.get("late") == b"v"  # get waits for the key, as TCPStore's does
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == 3  # n, c, late
    assert EtcdStore(cluster.endpoints, prefix="job2").num_keys() == 0  # another job's keys are apart
    for item in (b"m1", b"m2", b"m3"):
        store.queue_push("inbox", item)
    assert store.queue_len("inbox") == 3
    assert [store.queue_pop("inbox", block=False) for _ in range(3)] == [b"m1", b"m2", b"m3"]
    with pytest.raises(dist.DistStoreError, match="empty"):
        store.queue_pop("inbox", block=False)
    assert store.add("read-only", 0) == 0 and not store.check(["read-only"])  # adding 0 reads, writes nothing
    store.wait(["n"], timedelta(0))  # zero: no limit, as c10d's stores
    prefixed = dist.PrefixStore("pg", store)  # torch's own wrapper calls into it
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v" and store.get("pg/k") == b"v"


def test_a_wait_is_pushed_not_polled_outlives_the_member_it_listens_to_and_wakes_sets_in_batches(cluster, monkeypatch):
    store = EtcdStore(cluster.endpoints, prefix="job", timeout=timedelta(seconds=60))
    requests = []

    def counted(name):
        method = getattr(Gateway, name)
        return lambda self, *args, **kwargs: (requests.append(name), method(self, *args, **kwargs))[1]

    for name in ("call", "watch_for_put"):  # every request the store makes goes through one of these
        monkeypatch.setattr(Gateway, name, counted(name))
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["missing"], timedelta(seconds=2))
    assert len(requests) <= 3, requests  # a look, a watch and a last look: no polling
    writer = EtcdStore(cluster.endpoints[1:], prefix="job", timeout=timedelta(seconds=60))
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (store.wait(["roster"], timedelta(seconds=50)), woke.set()), daemon=True)
    waiter.start()
    time.sleep(1.0)
    cluster.stop_member(0)  # the member the wait listens to goes away; the put is made through another one
    writer.set("roster", b"1")
    assert woke.wait(30.0)
    keys = [f"watch/w{i}/1" for i in range(300)]  # more than one transaction's worth
    writer.multi_set(keys, [b"1"] * len(keys))
    assert writer.check(keys)


def _all_reduce(rank: int, endpoints: list[str], out) -> None:
    etcd = EtcdStore(endpoints, prefix="job", timeout=timedelta(seconds=30))  # referenced: see EtcdStore
    group = dist.ProcessGroupGloo(dist.PrefixStore("gen0", etcd), rank, 2, timedelta(seconds=30))
    t = torch.tensor([rank + 1.0])
    group.allreduce([t]).wait()
    out[rank] = t.item()


def test_gloo_process_groups_rendezvous_through_it(cluster):
    out = mp.Manager().dict()
    mp.start_processes(_all_reduce, args=(cluster.endpoints, out), nprocs=2, start_method="spawn", join=True)
    assert dict(out) == {0: 3.0, 1: 3.0}


def test_one_member_lost_changes_nothing_and_two_make_it_wait_for_a_quorum(cluster):
    store = EtcdStore(cluster.endpoints, prefix="job", timeout=timedelta(seconds=60))
    store.set("before", b"1")
    cluster.stop_member(0)  # the endpoint tried first
    store.set("one-down", b"2")
    assert store.add("n", 1) == 1 and store.get("before") == b"1"
    cluster.stop_member(1)  # one of three left: no quorum, so no write is decided
    done = threading.Event()
    writer = threading.Thread(target=lambda: (store.set("two-down", b"3"), done.set()), daemon=True)
    writer.start()
    time.sleep(3.0)
    assert not done.is_set()
    cluster.start_member(1)  # a quorum again: the write that waited goes through
    assert done.wait(45.0)
    assert store.get("two-down") == b"3" and store.add("n", 1) == 2


@pytest.mark.timeout(240)
def test_a_job_on_etcd_replaces_a_killed_rank_bit_exact_shrugs_off_a_lost_member_and_waits_out_a_lost_quorum(
        tmp_path, reference):
    """One member of three lost: nothing happens. Two lost for twice the heartbeat timeout: training goes on,
    decisions wait, and nobody is written off for the silence; the job ends bit-exact once one is back."""
    with EtcdCluster(tmp_path / "etcd") as etcd:
        train = ("--devices", "3", "--max-steps", str(STEPS), "--sleep-per-step", "0.3")
        job = start(tmp_path / "job", train_args=train, faults="kill@rank=0,step=8,phase=backward",
                    launch_args=("--rdzv-backend", "etcd", "--rdzv-endpoint", ",".join(etcd.endpoints),
                                 "--rdzv-id", "job-a", "--heartbeat-timeout", "3"))
        try:
            job.wait_until(lambda: len(job.applied(1)) >= 3, "rank 1 to reach step 3")
            etcd.stop_member(0)  # one member of three: no effect
            job.wait_until(lambda: len(job.applied(1)) >= 11, "rank 1 past the recovery")
            etcd.stop_member(1)  # no quorum
            time.sleep(6.0)
            etcd.start_member(1)
            job.full_speed()
            codes = job.wait()
        finally:
            job.kill()
    assert_bit_exact(job, codes, reference())
    [started] = job.events("agent_started")
    assert started["endpoint"] == f"etcd://{','.join(etcd.endpoints)}/job-a"
    assert len(job.events("failure_detected")) == 1 and job.events("job_restart") == []
    assert job.events("hang_detected") == [] and job.events("worker_evicted") == []


def test_tls_and_an_etcd_user_are_passed_through_and_refusals_are_clear(tmp_path, monkeypatch):
    """Members that serve https only, to clients with a certificate of their CA; then members with auth
    enabled: the job's store connects with the files and user given (the password from the environment);
    without them it fails, naming the unreachable members or etcd's refusal."""
    members = ",".join
    with EtcdCluster(tmp_path / "certs", tls=True) as etcd:
        store = open_address(address(members(etcd.endpoints), "job-tls", etcd.credentials), timedelta(seconds=10))
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.clone().add("n", 2) == 2
        with pytest.raises(dist.DistStoreError, match="no member answered"):
            open_address(address(members(etcd.endpoints), "job-tls"), timedelta(seconds=2))
    with EtcdCluster(tmp_path / "auth", tls=True, client_certs=False) as etcd:
        admin = EtcdStore(etcd.endpoints, timeout=timedelta(seconds=10), credentials=etcd.credentials)
        for path, body in (("/v3/auth/user/add", {"name": "root", "password": "s3cret"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}), ("/v3/auth/enable", {})):
            admin._call(path, body)
        user = dataclasses.replace(etcd.credentials, cert="", key="", user="root")
        where = address(members(etcd.endpoints), "job-auth", user)
        monkeypatch.setenv(PASSWORD_VARIABLE, "s3cret")
        store = open_address(where, timedelta(seconds=10))
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.clone().add("n", 2) == 2
        with pytest.raises(dist.DistStoreError, match="refused /v3/kv/range"):
            open_address(address(members(etcd.endpoints), "job-auth", dataclasses.replace(user, user="")),
                         timedelta(seconds=5))
        monkeypatch.setenv(PASSWORD_VARIABLE, "wrong")
        with pytest.raises(dist.DistStoreError, match="refused /v3/auth/authenticate"):
            open_address(where, timedelta(seconds=5))
