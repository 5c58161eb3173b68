"""The GPU check: what torchpass does on a real GPU, in under 8 minutes on a machine with one.

Every part runs real ``torchpass launch`` jobs of the demo (``torchpass_plugins/demo/train.py``) on the
GPU, with ``Trainer(deterministic=True)`` (deterministic algorithms, ``CUBLAS_WORKSPACE_CONFIG``), and
compares every logical rank's full state at the end with a failure-free run of the same job:

- (a) 3 ranks + 1 spare sharing the GPU over gloo on CUDA tensors; rank 1 SIGKILLed in backward.
- (b) 1 active rank + 1 spare on NCCL, snapshots every 2 steps; the rank SIGKILLed mid-step. No peer
  holds its state, so the job restarts from the newest snapshot on a new communicator (the fallback).
- (c) NVML readings of the real GPU through the health source the agents use.
- (d) snapshot stall with CUDA tensors: what the loop waits for a background snapshot (device -> pinned
  host copies), beside how long writing that snapshot takes (what a synchronous save waits for), in one job.
- (f) ``torchpass_fsdp``: 3 ranks + 2 spares sharing the GPU over gloo, ring replicas every 4 steps; rank 0
  SIGKILLed in the optimizer step and rank 2 in backward. The ring successor rebuilds each lost shard from
  its replica and the logged gradients, replaying the optimizer steps on the GPU (the live run's kernels).
- (g) in one process: the gradient log's replay of 3 logged optimizer steps against the live steps on the
  GPU (AdamW foreach and fused, SGD with momentum), bit for bit; and the same replay on the host.
- (h) ``torchpass audit --local`` on the GPUs: the burn-in's rate and drop, NVML readings under load, the
  links between the GPUs' workers, and its verdict.
- (e) with two or more GPUs (``gpu_nccl.py``): the NCCL kill/hang matrix with a survivor, a new
  generation's cost, an abort with a collective stuck on an absent peer (against the abort deadline),
  state to a spare against raw NCCL sends, step time against ``ddp`` and FSDP2.

What it does not cover: ``torchpass_fsdp`` on NCCL, ``TorchPass`` (Accelerate), ``SyncBatchNorm`` and
``16-mixed`` on a GPU; with one GPU, NCCL with survivors (one GPU runs one NCCL rank).

It prints one table and writes it to ``docs/gpu.md`` (section ``gpu-check``). Run
``python benchmarks/gpu_check.py`` on the GPU machine; nothing it reports is measured anywhere else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import gpu_nccl
import torch
from _harness import REPO, command_line, machine, machine_lines, update_section

from torchpass_plugins.testing.chaos import jobs
from torchpass_plugins.testing.chaos.jobs import run
from torchpass_plugins.testing.chaos.oracle import differences

DOC = REPO / "docs" / "gpu.md"
WORK = REPO / "benchmarks" / "out" / "gpu_check"
STEPS = 16
ON_CPU_STEPS = 10
JOB_TIMEOUT = jobs.JOB_TIMEOUT  # a hung job's workers print their stacks into its log (agent0.log), then it dies
GPU = ["--accelerator", "gpu", "--deterministic", "--devices", "1", "--max-steps", str(STEPS), "--workers", "0"]
NCCL = ["--process-group-backend", "nccl"]


def _job(name: str, nproc: int, spares: int, args: tuple[str, ...], faults: str = "", launch: tuple[str, ...] = ()):
    job, codes = run(WORK / name, timeout=JOB_TIMEOUT, nproc=nproc, spares=spares, train_args=args, faults=faults,
                     launch_args=launch)
    if codes != [0]:
        raise RuntimeError(f"{name}: exit {codes}\n{job.output()[-2000:]}")
    return job


def _compare(expected, job, ranks: int, logged_values_restart: bool = False) -> str:
    """Every rank's full state against the failure-free run's (after a snapshot resume the logged
    values start over, as documented, so they are left out there)."""
    found = []
    for rank in range(ranks):
        want, got = expected.state(rank), job.state(rank)
        if logged_values_restart:
            want.pop("callback_metrics"), got.pop("callback_metrics")
        found += differences(want, got, f"rank{rank}")
    what = "bit-exact on every rank" + (" (logged values left out: they start over)" if logged_values_restart else "")
    return what if not found else f"{len(found)} differences, first: {found[0]}"


def _recovery_s(job) -> float:
    return max((e["seconds"] for e in job.events("recovered")), default=float("nan"))


def shared_gpu_over_gloo() -> list[str]:
    args = (*GPU, "--num-nodes", "3", "--process-group-backend", "gloo")
    expected = _job("a-reference", 3, 0, args)
    job = _job("a-kill", 4, 1, args, faults="kill@rank=1,step=7,phase=backward")
    applied = all(job.applied(r) == list(range(STEPS)) for r in range(3))
    return [f"(a) 3 ranks + 1 spare, one GPU, gloo | {_compare(expected, job, 3)}; every step applied once: "
            f"{'yes' if applied else 'no'}; recovery {_recovery_s(job):.2f} s"]


def sharded_over_gloo() -> list[str]:
    args = (*GPU, "--num-nodes", "3", "--process-group-backend", "gloo", "--strategy", "torchpass_fsdp",
            "--replicate-every", "4")
    expected = _job("f-reference", 3, 0, args)
    job = _job("f-kill", 5, 2, args, faults="kill@rank=0,step=6,phase=optimizer;kill@rank=2,step=9,phase=backward")
    applied = all(job.applied(r) == list(range(STEPS)) for r in range(3))
    recovered = job.events("recovered")
    rolled_back = max((e.get("steps_rolled_back") or 0 for e in recovered), default=0)
    replayed = [e.get("steps_replayed", 0) for e in job.events("state_sent")]
    return [f"(f) torchpass_fsdp, 3 ranks + 2 spares, one GPU, gloo, replicas every 4 steps, 2 kills | "
            f"{_compare(expected, job, 3)}; every step applied once: {'yes' if applied else 'no'}; "
            f"recovered events (one per rank and recovery) {len(recovered)}, steps rolled back {rolled_back}, "
            f"logged steps replayed {sum(replayed)}"]


def replay_against_live() -> list[str]:
    device = torch.device("cpu" if GPU[1] == "cpu" else "cuda")
    makers = {"AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
              "AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
              "SGD with momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4)}
    return [f"(g) replay of 3 logged steps, {label} | {_replay_case(make, device)}" for label, make in makers.items()]


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _replay_case(make, device: torch.device) -> str:
    """Four live steps of ``make``'s optimizer on ``device``; a replica taken after the first (host copies,
    as the ring holds it) and the other three replayed from their logged gradients, compared bit for bit."""
    from torch import nn

    from torchpass_plugins.core.gradient_log import hyperparameters, replay
    from torchpass_plugins.core.training_state import MODEL, OPTIMIZER

    torch.manual_seed(0)
    params = {"weight": nn.Parameter(torch.randn(512, 512, device=device)),
              "bias": nn.Parameter(torch.randn(512, device=device))}
    live = make(list(params.values()))
    replica, logged = None, []
    for index in range(4):
        grad = {n: torch.randn_like(p) for n, p in params.items()}
        if replica is not None:
            logged.append({"grads": {n: _host(g) for n, g in grad.items()}, "groups": hyperparameters(live)})
        for n, p in params.items():
            p.grad = grad[n]
        live.step()
        if index == 0:  # the replica is taken after one step, when the optimizer has state
            replica = {MODEL: {n: _host(p) for n, p in params.items()}, OPTIMIZER: {
                "state": {n: {k: _host(v) if torch.is_tensor(v) else v for k, v in live.state[p].items()}
                          for n, p in params.items()},
                "param_groups": [{**hyperparameters(live)[0], "params": list(params)}]}}

    def same(like) -> str:
        got = replay(replica, logged, like)
        equal = all(torch.equal(got[MODEL][n], _host(p)) and all(
            torch.equal(v, _host(live.state[p][k])) for k, v in got[OPTIMIZER]["state"][n].items()
            if torch.is_tensor(v)) for n, p in params.items())
        return "yes" if equal else "no"

    if device.type == "cpu":
        return f"bit-exact with the live steps: {same(live)}"
    on_host = make([nn.Parameter(_host(p)) for p in params.values()])
    return f"bit-exact with the live steps: {same(live)}; replayed on the host instead: {same(on_host)}"


def nccl_restart_on_a_new_communicator() -> list[str]:
    args = (*GPU, "--num-nodes", "1", *NCCL, "--snapshot-every", "2")
    expected = _job("b-reference", 1, 0, (*args, "--snapshot-dir", str(WORK / "b-reference-snapshots")))
    job = _job("b-kill", 2, 1, (*args, "--snapshot-dir", str(WORK / "b-kill-snapshots")),
               faults="kill@rank=0,step=7,phase=backward", launch=("--max-restarts", "1"))
    restarts = len(job.events("job_restart"))
    same = _compare(expected, job, 1, logged_values_restart=True)
    return [f"(b) 1 rank + 1 spare, NCCL | {same}; restarts from a snapshot: {restarts}; "
            f"every step applied: {'yes' if sorted(set(job.applied(0))) == list(range(STEPS)) else 'no'}"]


def nvml_readings() -> list[str]:
    from torchpass_plugins.health.watch import NvmlHealthSource

    readings = NvmlHealthSource().read(list(range(torch.cuda.device_count())))
    return [f"(c) NVML, GPU {i} | {r}" for i, r in enumerate(readings)]


def audit_on_the_gpus() -> list[str]:
    """``torchpass audit --local`` on this machine's GPUs: the burn-in, NVML under load, the links between
    the GPUs' workers (gloo), without the drill (parts (a) and (b) are drills on the GPU)."""
    out = WORK / "h-audit"
    done = subprocess.run([sys.executable, "-m", "torchpass_plugins.cli", "audit", "--local", "--duration", "20",
                           "--no-drill", "--out", str(out)], capture_output=True, text=True, timeout=JOB_TIMEOUT)
    audit = json.loads((out / "audit.json").read_text())
    rows = [f"(h) audit, {r['device']} | burn-in {r.get('compute_gflops', 0):.0f} GFLOP/s, drop "
            f"{r.get('compute_drop', 0):.0%}; NVML under load: "
            f"{r['health'].get('reading') if r.get('health', {}).get('available') else 'not available'}"
            for r in audit["results"]]
    findings = [(f["check"], f["part"], f["why"]) for f in audit["findings"]] or "none"
    return [*rows, f"(h) audit verdict | exit {done.returncode}; findings: {findings}"]


