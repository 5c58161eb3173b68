"""``torchpass audit``: every node at once, before a job lands on them.

Each node's audit starts one worker per device (:mod:`~torchpass_plugins.audit.worker`); they meet at the
rendezvous endpoint (node 0 holds the store, as for ``torchpass launch``) and measure together. Node 0 reads
every worker's numbers, judges them (:mod:`~torchpass_plugins.audit.verdict`), runs the live drill (the demo's
job: a worker SIGKILLed, a spare in its place, every rank compared bit for bit with a failure-free run) and
writes the report (:mod:`~torchpass_plugins.audit.report`). Every node then exits non-zero if anything failed,
so the audit can gate a Slurm prolog or a node pool.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from torchpass_plugins.audit import verdict
from torchpass_plugins.audit.options import AuditOptions
from torchpass_plugins.audit.report import write_report
from torchpass_plugins.audit.worker import GROUP_TIMEOUT_S, result_key

_VERDICT_KEY = "audit/verdict"
_RESULT_WAIT_S = 60  # after this node's workers ended: how long another node's may still take


def _store(options: AuditOptions) -> tuple[dist.TCPStore, str, int]:
    host, _, port = options.rdzv_endpoint.rpartition(":")
    if options.node_rank == 0:
        store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        return store, host, store.port
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    return store, host, int(port)


def _start_workers(options: AuditOptions, host: str, port: int) -> list[subprocess.Popen]:
    per_node, world = options.workers(), options.workers() * options.nnodes
    measured = {"duration": options.duration, "health_source": options.health_source, "memory_mb": options.memory_mb,
                "message_mb": options.message_mb, "matmul_size": options.matmul_size}
    return [subprocess.Popen([sys.executable, "-m", "torchpass_plugins.audit.worker", host, str(port),
                              str(options.node_rank * per_node + local), str(world), str(options.node_rank),
                              str(local), json.dumps(measured)])
            for local in range(per_node)]


def judge(results: list[dict], baseline: dict | None) -> tuple[list[verdict.Finding], dict[str, float]]:
    """The findings of a run's results (and its figures by ``check|part``, what a later baseline compares)."""
    node_of = {r["rank"]: r["node"] for r in results}
    findings = [verdict.Finding("worker", f"node {r['node']} device {r['local_rank']}", None, None, r["error"])
                for r in results if "error" in r]
    measured = [r for r in results if "error" not in r]
    devices = {f"node {r['node']} device {r['local_rank']}": r for r in measured}
    findings += verdict.compute_findings({p: r["compute_gflops"] for p, r in devices.items()},
                                         {p: r["compute_drop"] for p, r in devices.items()})
    memory = {f"node {r['node']}": r["memory_gbps"] for r in measured if "memory_gbps" in r}
    findings += verdict.low_outliers(memory, verdict.MEMORY_RATIO, "memory", "GB/s")
    bandwidth = {(int(peer), r["rank"]): link["gbps_from_peer"] for r in measured for peer, link in r["links"].items()}
    latency = {(min(r["rank"], int(peer)), max(r["rank"], int(peer))): link["latency_ms"]
               for r in measured for peer, link in r["links"].items()}
    findings += verdict.link_findings(bandwidth, latency, node_of)
    findings += [verdict.Finding("health", part, None, None, why)
                 for part, r in devices.items() for why in r["health"].get("critical", [])]
    figures = {**{f"compute|{p}": r["compute_gflops"] for p, r in devices.items()},
               **{f"memory|{p}": v for p, v in memory.items()},
               **{f"bandwidth|link {a}->{b}": v for (a, b), v in bandwidth.items()},
               **{f"latency|link {a}<->{b}": v for (a, b), v in latency.items()}}
    if measured:
        figures["allreduce|all ranks"] = min(r["allreduce_busbw_gbps"] for r in measured)
    if baseline is not None:
        findings += verdict.baseline_findings(figures, baseline.get("figures", {}), {
            "compute": True, "memory": True, "bandwidth": True, "latency": False, "allreduce": True})
    return findings, figures


def _drill(out: Path) -> dict:
    from torchpass_plugins.demo.runner import drill

    result = drill(out / "drill", steps=30)
    return {"passed": result.passed, "bit_exact": result.identical, "applied_once": result.once,
            "recomputed_steps": result.recomputed, "regain_s": result.regain_s, "run_dir": str(result.run_dir)}


def _result(store: dist.TCPStore, rank: int, per_node: int) -> dict:
    """A worker's numbers, or what stands for them if it left none (it died, or never joined)."""
    try:
        store.wait([result_key(rank)], timedelta(seconds=_RESULT_WAIT_S))
        return json.loads(store.get(result_key(rank)))
    except (RuntimeError, ValueError) as exc:
        return {"rank": rank, "node": rank // per_node, "local_rank": rank % per_node, "host": "?",
                "error": f"no result from this worker (it died, or never joined): {exc}"}


def _gather(store: dist.TCPStore, options: AuditOptions, world: int) -> dict:
    """(Node 0.) Every worker's numbers, judged; the drill; the report written; the verdict for every node."""
    results = [_result(store, rank, options.workers()) for rank in range(world)]
    baseline = json.loads(Path(options.baseline).read_text()) if options.baseline else None
    findings, figures = judge(results, baseline)
    out = Path(options.out)
    drill = _drill(out) if options.drill else None
    if drill is not None and not drill["passed"]:
        findings.append(verdict.Finding("drill", "node 0", None, None, "the live drill did not continue bit-exact: "
                                        f"see {drill['run_dir']}"))
    node_of = {r["rank"]: r["node"] for r in results}
    blamed = verdict.culprit_nodes(findings, node_of, options.nnodes)
    hosts = {r["node"]: r["host"] for r in results}
    audit = {"nodes": options.nnodes, "workers_per_node": options.workers(), "duration_s": options.duration,
             "results": results, "figures": figures, "findings": [f.as_dict() for f in findings],
             "blamed_nodes": {str(n): why for n, why in blamed.items()}, "drill": drill,
             "good_hosts": [hosts[n] for n in sorted(hosts) if n not in blamed], "passed": not findings}
    write_report(audit, out)
    return audit


def audit(options: AuditOptions) -> int:
    """Run this node's part of the audit; the exit status is 1 where anything failed anywhere."""
    store, host, port = _store(options)
    world = options.workers() * options.nnodes
    workers = _start_workers(options, host, port)
    deadline = time.monotonic() + GROUP_TIMEOUT_S + 2 * options.duration
    try:
        for proc in workers:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if options.node_rank == 0:
            result = _gather(store, options, world)
            store.set(_VERDICT_KEY, json.dumps({"passed": result["passed"], "good_hosts": result["good_hosts"]}))
            for node in range(1, options.nnodes):  # the store stays up until every node has read the verdict
                store.get(f"audit/read/{node}")
        else:
            result = json.loads(store.get(_VERDICT_KEY))
            store.set(f"audit/read/{options.node_rank}", "1")
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if options.exclude_bad:
        print(",".join(result["good_hosts"]))
    return 0 if result["passed"] else 1

