"""``torchpass_fsdp``: the price of ring replication, and what a recovery costs.

Overhead: steady-state step time with the shard replicated every step, every 2 and every 4 steps (smoke:
every 2) vs replication off, same model, same launcher, runs alternating; and, within each run replicating
every 2 steps, the steps that carry a round vs those that do not. Recovery: 3 active ranks + 1
spare, rank 1 SIGKILLed at the first gradient reduce-scatter of step K (``TORCHPASS_FAULTS``); reported:
the recovery time each rank logs (new roster -> state restored), regain (the agent sees the exit -> every
rank has completed step K), bytes moved to the spare (shard from the ring successor, the rest from a
survivor), the steps rolled back, and the host memory the replicas take per rank.

Run ``python benchmarks/fsdp_replication.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import (
    STEADY_NOTE,
    STEADY_RANKS,
    MLPSize,
    RunFailed,
    begin,
    command_line,
    in_turn,
    machine_lines,
    median_ci,
    publish,
    read_events,
    read_steps,
    run_bounded,
    summarize,
    tail,
    torchpass_cmd,
    worker_env,
)

RANKS, KILL_RANK = 3, 1  # the recovery's active ranks
ALTERNATE = 2  # a run replicating every other step: steps with a round vs without, side by side


@dataclass(frozen=True)
class Size(MLPSize):
    steps: int
    warmup: int
    kill_step: int


FULL = Size(features=1024, hidden=1024, depth=4, classes=10, batch_size=64, steps=90, warmup=10, kill_step=30,
            reps=3, timeout_s=600)
SMOKE = Size(features=32, hidden=64, depth=2, classes=4, batch_size=8, steps=12, warmup=4, kill_step=6, reps=1,
             timeout_s=240)


def launch(size: Size, work: Path, every: int, spares: int, faults: str = "") -> Path:
    """Steady state (no spares): ``STEADY_RANKS`` pinned ranks; a recovery: ``RANKS`` + ``spares``."""
    out = work / "out"
    ranks = RANKS if spares else STEADY_RANKS
    args = ["--strategy", "torchpass_fsdp", "--replicate-every", str(every), "--devices", str(ranks), "--max-steps",
            str(size.steps), *size.model_args(), "--out", str(out), *([] if spares else ["--pin"])]
    env = worker_env(steady=not spares)
    if faults:
        env["TORCHPASS_FAULTS"] = faults
    code = run_bounded(torchpass_cmd(ranks + spares, spares, work / "run", args), env, size.timeout_s,
                       work / "launcher.log")
    if code != 0:
        raise RunFailed(f"replicate every {every}: launcher exited {code}\n{tail(work / 'launcher.log')}")
    return out


def rank0_perf(size: Size, out: Path) -> dict[int, float]:
    """Rank 0's ``perf_counter`` after applying each step, by step; every step must be there."""
    perf = {step: p for step, _, p, _ in read_steps(out).get(0, [])}
    if len(perf) != size.steps:
        raise RunFailed(f"rank 0 recorded {len(perf)} steps, expected {size.steps}")
    return perf


def within_run_ratio(size: Size, out: Path) -> float:
    """In a run replicating every ``ALTERNATE`` steps: the median time of the steps that carry a round over
    that of the steps that do not. A round starts at a step's boundary and is fenced before that step's
    first gradient reduction, so its cost stays in that step (rank 0 records step k after applying it)."""
    perf = rank0_perf(size, out)
    with_round, without = [], []
    for k in range(size.warmup + 1, size.steps):
        (with_round if k % ALTERNATE == 0 else without).append(perf[k] - perf[k - 1])
    return statistics.median(with_round) / statistics.median(without)


def step_time_ms(size: Size, out: Path) -> float:
    perf = rank0_perf(size, out)
    return statistics.median((perf[k] - perf[k - 1]) * 1e3 for k in range(size.warmup + 1, size.steps))


@dataclass
class Recovery:
    recovery_s: float
    regain_s: float
    shard_bytes: int
    host_bytes: int
    rolled_back: int
    replica_memory_bytes: int
    log_memory_bytes: int


def measure_recovery(size: Size, work: Path) -> Recovery:
    out = launch(size, work, 1, 1, f"kill@rank={KILL_RANK},step={size.kill_step},phase=reduce")
    events = read_events(work / "run")
    [exit_event] = [e for e in events if e["event"] == "worker_exited" and e.get("code") == -9]
    recovered = [e for e in events if e["event"] == "recovered"]
    received = [e for e in events if e["event"] == "state_received"]
    done = [max(t for step, t, _, _ in rows if step == size.kill_step) for rows in read_steps(out).values()]
    return Recovery(
        recovery_s=max(e["seconds"] for e in recovered),
        regain_s=max(done) - exit_event["time"],
        shard_bytes=sum(e["bytes"] for e in received if e["kind"] == "shard"),
        host_bytes=sum(e["bytes"] for e in received if e["kind"] == "host"),
        rolled_back=max(e["steps_rolled_back"] for e in recovered),
        replica_memory_bytes=max(e["bytes"] for e in events if e["event"] == "replica_memory"),
        log_memory_bytes=max(e["log_bytes"] for e in events if e["event"] == "replica_memory"),
    )


def _label(every: int) -> str:
    return {0: "off", 1: "every step"}.get(every, f"every {every} steps")