def snapshot_stall() -> list[str]:
    hidden, steps = ("512", "12") if GPU[1] == "cpu" else ("2048", "24")  # on CPU: checking the script only
    args = (*GPU, "--num-nodes", "1", "--hidden", hidden, "--max-steps", steps)
    job = _job("d-snapshots", 1, 0, (*args, "--snapshot-every", "4", "--snapshot-dir", str(WORK / "d-snapshots")))
    stalls = [e["stall_s"] for e in job.events("snapshot_staged")][1:]  # the first one allocates its staging
    writes = [e["seconds"] for e in job.events("snapshot_written")][1:]
    size = max((e["bytes"] for e in job.events("snapshot_written")), default=0) / 1e6
    if not stalls or not writes:
        raise RuntimeError(f"no snapshots measured: {len(stalls)} stalls, {len(writes)} writes")
    stall, write = statistics.median(stalls), statistics.median(writes)
    return [f"(d) snapshot of CUDA state ({size:.0f} MB), {len(stalls)} snapshots | the loop stalled {stall:.4f} s "
            f"(median); writing it, which a synchronous save makes the loop wait for, took {write:.3f} s: "
            f"stall / write = {stall / write:.3f}"]


def nccl_with_survivors() -> list[str]:
    on_cpu, count = GPU[1] == "cpu", torch.cuda.device_count()
    if not on_cpu and count < 2:
        return [f"(e) NCCL with survivors | not run: it needs 2 or more GPUs, this machine has {count}"]
    rows = gpu_nccl.kill_hang_matrix(WORK, count, on_cpu, _job, _compare)
    rows += gpu_nccl.group_mechanics(WORK / "e-mechanics", on_cpu, megabytes=16 if on_cpu else 256)
    return rows if on_cpu else rows + gpu_nccl.step_times(WORK)


