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
_RESULTS_WAIT_S = 60  # after this node's workers ended: how long the other nodes' may still take, in all
_VERDICT_WAIT_S = 3600  # how long the other nodes wait for node 0's verdict (the drill comes first)


def _store(options: AuditOptions) -> tuple[dist.TCPStore, str, int]:
    host, _, port = options.rdzv_endpoint.rpartition(":")
    if options.node_rank == 0:
        store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        return store, host, store.port
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    return store, host, int(port)


def _same_layout(store: dist.TCPStore, options: AuditOptions, per_node: int) -> None:
    """Every node must count the same nodes and workers per node (else their ranks would not meet): each
    says its own, and waits for the others', before any worker starts."""
    mine = {"nnodes": options.nnodes, "per_node": per_node}
    store.set(f"audit/layout/{options.node_rank}", json.dumps(mine))
    for node in range(options.nnodes):
        theirs = json.loads(store.get(f"audit/layout/{node}"))
        if theirs != mine:
            raise SystemExit(f"torchpass audit: node {node} has {theirs['nnodes']} node(s) x {theirs['per_node']} "
                             f"worker(s), this node {options.nnodes} x {per_node}: give every node the same "
                             "--nnodes and --nproc-per-node")


def _start_workers(options: AuditOptions, per_node: int, host: str, port: int) -> list[subprocess.Popen]:
    settings = {"duration": options.duration, "health_source": options.health_source, "memory_mb": options.memory_mb,
                "message_mb": options.message_mb, "matmul_size": options.matmul_size}
    return [subprocess.Popen([sys.executable, "-m", "torchpass_plugins.audit.worker", host, str(port),
                              str(options.node_rank * per_node + local), str(per_node * options.nnodes),
                              str(options.node_rank), str(local), json.dumps(settings)])
            for local in range(per_node)]


def judge(results: list[dict], baseline: dict | None,
          tolerance: float = 1.0) -> tuple[list[verdict.Finding], dict[str, float]]:
    """The findings of a run's results, and its figures by ``check|part`` with the parts named by hostname
    (what a later ``--baseline`` compares: the same machine, whatever node index it gets next time). A worker
    that failed is a finding; what it measured before is judged with the rest."""
    node_of = {r["rank"]: r["node"] for r in results}
    device = {r["rank"]: f"node {r['node']} device {r['local_rank']}" for r in results}
    machine = {r["rank"]: f"{r['host']} device {r['local_rank']}" for r in results}
    findings = [verdict.Finding("worker", device[r["rank"]], None, None, r["error"]) for r in results if "error" in r]
    burnt = [r for r in results if "compute_gflops" in r]
    findings += verdict.compute_findings({device[r["rank"]]: r["compute_gflops"] for r in burnt},
                                         {device[r["rank"]]: r["compute_drop"] for r in burnt}, tolerance)
    memory = {r["rank"]: r["memory_gbps"] for r in results if "memory_gbps" in r}
    findings += verdict.low_outliers({f"node {node_of[k]}": v for k, v in memory.items()},
                                     verdict.MEMORY_RATIO / tolerance, "memory", "GB/s")
    links = [(int(peer), r["rank"], link) for r in results for peer, link in r.get("links", {}).items()]
    bandwidth = {(src, dst): link["gbps_from_peer"] for src, dst, link in links}
    latency = {(min(src, dst), max(src, dst)): link["latency_ms"] for src, dst, link in links}
    findings += verdict.link_findings(bandwidth, latency, node_of, tolerance)
    findings += [verdict.Finding("health", device[r["rank"]], None, None, why)
                 for r in burnt for why in r["health"].get("critical", [])]
    figures = {**{f"compute|{machine[r['rank']]}": r["compute_gflops"] for r in burnt},
               **{f"memory|{machine[k].rsplit(' device', 1)[0]}": v for k, v in memory.items()},
               **{f"bandwidth|{machine[a]} -> {machine[b]}": v for (a, b), v in bandwidth.items()},
               **{f"latency|{machine[a]} <-> {machine[b]}": v for (a, b), v in latency.items()}}
    allreduce = [r["allreduce_busbw_gbps"] for r in results if "allreduce_busbw_gbps" in r]
    if allreduce:
        figures["allreduce|all ranks"] = min(allreduce)
    if baseline is not None:
        findings += verdict.baseline_findings(figures, baseline.get("figures", {}), tolerance)
    return findings, figures


