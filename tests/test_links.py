"""Link failures: a path that fails is left for another, no worker replaced and no state moved.

The decisions run in-process (what the probes make of answers, the policy, the coordinator's roster). The
jobs run on real network faults: three "hosts" as network namespaces, each with two links (``eth1``, the
path the job prefers, and ``eth0``, which also carries the store), one bridge per path
(``torchpass_plugins.testing.netns``); a link is pulled at the switch while the job trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import STEPS, assert_bit_exact
from jobs import start

from torchpass_plugins.control.coordinator import Coordinator
from torchpass_plugins.control.links import PathTable, slow_paths
from torchpass_plugins.control.membership import connect_store, prefixed
from torchpass_plugins.control.policy import Action, Policy
from torchpass_plugins.control.protocol import (
    ABORT_KEY,
    Exit,
    Join,
    LinkDown,
    Roster,
    assign_key,
    join_key,
    node_paths_key,
    roster_key,
    send,
)
from torchpass_plugins.observe.events import EventLog, read_events
from torchpass_plugins.testing.netns import Hosts

# -- what the probes make of the answers -----------------------------------------------------------------


def test_a_path_silent_while_another_answers_failed_and_is_reported_once_after_the_grace():
    table = PathTable(paths=2, down_after_s=1.0, grace_s=3.0)
    for t in range(3):  # node 1 answers on both paths until t=2, then on path 1 only
        table.answered(1, 0, t)
        table.answered(1, 1, t)
    assert table.review(2.5) == []
    table.answered(1, 1, 3.5)
    assert table.review(3.5) == [("failed", 1, 0, 0.0)]
    table.answered(1, 1, 4.9)
    assert table.review(4.9) == []  # within the grace: a flap, perhaps
    table.answered(1, 1, 5.2)
    assert table.review(5.2) == [("report", 1, 0, 3.2)]
    table.answered(1, 1, 6.0)
    assert table.review(6.0) == []  # reported once


def test_a_path_back_within_the_grace_is_a_flap_and_never_reported():
    table = PathTable(paths=2, down_after_s=1.0, grace_s=5.0)
    table.answered(1, 0, 0.0)
    table.answered(1, 1, 1.5)
    assert table.review(1.5) == [("failed", 1, 0, 0.0)]
    table.answered(1, 0, 3.0)
    table.answered(1, 1, 3.0)
    assert table.review(3.0) == [("recovered", 1, 0, 3.0)]
    table.answered(1, 1, 9.0)
    assert table.review(9.0) == [("failed", 1, 0, 0.0)]  # a new failure, judged afresh


def test_a_path_that_keeps_flapping_is_reported_at_its_third_flap_once():
    table = PathTable(paths=2, down_after_s=1.0, grace_s=5.0, flaps=3)
    reports = []
    for flap in range(4):  # silent for 3.5 s (within the grace), then back, four times; path 1 answers throughout
        t0 = 4.0 * flap
        table.answered(1, 0, t0)
        for t in (t0, t0 + 1.5, t0 + 3.5):
            table.answered(1, 1, t)
            if t == t0 + 3.5:
                table.answered(1, 0, t)
            reports += [c for c in table.review(t) if c[0] == "report"]
    assert reports == [("report", 1, 0, 3.5)]  # silent since its last answer, 3.5 s before


def test_a_path_that_never_answered_is_judged_like_one_that_stopped():
    """A blocked port or a wrong subnet: known from the peer's addresses, never heard on."""
    table = PathTable(paths=2, down_after_s=1.0, grace_s=2.0)
    table.expect(1, 0.0)
    for t in (0.5, 1.5, 3.2):
        table.answered(1, 1, t)
    assert table.review(1.5) == [("failed", 1, 0, 0.0)]
    assert table.review(3.2) == [("report", 1, 0, 3.2)]


def test_an_outage_longer_than_the_grace_is_no_flap():
    table = PathTable(paths=2, down_after_s=1.0, grace_s=2.0, flaps=1)
    table.answered(1, 0, 0.0)
    table.answered(1, 1, 9.0)
    assert [c[0] for c in table.review(9.0)] == ["failed"]
    table.answered(1, 0, 10.0)
    assert [c[0] for c in table.review(10.0)] == ["recovered"]  # down 10 s: an outage, not a flap to count


def test_a_node_silent_on_every_path_is_no_link_failure():
    """Its agent (or the whole node) is gone, or all its links: the heartbeats find that, not the probes."""
    table = PathTable(paths=2, down_after_s=1.0, grace_s=1.0)
    table.answered(1, 0, 0.0)
    table.answered(1, 1, 0.0)
    assert table.review(10.0) == []