PARTS = {"g": replay_against_live, "a": shared_gpu_over_gloo, "f": sharded_over_gloo,
         "b": nccl_restart_on_a_new_communicator, "c": nvml_readings, "d": snapshot_stall, "e": nccl_with_survivors,
         "h": audit_on_the_gpus}


def main(argv: list[str] | None = None) -> int:
    global JOB_TIMEOUT, STEPS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--on-cpu", action="store_true",
                   help="check this script on a machine without a GPU: parts (a), (b), (d), (f), (g) and the first "
                        "case and the group mechanics of (e) on CPU tensors over gloo, "
                        "written to benchmarks/out/gpu-check-on-cpu.md (no GPU figures)")
    p.add_argument("--job-timeout", type=float, default=JOB_TIMEOUT, help="seconds each job may take")
    p.add_argument("--parts", default="", help="only these parts, by letter (e.g. 'a,f'): a rerun, written to its "
                   "own section of the page (gpu-check-parts) beside the full check's")
    ns = p.parse_args(argv)
    doc = ns.doc
    JOB_TIMEOUT = ns.job_timeout
    if ns.on_cpu:  # the script's parts on CPU tensors, in fewer steps (the faults strike at step 7)
        STEPS = gpu_nccl.STEPS = ON_CPU_STEPS
        GPU[GPU.index("gpu")] = "cpu"
        GPU[GPU.index("--max-steps") + 1] = str(STEPS)
        NCCL[1] = "gloo"
        doc = REPO / "benchmarks" / "out" / "gpu-check-on-cpu.md"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured (--on-cpu checks the script itself)", file=sys.stderr)
        return 2
    shutil.rmtree(WORK, ignore_errors=True)  # the jobs append to their run directories' files
    info = machine()
    count = torch.cuda.device_count()
    rows, failures = [], []
    letters = ns.parts.split(",") if ns.parts else [k for k in PARTS if not (ns.on_cpu and k in "ch")]  # NVML
    parts = [PARTS[letter] for letter in letters]
    for part in parts:
        t0 = time.perf_counter()
        try:
            rows += part()
        except Exception as exc:
            failures.append(part.__name__)
            rows.append(f"{part.__name__} | FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            traceback.print_exc()
        print(f"[gpu_check] {part.__name__}: {time.perf_counter() - t0:.0f} s", flush=True)
    gpu = "none (run on CPU tensors, to check the script)" if ns.on_cpu else (
        f"{count} x {torch.cuda.get_device_name(0)}; CUDA {torch.version.cuda}; "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    body = "\n".join([
        "## GPU check",
        "",
        *machine_lines(info, command_line()),
        f"- GPU: {gpu}",
        "",
        "| part | result |",
        "|---|---|",
        *[f"| {row.split(' | ', 1)[0]} | {row.split(' | ', 1)[1]} |" for row in rows],
    ])
    update_section(doc, "gpu-check-parts" if ns.parts else "gpu-check", body.replace(
        "## GPU check", f"## GPU check, parts {ns.parts} again" if ns.parts else "## GPU check"))
    (WORK.parent / "gpu_check.json").write_text(json.dumps({"rows": rows, "failures": failures}, indent=2))
    print(body)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
