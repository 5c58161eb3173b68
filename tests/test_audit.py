"""``torchpass audit``: the verdicts in-process on made-up numbers; then real audits, on this machine alone (a
clean set passes, its live drill bit-exact) and on three "hosts" as network namespaces with a real fault: one
host's link shaped with ``tc`` (flagged, and only it), or one host's worker held to a sliver of a core by a
cgroup CPU quota (flagged, and only it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchpass_plugins.audit import verdict
from torchpass_plugins.audit.probes import pair_rounds
from torchpass_plugins.audit.run import judge
from torchpass_plugins.testing.netns import Hosts

# -- the verdicts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4, 7, 8])
def test_the_rounds_pair_every_two_ranks_once_and_no_rank_twice_in_a_round(world):
    rounds = pair_rounds(world)
    pairs = [pair for round_ in rounds for pair in round_]
    assert sorted(pairs) == list(combinations(range(world), 2))
    for round_ in rounds:
        ranks = [r for pair in round_ for r in pair]
        assert len(ranks) == len(set(ranks))


def test_a_device_far_slower_than_its_peers_or_throttling_more_than_they_do_is_flagged_and_only_it():
    rates = {"node 0 device 0": 100.0, "node 0 device 1": 96.0, "node 1 device 0": 50.0, "node 1 device 1": 104.0}
    drops = {"node 0 device 0": 0.30, "node 0 device 1": 0.32, "node 1 device 0": 0.31, "node 1 device 1": 0.60}
    found = verdict.compute_findings(rates, drops)
    assert [(f.check, f.part) for f in found] == [("compute", "node 1 device 0"), ("compute drop", "node 1 device 1")]
    assert found[0].expected == 100.0  # the others' median
    assert verdict.compute_findings({"node 0 device 0": 1.0}, {"node 0 device 0": 0.9}) == []  # no peers: no verdict


def test_a_slow_link_is_held_against_links_of_its_own_kind_and_blamed_on_the_node_every_bad_link_shares():
    node_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    bandwidth = {(a, b): (20.0 if node_of[a] == node_of[b] else 2.0) for a in range(6) for b in range(6) if a != b}
    bandwidth[(0, 4)] = bandwidth[(2, 4)] = 0.1  # into rank 4 (node 2) from other nodes
    latency = {(a, b): (0.05 if node_of[a] == node_of[b] else 0.4) for a, b in combinations(range(6), 2)}
    found = verdict.link_findings(bandwidth, latency, node_of)
    assert sorted(f.part for f in found) == ["link 0->4", "link 2->4"]  # the in-node links (10x faster): not flagged
    assert verdict.culprit_nodes(found, node_of, nodes=3).keys() == {2}
    latency[(1, 3)] = 9.0
    assert [f.part for f in verdict.link_findings({}, latency, node_of)] == ["link 1<->3"]
    # two nodes: a bad link between them cannot be pinned on one end
    assert verdict.culprit_nodes([verdict.Finding("bandwidth", "link 0->2", 0.1, 2.0, "")], node_of, 2).keys() == {0, 1}


def test_two_bad_nics_far_apart_blame_their_two_nodes_and_no_healthy_one():
    node_of = {rank: rank for rank in range(6)}  # one rank a node
    slow = [(a, b) for a in range(6) for b in (1, 4) if a != b]  # every link into node 1 or node 4
    found = [verdict.Finding("bandwidth", f"link {a}->{b}", 0.1, 2.0, "") for a, b in slow]
    assert verdict.culprit_nodes(found, node_of, nodes=6).keys() == {1, 4}


def test_a_part_far_worse_than_in_the_baseline_fails_and_a_lower_latency_does_not():
    before = {"compute|node 0 device 0": 100.0, "latency|link 0<->1": 1.0, "memory|node 1": 10.0}
    now = {"compute|node 0 device 0": 60.0, "latency|link 0<->1": 0.5, "memory|node 1": 9.0, "memory|node 2": 1.0}
    found = verdict.baseline_findings(now, before)
    assert [(f.part, f.value, f.expected) for f in found] == [("node 0 device 0", 60.0, 100.0)]
    assert verdict.baseline_findings({"latency|link 0<->1": 1.9}, before) == []  # sub-ms jitter: within the floor
    assert verdict.baseline_findings({"latency|link 0<->1": 3.0}, before)[0].expected == 1.0


def _result(rank: int, node: int, gflops: float = 10.0, **extra) -> dict:
    links = {str(p): {"latency_ms": 0.5, "gbps_from_peer": 1.0} for p in range(4) if p != rank}
    return {"rank": rank, "node": node, "local_rank": rank % 2, "host": f"h{node}", "compute_gflops": gflops,
            "compute_drop": 0.0, "links": links, "allreduce_busbw_gbps": 1.0,
            "health": {"available": False, "why": "no NVML"}, **({"memory_gbps": 5.0} if rank % 2 == 0 else {}),
            **extra}


def test_a_critical_health_reading_and_a_worker_that_failed_are_findings_and_a_clean_set_has_none():
    clean = [_result(r, r // 2) for r in range(4)]
    findings, figures = judge(clean, None)
    assert findings == [] and figures["compute|h1 device 1"] == 10.0 and figures["allreduce|all ranks"] == 1.0
    assert figures["memory|h1"] == 5.0 and figures["bandwidth|h0 device 0 -> h1 device 1"] == 1.0
    sick = [*clean[:3], _result(3, 1, health={"available": True, "critical": ["GPU 1: XID 79"], "degraded": []})]
    assert [(f.check, f.part, f.why) for f in judge(sick, None)[0]] == [("health", "node 1 device 1", "GPU 1: XID 79")]
    failed = [*clean[:3], {"rank": 3, "node": 1, "local_rank": 1, "host": "h1", "error": "RuntimeError: boom"}]
    assert [(f.check, f.part) for f in judge(failed, None)[0]] == [("worker", "node 1 device 1")]
    # one that failed in the links keeps its burn-in: judged with the others (here: far slower)
    partial = {k: v for k, v in _result(3, 1, gflops=2.0).items() if k not in ("links", "allreduce_busbw_gbps")}
    assert [(f.check, f.part) for f in judge([*clean[:3], {**partial, "error": "timeout"}], None)[0]] == [
        ("worker", "node 1 device 1"), ("compute", "node 1 device 1")]
    # the baseline is held per machine (hostname), whatever node index it had
    assert [f.part for f in judge(clean, {"figures": {"compute|h0 device 0": 40.0}})[0]] == ["h0 device 0"]


def test_nvml_is_read_under_load_and_sees_an_xid_raised_during_the_burn_in(monkeypatch):
    """The worker's health path with NVML (a fake ``pynvml`` module, as the health watch's tests use): the
    source is open before the burn-in starts, and an XID raised meanwhile is in the reading taken in its last
    window."""
    from test_health import _FakeNvml

    from torchpass_plugins.audit import probes, worker

    nvml = _FakeNvml([{"temp": 70, "power_mw": 300_000}])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    source, why = worker._open_health("nvml")
    assert source is not None and why is None
    nvml.events = [SimpleNamespace(device=0, eventData=79)]  # the GPU fell off the bus mid-burn-in
    rate, _, health = probes.burn_in(torch.device("cpu"), 0.6, 32, at_the_end=lambda: worker._health(source, why, 0))
    assert rate > 0 and health["available"] and health["reading"]["temperature_c"] == 70
    assert health["critical"] == ["GPU 0: XID 79"]
    off, why = worker._open_health("off")
    assert off is None
    assert worker._health(off, why, 0) == {"available": False, "why": "turned off (--health-source off)"}


# -- real audits -------------------------------------------------------------------------------------------

# Short, and loose enough for a machine busy with other tests (--tolerance 2): the faults are far outside.
_QUICK = ("--duration", "4", "--message-mb", "8", "--memory-mb", "64", "--health-source", "off", "--tolerance", "2")


@pytest.mark.timeout(300)
def test_a_clean_machine_passes_with_exit_0_and_its_live_drill_is_bit_exact(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torchpass_plugins.cli", "audit", "--local", *_QUICK,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=280, cwd=tmp_path)
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert audit["passed"] and audit["findings"] == [] and len(audit["results"]) == 2
    assert audit["drill"]["bit_exact"] and audit["drill"]["applied_once"] and audit["drill"]["recomputed_steps"] == 0
    assert (tmp_path / "bandwidth.png").stat().st_size > 0 and (tmp_path / "compute.png").stat().st_size > 0
    assert "passed" in done.stdout


@pytest.mark.timeout(200)
def test_a_critical_health_reading_from_the_watchs_own_source_fails_that_device_only(tmp_path):
    """The readings come through the health watch's source interface (here ``file:``, as drills inject them)."""
    readings = tmp_path / "health.json"
    readings.write_text(json.dumps({"1": {"ecc_uncorrected_volatile": 2, "temperature_c": 70}}))
    quick = [a if a != "off" else f"file:{readings}" for a in _QUICK]
    done = subprocess.run([sys.executable, "-m", "torchpass_plugins.cli", "audit", "--local", *quick, "--no-drill",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=180)
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert [(f["check"], f["part"]) for f in audit["findings"]] == [("health", "node 0 device 1")], audit["findings"]
    assert "uncorrectable ECC" in audit["findings"][0]["why"] and audit["drill"] is None


def _audit_three_hosts(tmp_path: Path, hosts: Hosts, group: Path | None = None):
    """One audit worker on each of 3 hosts (hostnames host0..host2); host 1's worker in the control ``group``
    as it joins the others (its imports done, before the burn-in, which the workers start together).
    The exit codes, audit.json, each host's whole output and its standard output alone."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
    procs = []
    for node in range(3):
        argv = [sys.executable, "-m", "torchpass_plugins.cli", "audit", "--nnodes", "3", "--node-rank", str(node),
                "--nproc-per-node", "1", "--rdzv-endpoint", f"{hosts.address(0)}:29500", *_QUICK, "--no-drill",
                "--exclude-bad", "--out", str(tmp_path / "out")]
        script = f"hostname host{node}; exec \"$@\""  # (each exec keeps the pid)
        procs.append(hosts.popen(node, ["unshare", "--uts", "sh", "-c", script, "sh", *argv], start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        if group is not None:
            (group / "cgroup.procs").write_text(str(_worker_joined(procs[1].pid)))
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:  # the audit and its workers (one session each host)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    return [p.returncode for p in procs], audit, [out + err for out, err in outputs], [out for out, _ in outputs]


@pytest.mark.timeout(300)
def test_a_link_shaped_among_healthy_ones_is_flagged_and_only_it(tmp_path):
    with Hosts(3) as hosts:
        hosts.qdisc(2, "tbf", "rate", "100mbit", "burst", "32kb", "latency", "400ms")  # into host 2
        codes, audit, outputs, stdout = _audit_three_hosts(tmp_path, hosts)
    assert codes == [1, 1, 1], outputs
    assert {(f["check"], f["part"]) for f in audit["findings"]} == {("bandwidth", "link 0->2"),
                                                                   ("bandwidth", "link 1->2")}, audit["findings"]
    assert audit["blamed_nodes"].keys() == {"2"}
    assert stdout[0].strip().splitlines()[-1] == "host0,host1"  # --exclude-bad: the good nodes


@pytest.mark.timeout(300)
def test_a_device_held_to_a_sliver_of_a_core_is_flagged_and_only_it(tmp_path):
    group = _cpu_cgroup(f"tp-audit-{uuid.uuid4().hex[:8]}", quota_percent=10)
    try:
        with Hosts(3) as hosts:
            codes, audit, outputs, stdout = _audit_three_hosts(tmp_path, hosts, group)
    finally:
        group.rmdir()
    assert codes == [1, 1, 1], outputs
    assert ("compute", "node 1 device 0") in {(f["check"], f["part"]) for f in audit["findings"]}, audit["findings"]
    assert audit["blamed_nodes"].keys() == {"1"}, audit["findings"]  # its links may be slow too: none other is
    assert stdout[0].strip().splitlines()[-1] == "host0,host2"


def _worker_joined(parent: int) -> int:
    """The pid of ``parent``'s audit worker once it has a socket open: past its imports, joining the others
    (its burn-in starts once they all have; the first window, a warm-up, is not counted)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == parent and "torchpass_plugins.audit.worker" in (entry / "cmdline").read_text() and any(
                        os.readlink(fd).startswith("socket:") for fd in (entry / "fd").iterdir()):
                    return int(entry.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.01)
    raise AssertionError(f"process {parent} started no audit worker that joined")


def _cpu_cgroup(name: str, quota_percent: int) -> Path:
    """A CPU control group capped at ``quota_percent`` of one core (cgroup v2, or v1's cpu controller)."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    if (v2 / "cgroup.controllers").exists():
        (v2 / "cgroup.subtree_control").write_text("+cpu")
        group = v2 / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota_percent * 1000} 100000")
    elif v1.is_dir():
        group = v1 / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(quota_percent * 1000))
    else:
        raise AssertionError("this machine has no CPU control group to write (run the tests as root, as CI does)")
    return group