def test_a_path_far_slower_than_the_other_paths_to_the_same_node_is_degraded():
    assert slow_paths({(1, 0): 0.2, (1, 1): 0.0004, (2, 0): 0.001, (2, 1): 0.0009}) == {(1, 0): 0.0004}
    assert slow_paths({(1, 0): 0.2, (1, 1): 0.19}) == {}  # every path to node 1 alike: it answers late


# -- the policy and the coordinator ------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "current", "failed", "expected"), [
    (0, 0, set(), (Action.REROUTE, 1)),
    (1, 1, {0, 2}, (Action.NOTHING, None)),  # every path failed: a node's loss, if it is one, is the heartbeats'
    (1, 0, set(), (Action.NOTHING, None)),  # a path the job no longer uses
    (1, 1, set(), (Action.REROUTE, 2)),
    (2, 2, {0}, (Action.REROUTE, 1)),  # wraps around, past the failed ones
])
def test_the_policy_moves_the_job_to_the_next_path_not_failed_yet(path, current, failed, expected):
    decision = Policy(paths=3).link_down(path, current, failed)
    assert (decision.action, decision.path) == expected


@pytest.mark.parametrize(("paths", "started", "expected"), [
    (2, False, Action.NOTHING), (2, True, Action.NOTHING),
    (1, False, Action.ABORT),  # before the job starts: it stops, naming the node
    (3, True, Action.REFUSE),  # a later spare of a node with other paths: refused, the job goes on
])
def test_every_node_needs_as_many_paths_as_the_coordinating_one(paths, started, expected):
    decision = Policy(paths=2).node_paths(1, paths, started=started)
    assert decision.action is expected
    if expected is not Action.NOTHING:
        assert decision.why == (f"node 1 has {paths} network path(s) (--interfaces), the coordinating node has 2: "
                                "give every node the same interfaces, in the same order")


def test_a_node_with_other_paths_stops_the_job_before_it_starts_and_a_later_one_is_refused(tmp_path):
    store = prefixed(connect_store("127.0.0.1:0", is_master=True, timeout=30))
    coordinator = Coordinator(store, "t", processes=2, world_size=2, events=EventLog(tmp_path / "events.jsonl"),
                              policy=Policy(paths=2))
    for node, paths in ((0, 2), (1, 1)):
        store.set(node_paths_key(node), str(paths))
    for worker in ("n0-s0-i0", "n1-s0-i0"):
        store.set(join_key(worker), "t")
        send(store, Join(worker))
    coordinator.poll()
    assert "node 1 has 1 network path(s)" in store.get(ABORT_KEY).decode()
    assert [e["gen"] for e in read_events(tmp_path) if e["event"] == "roster_published"] == []

    store, coordinator = _coordinator_at_generation_0(tmp_path / "later", ("n0-s0-i0", "n1-s0-i0"))
    store.set(node_paths_key(2), "3")
    store.set(join_key("n2-s0-i0"), "t")
    send(store, Join("n2-s0-i0"))
    coordinator.poll()
    assert "node 2 has 3 network path(s)" in json.loads(store.get(assign_key("n2-s0-i0")))["reject"]
    assert list(coordinator.spares) == [] and not store.check([ABORT_KEY])


def _coordinator_at_generation_0(tmp_path, workers: tuple[str, ...]):
    """A coordinator of 2 ranks on 2 paths over a real store, every worker joined (the rest are spares)."""
    store = prefixed(connect_store("127.0.0.1:0", is_master=True, timeout=30))
    coordinator = Coordinator(store, "t", processes=len(workers), world_size=2,
                              events=EventLog(tmp_path / "events.jsonl"), policy=Policy(paths=2))
    for worker in workers:
        store.set(join_key(worker), "t")
        send(store, Join(worker))
    coordinator.poll()
    return store, coordinator


def test_the_coordinator_reroutes_the_same_members_once_and_every_later_roster_keeps_the_path(tmp_path):
    store, coordinator = _coordinator_at_generation_0(tmp_path, ("n0-s0-i0", "n1-s0-i0", "n2-s0-i0"))
    send(store, LinkDown(node=1, peer=0, path=0, seconds=5.0))
    send(store, LinkDown(node=0, peer=1, path=0, seconds=5.1))  # the same failure, seen from the other end
    coordinator.poll()
    roster = Roster.from_json(store.get(roster_key(1)))
    assert (roster.ranks, roster.path) == (("n0-s0-i0", "n1-s0-i0"), 1)
    assert not store.check([roster_key(2)])
    rerouted = [e for e in read_events(tmp_path) if e["event"] == "rerouted"]
    assert [(e["from"], e["to"], e["gen"]) for e in rerouted] == [(0, 1, 1)]
    assert list(coordinator.spares) == ["n2-s0-i0"]  # no spare used
    send(store, Exit("n1-s0-i0", -9))
    coordinator.poll()
    assert Roster.from_json(store.get(roster_key(2))).path == 1


