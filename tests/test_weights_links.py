"""Weights published across a real network link that fails: two hosts as network namespaces on one bridge
(``torchpass_plugins.testing.netns``), the publisher on one, a subscriber on the other, the link rate-limited
so that a version is always on its way (the subscriber receives bytes, although one kernel runs both "hosts"
and it could map the publisher's copies). A 3-second flap is ridden out on the same connection; a cut longer
than the subscriber's ``stall_s`` drops the version on its way, and the subscriber connects again once the
link is back. Every version it takes is whole, and the publisher goes on meanwhile."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from scripts.weights_follower import digest

from torchpass_plugins.testing.netns import Hosts

FOLLOWER = Path(__file__).parent / "scripts" / "weights_follower.py"
VERSIONS, ELEMENTS = 110, 4 << 20  # 16 MiB a version
PUBLISHER = textwrap.dedent("""
    import os, sys, time, torch
    from torchpass_plugins.observe.events import EventLog
    from torchpass_plugins.weights import WeightPublisher
    publisher = WeightPublisher(sys.argv[1], events=EventLog(sys.argv[2], source="publisher"))
    open(sys.argv[5] + ".listening", "w").close()  # the follower may start
    while not os.path.exists(sys.argv[5]):  # the follower's output: it is about to subscribe
        time.sleep(0.05)
    state = {"w": torch.zeros(int(sys.argv[4]))}
    for version in range(int(sys.argv[3])):
        state["w"].fill_(version)  # every byte of a version says which one it is
        publisher.publish(state, version, wait=version == int(sys.argv[3]) - 1)
        time.sleep(0.3)
    time.sleep(120)  # serving the last version until the test ends
""")


def _events(path: Path, name: str) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == name]


def _publisher(hosts: Hosts, endpoint: str, events: Path, received: Path, env: dict) -> subprocess.Popen:
    """The publisher on host 0, listening when this returns (a subscriber's first attempt finds it there, so
    that the address it starts on is the one it is served on); it publishes once the follower is up."""
    proc = hosts.popen(0, [sys.executable, "-c", PUBLISHER, endpoint, str(events), str(VERSIONS), str(ELEMENTS),
                           str(received)], env=env)
    deadline = time.monotonic() + 60
    while not Path(f"{received}.listening").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the publisher did not start"
        time.sleep(0.05)
    return proc


@contextlib.contextmanager
def _killed_at_exit():
    """A list for the test's processes, each killed (and reaped) when the block ends, however it ends."""
    processes: list[subprocess.Popen] = []
    try:
        yield processes
    finally:
        for proc in processes:
            proc.kill()
            proc.wait()


def _whole_versions(received: Path) -> list[int]:
    """The versions the follower received, in order, up to the last; each whole: every byte of the version it
    claims to be."""
    lines = [line.split() for line in received.read_text().splitlines()]
    versions = [int(version) for version, _ in lines]
    assert versions == sorted(set(versions)) and versions[-1] == VERSIONS - 1
    for version, got in lines:
        assert got == digest({"w": torch.full((ELEMENTS,), float(version))}), f"version {version} is torn"
    return versions


@pytest.mark.timeout(180)
def test_a_subscriber_rides_out_a_flap_and_reconnects_after_a_cut_and_every_version_is_whole(tmp_path):
    env = {**os.environ, "TORCHPASS_WEIGHTS_TOKEN": "a-token"}
    received, events = tmp_path / "received.txt", tmp_path / "events.jsonl"
    with Hosts(2) as hosts:
        endpoint = f"tcp://{hosts.address(0)}:29600"
        hosts.qdisc(1, "tbf", "rate", "300mbit", "burst", "64kb", "latency", "400ms")  # about 0.5 s a version
        with _killed_at_exit() as processes:
            processes.append(_publisher(hosts, endpoint, events, received, env))
            follower = hosts.popen(1, [sys.executable, str(FOLLOWER), endpoint, str(received), "--final",
                                       str(VERSIONS - 1), "--patience", "60", "--events", str(events), "--tcp"],
                                      env=env)  # (the namespaces share a kernel: it could map the copies)
            processes.append(follower)

            def received_after(seconds: float) -> int:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    lines = received.read_text().splitlines() if received.exists() else []
                    if lines:
                        return int(lines[-1].split()[0])
                    time.sleep(0.1)
                raise AssertionError("the subscriber received nothing")

            first = received_after(60)
            hosts.link(1, up=False)  # a flap: 3 s
            time.sleep(3)
            hosts.link(1, up=True)
            time.sleep(4)
            flapped = time.time()
            hosts.link(1, up=False)  # a cut: 15 s, longer than the subscriber's stall_s (10 s)
            time.sleep(15)
            hosts.link(1, up=True)
            restored = time.time()
            assert follower.wait(timeout=120) == 0
    versions = _whole_versions(received)
    assert versions[0] <= first
    received_at = {e["version"]: e["time"] for e in _events(events, "weights_received")}
    assert {e["path"] for e in _events(events, "weights_received")} == {"tcp"}
    assert any(t > restored for t in received_at.values())  # it went on after the cut
    lost = [e["time"] for e in _events(events, "weights_connection_lost")]
    assert lost and min(lost) > flapped  # the flap cost no connection; the cut did
    # The publisher went on: the send stuck on the cut link holds one copy, so at most a publication that
    # found no free copy was skipped (never waited for), and only then.
    skipped = _events(events, "weights_skipped")
    assert len(_events(events, "weights_published")) + len(skipped) == VERSIONS
    assert all(e["time"] > flapped for e in skipped) and len(skipped) <= VERSIONS // 10


@pytest.mark.timeout(180)
def test_a_subscriber_given_the_publishers_address_on_two_paths_takes_the_other_when_one_is_cut(tmp_path):
    env = {**os.environ, "TORCHPASS_WEIGHTS_TOKEN": "a-token"}
    received, events = tmp_path / "received.txt", tmp_path / "events.jsonl"
    with Hosts(2, paths=2) as hosts:
        endpoints = f"tcp://{hosts.address(0, path=1)}:29600,tcp://{hosts.address(0, path=0)}:29600"
        hosts.qdisc(1, "tbf", "rate", "300mbit", "burst", "64kb", "latency", "400ms", path=1)  # a version in flight
        with _killed_at_exit() as processes:
            processes.append(_publisher(hosts, "tcp://0.0.0.0:29600", events, received, env))
            follower = hosts.popen(1, [sys.executable, str(FOLLOWER), endpoints, str(received), "--final",
                                       str(VERSIONS - 1), "--patience", "60", "--events", str(events), "--tcp"],
                                   env=env)
            processes.append(follower)
            deadline = time.monotonic() + 60
            while not (received.exists() and received.read_text().strip()):
                assert time.monotonic() < deadline, "the subscriber received nothing"
                time.sleep(0.1)
            hosts.link(1, up=False, path=1)  # for good
            cut = time.time()
            assert follower.wait(timeout=120) == 0
    _whole_versions(received)
    rerouted = _events(events, "weights_rerouted")
    assert [(e["from"], e["to"]) for e in rerouted] == [(f"{hosts.address(0, path=1)}:29600",
                                                          f"{hosts.address(0, path=0)}:29600")], rerouted
    assert sum(e["time"] > cut for e in _events(events, "weights_received")) > 1  # it went on over the other path