def render(size: Size, times: dict[int, list[float]], within: list[float], recoveries: list[Recovery], smoke: bool,
           info: dict) -> str:
    off = statistics.median(times[0])
    lines = ["## `torchpass_fsdp`: replication overhead and recovery (`benchmarks/fsdp_replication.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one repetition; the times are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        f"- Setup: FSDP2 (each `nn.Linear` one unit) over gloo; MLP {size.features} -> {size.hidden}x{size.depth} "
        f"-> {size.classes} ({size.params:,} parameters), batch {size.batch_size} per rank, AdamW. Step time: "
        f"{STEADY_RANKS} ranks, each pinned to one core, median of rank 0's step-to-step deltas after "
        f"{size.warmup} warmup steps; each repetition runs every setting once, in reverse order every other "
        f"repetition; {STEADY_NOTE}.",
        "",
        "| Replication | Runs | Median step (ms) | Min-max of run medians (ms) |",
        "|---|---|---|---|",
    ]
    for every, runs in times.items():
        m, lo, hi = summarize(runs)
        lines.append(f"| {_label(every)} | {len(runs)} | {m:.1f} | {lo:.1f}-{hi:.1f} |")
    lines.append("")
    for every in (e for e in times if e):
        pairs = [a / b for a, b in zip(times[every], times[0], strict=False)]
        ratio, lo, hi = median_ci(pairs)
        lines.append(f"**Step time with replication {_label(every)} / off: {ratio:.3f}** (median over repetitions "
                     f"of the ratio within each; 95% interval {lo:.3f}-{hi:.3f}; ratio of medians "
                     f"{statistics.median(times[every]) / off:.3f}).  ")
    ratio, lo, hi = median_ci(within)
    lines += [
        f"**Within one run replicating every {ALTERNATE} steps, steps with a round / steps without: "
        f"{ratio:.3f}** (median of {len(within)} runs, 95% interval {lo:.3f}-{hi:.3f}; per run {min(within):.3f}-"
        f"{max(within):.3f}). The two kinds of step alternate in the same run, so the drift between runs that "
        "widens the spreads above cancels out; a round's cost stays in its step (it is fenced before the step's "
        "first gradient reduction). Intervals: distribution-free, for the median (`median_ci` in `_harness.py`).",
        "",
    ]
    if recoveries:
        med = {k: statistics.median(getattr(r, k) for r in recoveries) for k in asdict(recoveries[0])}
        lines += [
            f"Recovery ({len(recoveries)} runs, medians; SIGKILL of rank {KILL_RANK} at the first reduce-scatter of "
            f"step {size.kill_step}, 1 spare, replication every step):",
            "",
            "| Recovery (s) | Regain (s) | Shard bytes to the spare | Other state bytes | Steps rolled back | "
            "Replica host memory per rank (bytes) | Gradient log host memory per rank (bytes) |",
            "|---|---|---|---|---|---|---|",
            f"| {med['recovery_s']:.2f} | {med['regain_s']:.2f} | {med['shard_bytes']:,.0f} | {med['host_bytes']:,.0f} "
            f"| {med['rolled_back']:.0f} | {med['replica_memory_bytes']:,.0f} | {med['log_memory_bytes']:,.0f} |",
            "",
            "Recovery: the longest `recovered` event (new roster -> every rank restored). Regain: from the agent's "
            "record of the exit until every rank has completed the step in flight. Host memory: the rank's three "
            "segments of packed snapshots (two kept, one being written); its successor on the same host maps them, "
            "so the replica it holds costs nothing more (across hosts: two own snapshots and two received replicas). "
            "Gradient log: the most the rank held at once for it: its own entries (one shard-sized gradient and its "
            "rank-local state per step), written into memory its successor on the same host maps, kept from one "
            "round before the successor's oldest replica on (across hosts: the predecessor's entries, "
            "received); the largest over ranks.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, size, reps, info, work_root = begin(__doc__, argv, "fsdp", FULL, SMOKE)
    settings = (ALTERNATE, 0) if args.smoke else (1, ALTERNATE, 4, 0)
    times: dict[int, list[float]] = {every: [] for every in settings}
    within: list[float] = []  # from the runs replicating every ALTERNATE steps
    recoveries: list[Recovery] = []
    for rep in range(reps):
        for every in in_turn(settings, rep):
            print(f"[fsdp] rep {rep} replicate every {every} ...", flush=True)
            out = launch(size, work_root / f"rep{rep}-every{every}", every, 0)
            times[every].append(step_time_ms(size, out))
            print(f"[fsdp] rep {rep} every {every}: median step {times[every][-1]:.2f} ms", flush=True)
            if every == ALTERNATE:
                within.append(within_run_ratio(size, out))
                print(f"[fsdp] rep {rep}: steps with a round / without {within[-1]:.3f}", flush=True)
        print(f"[fsdp] rep {rep} recovery ...", flush=True)
        recoveries.append(measure_recovery(size, work_root / f"rep{rep}-recovery"))
        print(f"[fsdp] rep {rep} recovery: {recoveries[-1]}", flush=True)
    body = render(size, times, within, recoveries, args.smoke, info)
    raw = {"machine": info, "size": asdict(size), "step_ms": times, "within_run_ratios": within,
           "recoveries": [asdict(r) for r in recoveries]}
    publish("fsdp", args.doc, body, work_root, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