def _drill(out: Path) -> dict:
    from torchpass_plugins.demo.runner import drill

    result = drill(out / "drill", steps=30)
    return {"passed": result.passed, "bit_exact": result.bit_exact, "applied_once": result.applied_once,
            "recomputed_steps": result.recomputed, "regain_s": result.regain_s, "run_dir": str(result.run_dir)}


def _results(store: dist.TCPStore, world: int, per_node: int) -> list[dict]:
    """Every worker's numbers, or what stands for those of one that left none (it died, or never joined)."""
    deadline, results = time.monotonic() + _RESULTS_WAIT_S, []
    for rank in range(world):
        try:
            store.wait([result_key(rank)], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            results.append(json.loads(store.get(result_key(rank))))
        except (RuntimeError, ValueError) as exc:
            results.append({"rank": rank, "node": rank // per_node, "local_rank": rank % per_node, "host": "?",
                            "error": f"no result from this worker (it died, or never joined): {exc}"})
    return results


def _gather(store: dist.TCPStore, options: AuditOptions, per_node: int) -> dict:
    """(Node 0.) Every worker's numbers, judged; the drill; the report written."""
    results = _results(store, per_node * options.nnodes, per_node)
    baseline = json.loads(Path(options.baseline).read_text()) if options.baseline else None
    findings, figures = judge(results, baseline, options.tolerance)
    out = Path(options.out)
    drill = _drill(out) if options.drill else None
    if drill is not None and not drill["passed"]:
        findings.append(verdict.Finding("drill", "node 0", None, None, "the live drill did not continue bit-exact: "
                                        f"see {drill['run_dir']}"))
    blamed = verdict.culprit_nodes(findings, {r["rank"]: r["node"] for r in results}, options.nnodes)
    hosts = {r["node"]: r["host"] for r in results if r["host"] != "?"}
    audit = {"nodes": options.nnodes, "workers_per_node": per_node, "duration_s": options.duration,
             "tolerance": options.tolerance,
             "results": results, "figures": figures, "findings": [f.as_dict() for f in findings],
             "blamed_nodes": {str(n): why for n, why in blamed.items()}, "drill": drill,
             "good_hosts": [hosts[n] for n in sorted(hosts) if n not in blamed], "passed": not findings}
    write_report(audit, out)
    return audit


def _wait_for(workers: list[subprocess.Popen], seconds: float) -> None:
    """Until this node's workers end, at most ``seconds``; any still running then is killed (its numbers so
    far are what it left in the store)."""
    deadline = time.monotonic() + seconds
    for proc in workers:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def audit(options: AuditOptions) -> int:
    """Run this node's part of the audit; the exit status is 1 where anything failed anywhere."""
    per_node = options.workers()
    store, host, port = _store(options)
    _same_layout(store, options, per_node)
    workers = _start_workers(options, per_node, host, port)
    try:
        _wait_for(workers, GROUP_TIMEOUT_S + 2 * options.duration)
        if options.node_rank == 0:
            result = _gather(store, options, per_node)
            store.set(_VERDICT_KEY, json.dumps({"passed": result["passed"], "good_hosts": result["good_hosts"]}))
            try:  # the store stays up until every node has read the verdict
                store.wait([f"audit/read/{node}" for node in range(1, options.nnodes)],
                           timedelta(seconds=_RESULTS_WAIT_S))
            except RuntimeError:
                print("torchpass audit: a node did not read the verdict (its audit ended)", file=sys.stderr)
        else:
            try:
                store.wait([_VERDICT_KEY], timedelta(seconds=_VERDICT_WAIT_S))
                result = json.loads(store.get(_VERDICT_KEY))
            except RuntimeError as exc:
                print(f"torchpass audit: no verdict from node 0 ({exc})", file=sys.stderr)
                return 1
            store.set(f"audit/read/{options.node_rank}", "1")
    finally:
        _wait_for(workers, 0)
    if options.exclude_bad:
        print(",".join(result["good_hosts"]))
    return 0 if result["passed"] else 1
