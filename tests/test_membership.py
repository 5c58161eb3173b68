"""Coordinator decisions and the escapable transport, on a real TCPStore and real gloo groups."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch

from torchpass_plugins.control.coordinator import Coordinator
from torchpass_plugins.control.membership import Member, connect_store, prefixed
from torchpass_plugins.control.policy import Policy
from torchpass_plugins.control.protocol import (
    ABORT_KEY,
    DONE_KEY,
    DRAIN_KEY,
    RESTART_KEY,
    TRAINED_KEY,
    Exit,
    Join,
    Roster,
    Stalled,
    assign_key,
    borrow_key,
    borrowed_key,
    evict_key,
    join_key,
    roster_key,
    send,
    watch_key,
)
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.observe.events import EventLog, read_events


@pytest.fixture
def store():
    master = connect_store("127.0.0.1:0", is_master=True, timeout=30)
    return master, prefixed(master)


def _join(store, worker: str, token: str = "tok") -> None:
    store.set(join_key(worker), token)
    send(store, Join(worker))


def _exit(store, worker: str, code: int) -> None:
    send(store, Exit(worker, code, f"code {code}"))


def _assignment(store, worker: str) -> dict:
    return json.loads(store.get(assign_key(worker)))


def test_coordinator_replaces_lost_ranks_then_aborts_when_no_spare_is_left(store, tmp_path):
    _, s = store
    c = Coordinator(s, "tok", processes=3, world_size=2, events=EventLog(tmp_path / "events.jsonl"))
    for w in ("n0-s2-i0", "n0-s0-i0", "n0-s1-i0"):
        _join(s, w)
    c.poll()
    assert Roster.from_json(s.get(roster_key(0))).ranks == ("n0-s0-i0", "n0-s1-i0")
    assert _assignment(s, "n0-s1-i0") == {"gen": 0, "rank": 1}
    assert not s.check([assign_key("n0-s2-i0")])  # the spare waits

    _exit(s, "n0-s1-i0", -9)
    c.poll()
    assert Roster.from_json(s.get(roster_key(1))).ranks == ("n0-s0-i0", "n0-s2-i0")
    assert s.check([watch_key("n0-s0-i0", 1), watch_key("n0-s1-i0", 1)])  # survivors' watches woken
    assert _assignment(s, "n0-s2-i0") == {"gen": 1, "rank": 1}

    _exit(s, "n0-s0-i0", -9)
    c.poll()
    message = s.get(ABORT_KEY).decode()
    assert "0 spare(s) left" in message and "--spares" in message
    assert Roster.from_json(s.get(roster_key(2))).abort == message
    assert [e["event"] for e in read_events(tmp_path)].count("failure_detected") == 2


def test_after_a_failure_a_worker_reads_what_changed_not_the_whole_roster(store, tmp_path):
    """The change names the replaced rank only, whatever the world size; a worker that holds the roster
    before rebuilds the new one from it, equal to the published one, without reading it whole."""
    master, s = store
    workers = [f"n0-s{i}-i0" for i in range(10)]
    c = Coordinator(s, "tok", processes=10, world_size=8, events=EventLog(None))
    for w in workers:
        _join(s, w)
    c.poll()
    env = WorkerEnv(store=f"127.0.0.1:{master.port}", token="tok", worker_id=workers[0], world_size=8, node_rank=0,
                    local_slot=0, run_dir="", seed=0, heartbeat_interval=0.5)
    member = Member(env)
    try:
        assert member.roster(0).ranks == tuple(workers[:8])
        for gen, lost in ((1, 5), (2, 2)):
            _exit(s, c.ranks[lost], -9)
            c.poll()
            change = member.change(gen)
            assert change.changed == {lost: c.ranks[lost]} and change.abort is None
            published = s.get(roster_key(gen))
            s.set(roster_key(gen), Roster(gen, ("not-read",) * 8).to_json())  # a whole read would show
            assert member.roster(gen) == Roster.from_json(published)
        _exit(s, c.ranks[0], -9)
        c.poll()
        assert member.change(3).abort and member.roster(3).abort  # no spare left: the change says so
    finally:
        member.close()


def test_coordinator_rejects_a_wrong_token_and_releases_spares_at_the_end(store, tmp_path):
    _, s = store
    c = Coordinator(s, "tok", processes=2, world_size=1, events=EventLog(None))
    _join(s, "n0-s9-i0", token="guess")
    _join(s, "n0-s0-i0")
    _join(s, "n0-s1-i0")
    c.poll()
    assert "reject" in _assignment(s, "n0-s9-i0")
    assert _assignment(s, "n0-s0-i0") == {"gen": 0, "rank": 0}
    _exit(s, "n0-s0-i0", 0)
    c.poll()
    assert s.get(DONE_KEY) == b"done"
    assert _assignment(s, "n0-s1-i0") == {"exit": "done"}


def test_a_worker_that_joins_after_the_job_ended_is_told_to_exit(store, tmp_path):
    # A refill started just before the end registers after the coordinator released the spares it knew.
    master, s = store
    c = Coordinator(s, "tok", processes=1, world_size=1, events=EventLog(None))
    _join(s, "n0-s0-i0")
    c.poll()
    _exit(s, "n0-s0-i0", 0)
    c.poll()
    env = WorkerEnv(store=f"127.0.0.1:{master.port}", token="tok", worker_id="n0-s0-i1", world_size=1, node_rank=0,
                    local_slot=0, run_dir="", seed=0, heartbeat_interval=0.5)
    late = Member(env)
    try:
        late.join()
        assert late.wait_assignment() == {"exit": "done"}
    finally:
        late.close()


def test_when_every_rank_timed_out_no_one_is_blamed_and_the_job_restarts(store, tmp_path):
    # A stalled rank is one that did not time out with the others; if all did, none is evicted.
    master, s = store
    c = Coordinator(s, "tok", processes=2, world_size=2, events=EventLog(None), policy=Policy(restarts_left=1),
                    timer_store=prefixed(master.clone()))
    for w in ("n0-s0-i0", "n0-s1-i0"):
        _join(s, w)
    c.poll()
    for w in ("n0-s0-i0", "n0-s1-i0"):
        send(s, Stalled(w, gen=0, grace_s=0.05, why="timed out"))
    c.poll()
    _poll_until(c, s, RESTART_KEY)  # the verdict arrives through the inbox once the grace has passed
    assert "every rank's collective timed out in generation 0" in s.get(RESTART_KEY).decode()
    assert not s.check([evict_key("n0-s0-i0")]) and not s.check([evict_key("n0-s1-i0")])


def _poll_until(c: Coordinator, store, key: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.05)
        c.poll()


def test_more_ranks_lost_than_spares_wait_for_refilled_workers_then_all_are_replaced(store, tmp_path):
    master, s = store
    c = Coordinator(s, "tok", processes=4, world_size=3, events=EventLog(tmp_path / "events.jsonl"),
                    policy=Policy(restarts_left=1, spare_wait_s=30), timer_store=prefixed(master.clone()))
    for w in ("n0-s0-i0", "n0-s1-i0", "n0-s2-i0", "n0-s3-i0"):
        _join(s, w)
    c.poll()
    _exit(s, "n0-s0-i0", -9)
    _exit(s, "n0-s2-i0", -9)
    c.poll()
    assert not s.check([roster_key(1), RESTART_KEY])  # one spare for two ranks: no roster yet, no restart
    [awaited] = [e for e in read_events(tmp_path) if e["event"] == "spare_awaited"]
    assert awaited["ranks"] == [0, 2] and awaited["spares"] == 1
    _exit(s, "n0-s0-i0", -9)  # reported twice (its agent, and a stall verdict): still one loss
    _join(s, "n0-s0-i1")  # the refilled slot
    c.poll()
    assert Roster.from_json(s.get(roster_key(1))).ranks == ("n0-s3-i0", "n0-s1-i0", "n0-s0-i1")
    assert not s.check([RESTART_KEY])


def test_when_no_refilled_worker_joins_in_time_the_job_restarts(store, tmp_path):
    master, s = store
    c = Coordinator(s, "tok", processes=3, world_size=2, events=EventLog(None),
                    policy=Policy(restarts_left=1, spare_wait_s=0.2), timer_store=prefixed(master.clone()))
    for w in ("n0-s0-i0", "n0-s1-i0", "n0-s2-i0"):
        _join(s, w)
    c.poll()
    _exit(s, "n0-s0-i0", -9)
    _exit(s, "n0-s1-i0", -9)
    c.poll()
    _poll_until(c, s, RESTART_KEY)
    message = s.get(RESTART_KEY).decode()
    assert "2 worker(s) lost" in message and "none joined within 0.2 s" in message


def test_a_worker_lost_after_training_completed_is_not_replaced(store, tmp_path):
    # Its peers passed the barrier ending fit with it: a spare would wait for peers that are leaving.
    _, s = store
    c = Coordinator(s, "tok", processes=3, world_size=2, events=EventLog(None), policy=Policy(restarts_left=3))
    for w in ("n0-s0-i0", "n0-s1-i0", "n0-s2-i0"):
        _join(s, w)
    c.poll()
    s.set(TRAINED_KEY, "20")
    _exit(s, "n0-s1-i0", -6)
    c.poll()
    message = s.get(ABORT_KEY).decode()
    assert "after training had completed on every rank" in message and "not restarted" in message
    assert not s.check([assign_key("n0-s2-i0")]) or "exit" in _assignment(s, "n0-s2-i0")  # never promoted


def test_a_blocked_collective_escapes_when_a_newer_roster_appears(store):
    master, s = store
    endpoint = f"127.0.0.1:{master.port}"
    members = []
    for rank in (0, 1):
        env = WorkerEnv(store=endpoint, token="tok", worker_id=f"n0-s{rank}-i0", world_size=2, node_rank=0,
                        local_slot=rank, run_dir="", seed=0, heartbeat_interval=0.5)
        members.append(Member(env))
    transports = [ReconfigurableGroup(m, timedelta(seconds=60)) for m in members]
    threads = [threading.Thread(target=t.configure, args=(0, r)) for r, t in enumerate(transports)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    members[0].watch_from(0)

    def publish_later() -> None:
        time.sleep(0.5)
        s.set(roster_key(1), Roster(1, ("n0-s0-i0", "n0-s2-i0")).to_json())
        s.set(watch_key("n0-s0-i0", 1), b"1")  # as the coordinator does

    threading.Thread(target=publish_later).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="generation 1 replaced 0"):
        transports[0].all_reduce(torch.ones(4))  # rank 1 never joins this collective
    assert time.monotonic() - t0 < 5  # the group's own timeout is 60 s
    transports[1].all_reduce(torch.ones(4))  # lets the abandoned operation finish
    assert transports[0].drain(timeout=10)
    for m in members:
        m.close()


def test_a_job_with_no_spare_asks_its_node_to_borrow_and_gives_the_device_back_once_its_own_spare_joins(store,
                                                                                                        tmp_path):
    _, s = store
    c = Coordinator(s, "tok", processes=2, world_size=2, events=EventLog(tmp_path / "events.jsonl"),
                    policy=Policy(refill=False, borrow=True, borrow_wait_s=50.0))
    for w in ("n0-s0-i0", "n1-s0-i0"):
        _join(s, w)
    c.poll()
    _exit(s, "n1-s0-i0", -9)
    c.poll()
    assert s.add(borrow_key(1), 0) == 1 and s.add(borrow_key(0), 0) == 0  # on the lost worker's node
    s.set(borrowed_key("n1-s9-i0"), "3")
    _join(s, "n1-s9-i0")  # the worker on the borrowed device takes the rank
    c.poll()
    assert c.ranks == ["n0-s0-i0", "n1-s9-i0"]
    _join(s, "n1-s0-i1")  # the node's own slot, refilled: the rank moves back, the device goes back
    c.poll()
    assert json.loads(s.get(DRAIN_KEY))["worker"] == "n1-s9-i0" and c.moving.spare == "n1-s0-i1"
    s.set(borrowed_key("n1-s8-i0"), "2")
    _join(s, "n1-s8-i0")  # a borrowed worker no rank needs leaves at once
    c.poll()
    assert _assignment(s, "n1-s8-i0") == {"exit": "retired: no rank needs the borrowed device: it goes back"}