def test_a_reroute_in_a_batch_that_also_lost_a_rank_waits_for_the_replacement_roster(tmp_path):
    """The same batch lost rank 1's worker: a roster of the same workers would hold a dead one."""
    store, coordinator = _coordinator_at_generation_0(tmp_path, ("n0-s0-i0", "n1-s0-i0", "n2-s0-i0"))
    send(store, Exit("n1-s0-i0", -9))
    send(store, LinkDown(node=0, peer=1, path=0, seconds=5.0))
    coordinator.poll()
    roster = Roster.from_json(store.get(roster_key(1)))
    assert (roster.ranks, roster.path) == (("n0-s0-i0", "n2-s0-i0"), 1)  # the replacement, on the new path
    assert not store.check([roster_key(2)])


def test_no_path_left_is_said_in_the_event_log(tmp_path):
    store, coordinator = _coordinator_at_generation_0(tmp_path, ("n0-s0-i0", "n1-s0-i0"))
    for path in (0, 1):
        send(store, LinkDown(node=0, peer=1, path=path, seconds=5.0))
        coordinator.poll()
    events = read_events(tmp_path)
    assert [(e["from"], e["to"]) for e in events if e["event"] == "rerouted"] == [(0, 1)]
    assert [e["path"] for e in events if e["event"] == "reroute_impossible"] == [1]


# -- jobs on real links ------------------------------------------------------------------------------------

_LAYOUT = ("--devices", "1", "--num-nodes", "2")
_TRAIN = (*_LAYOUT, "--max-steps", str(STEPS), "--sleep-per-step", "0.3")
FSDP = ("--strategy", "torchpass_fsdp")


def _job_on_two_paths(tmp_path, hosts: Hosts, grace_s: float, heartbeat_s: float = 10.0, train: tuple = (),
                      interfaces: str | None = None):
    """3 hosts x 1 slot: rank 0 on host 0 (the store), rank 1 on host 1, the spare on host 2."""
    return start(tmp_path, nproc=1, spares=1, nnodes=3, train_args=(*_TRAIN, *train), hosts=hosts,
                 launch_args=("--interfaces", interfaces or hosts.interfaces(), "--link-grace", str(grace_s),
                              "--heartbeat-timeout", str(heartbeat_s)))


def _no_worker_replaced(job) -> None:
    assert job.events("failure_detected") == [] and job.events("state_received") == []
    assert [e["promoted"] for e in job.events("roster_published")][1:] in ([], [{}])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [(), FSDP], ids=["ddp", "fsdp"])
def test_a_link_cut_for_good_is_routed_around_without_a_spare_and_the_job_is_bit_exact(tmp_path, reference, strategy):
    """Under ``torchpass_fsdp`` the ring replicas and the rank-local copies cross the cut link too."""
    with Hosts(3, paths=2) as hosts:
        job = _job_on_two_paths(tmp_path, hosts, grace_s=2.0, train=strategy)
        try:
            job.wait_until(lambda: len(job.applied(1)) >= 5, "rank 1 to train")
            hosts.link(1, up=False, path=1)  # host 1's eth1: the path every group is on
            job.full_speed()  # (the next collective waits on the cut link all the same)
            codes = job.wait()
        finally:
            job.kill()
    assert_bit_exact(job, codes, reference(2, (*_LAYOUT, *strategy)), world=2)
    rerouted = job.events("rerouted")
    assert [(e["from"], e["to"]) for e in rerouted] == [(0, 1)], rerouted
    assert {e["peer"] for e in job.events("link_failure")} | {e["node"] for e in job.events("link_failure")} >= {1}
    _no_worker_replaced(job)
    assert len(job.applied(0)) == STEPS  # every step applied once: none recomputed
    # The shared fork server's children entered the hosts' namespaces (gloo found their eth1 and eth0).
    assert [e["shared"] for e in job.events("fork_server_started")] == [True] * 3


@pytest.mark.timeout(120)
def test_a_node_given_fewer_interfaces_than_the_others_stops_the_job_before_any_step(tmp_path):
    with Hosts(2, paths=2) as hosts:
        job = start(tmp_path, nproc=1, spares=0, nnodes=2, train_args=_TRAIN, hosts=hosts,
                    launch_args=("--interfaces", hosts.interfaces()), node_args={1: ("--interfaces", "eth1")})
        try:
            codes = [agent.wait(timeout=90) for agent in job.agents]
        finally:
            job.kill()
    assert codes == [1, 1], codes
    aborted = job.events("job_aborted")
    assert [e["message"] for e in aborted] == ["node 1 has 1 network path(s) (--interfaces), the coordinating node "
                                               "has 2: give every node the same interfaces, in the same order"]
    assert job.events("roster_published") == [] and job.applied(0) == []
    assert "give every node the same interfaces" in job.logs[1].read_text()


@pytest.mark.timeout(240)
def test_a_three_second_flap_is_ridden_out_on_the_same_path_and_the_job_is_bit_exact(tmp_path, reference):
    with Hosts(3, paths=2) as hosts:
        job = _job_on_two_paths(tmp_path, hosts, grace_s=10.0)
        try:
            job.wait_until(lambda: len(job.applied(1)) >= 5, "rank 1 to train")
            hosts.link(1, up=False, path=1)
            time.sleep(3.0)
            hosts.link(1, up=True, path=1)
            job.full_speed()
            codes = job.wait()
        finally:
            job.kill()
    assert_bit_exact(job, codes, reference(2, _LAYOUT), world=2)
    assert job.events("rerouted") == []
    recovered = job.events("link_recovered")
    assert recovered and all(e["path"] == 0 and 2.0 < e["seconds"] < 10.0 for e in recovered), recovered
    _no_worker_replaced(job)
    assert job.events("roster_published")[-1]["gen"] == 0


@pytest.mark.timeout(240)
def test_a_host_cut_off_on_every_path_is_that_hosts_loss_and_a_spare_elsewhere_takes_its_rank(tmp_path, reference):
    """The job takes every interface each host has (``--interfaces all``): eth0 and eth1, in that order."""
    with Hosts(3, paths=2) as hosts:
        listed = subprocess.run(["ip", "netns", "exec", hosts.name(1), sys.executable, "-c",
                                 "from torchpass_plugins.control.links import all_interfaces; print(all_interfaces())"],
                                capture_output=True, text=True, timeout=60)
        assert listed.stdout.strip() == "('eth0', 'eth1')", listed.stdout + listed.stderr
        job = _job_on_two_paths(tmp_path, hosts, grace_s=2.0, heartbeat_s=5.0, interfaces="all")
        try:
            job.wait_until(lambda: len(job.applied(1)) >= 5, "rank 1 to train")
            hosts.link(1, up=False, path=1)
            hosts.link(1, up=False, path=0)  # the store's path too: host 1 is gone for the others
            job.full_speed()
            codes = [job.agents[node].wait(timeout=150) for node in (0, 2)]
            job.kill_node(1)  # still running, cut off
        finally:
            job.kill()
    assert_bit_exact(job, codes, reference(2, _LAYOUT), world=2,
                     killed_from_outside=(1,))
    assert job.events("rerouted") == []  # no path is to blame
    assert [e["node"] for e in job.events("node_lost")] == [1]
    assert [e["promoted"] for e in job.events("roster_published")][1:] == [{"n2-s0-i0": 1}]


@pytest.mark.timeout(240)
def test_a_slow_link_is_reported_as_degraded_and_the_job_goes_on_bit_exact(tmp_path, reference):
    with Hosts(3, paths=2) as hosts:
        # Host 1's preferred path at 256 kbit/s: the gradients queue on it, and so do the probes.
        hosts.qdisc(1, "tbf", "rate", "256kbit", "burst", "2kb", "latency", "2s", path=1)
        job = _job_on_two_paths(tmp_path, hosts, grace_s=2.0)
        job.full_speed()  # the slow link sets the pace
        try:
            codes = job.wait()
        finally:
            job.kill()
    assert_bit_exact(job, codes, reference(2, _LAYOUT), world=2)
    degraded = {(e["node"], e["peer"], e["path"]) for e in job.events("link_degraded")}
    assert degraded and all(path == 0 and 1 in (node, peer) for node, peer, path in degraded), degraded
    assert job.events("rerouted") == []
    report = subprocess.run([sys.executable, "-m", "torchpass_plugins.cli", "report", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "degraded" in report.stdout, report.stdout + report.stderr
