"""What a snapshot costs the training loop: torchpass background snapshots vs a synchronous save vs
Lightning's ``AsyncCheckpointIO``, on the same ~500 MB state.

One logical rank under ``torchpass launch`` (``torchpass_ddp``), an MLP whose parameters plus AdamW state
make about 500 MB, a snapshot at the boundary of every ``every``-th step. Modes, alternating per repetition:

- *torchpass*: ``TorchPassCallback(snapshot_dir=..., snapshot_every_n_steps=every)``; stall = what the loop
  waited (the ``stall_s`` of each ``snapshot_staged`` event: building the state, copies made at once, and
  the fence before the optimizer step).
- *sync*: ``trainer.save_checkpoint`` at the same boundaries (``torch.save`` to local disk); stall = its duration.
- *async-io*: the same call with Lightning's ``AsyncCheckpointIO`` plugin; stall = its duration.
- *none*: no snapshot, for the step time the others are compared with.

Throughput dip: mean step time over the 3 steps after each snapshot step, divided by the *none* run's median.
Cost, the headline: the stall plus the time those 3 steps took beyond that median, since the background write
competes with training for the cores and a stall alone would hide it.

Run ``python benchmarks/snapshot_stall.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import (
    MLPSize,
    RunFailed,
    begin,
    command_line,
    machine_lines,
    publish,
    read_events,
    read_steps,
    run_bounded,
    tail,
    torchpass_cmd,
    worker_env,
)

MODES = ("torchpass", "sync", "async-io", "none")
DIP_STEPS = 3


@dataclass(frozen=True)
class Size(MLPSize):
    steps: int
    every: int

    @property
    def state_bytes(self) -> int:
        return 3 * 4 * self.params  # float32 parameters + AdamW's two moments


FULL = Size(features=2048, hidden=4096, depth=3, classes=10, batch_size=16, steps=40, every=10, reps=3, timeout_s=900)
SMOKE = Size(features=32, hidden=64, depth=2, classes=4, batch_size=8, steps=12, every=4, reps=1, timeout_s=240)


@dataclass
class Result:
    mode: str
    rep: int
    stalls_s: list[float]
    step_ms: float  # median step time away from snapshots
    after_ms: list[float]  # per snapshot: mean time of the steps that follow it


def run_once(size: Size, mode: str, work: Path, rep: int) -> Result:
    out = work / "out"
    args = ["--strategy", "torchpass_ddp", "--devices", "1", "--max-steps", str(size.steps), *size.model_args(),
            "--out", str(out)]
    if mode != "none":
        args += ["--save-every", str(size.every)]
    if mode == "torchpass":
        args += ["--snapshot-dir", str(work / "snapshots")]
    if mode == "async-io":
        args += ["--async-io"]
    code = run_bounded(torchpass_cmd(1, 0, work / "run", args), worker_env(), size.timeout_s, work / "launcher.log")
    if code != 0:
        raise RunFailed(f"{mode}: launcher exited {code}\n{tail(work / 'launcher.log')}")
    if mode == "torchpass":
        events = read_events(work / "run")
        stalls = [e["stall_s"] for e in events if e["event"] == "snapshot_staged"]
        if not any(e["event"] == "snapshot_committed" for e in events):
            raise RunFailed("torchpass: no snapshot was committed")
    elif mode == "none":
        stalls = []
    else:
        stalls = [float(line.split()[1]) for line in (out / "saves_rank0.txt").read_text().splitlines()]
    expected = 0 if mode == "none" else len(range(size.every, size.steps, size.every))
    if len(stalls) != expected:
        raise RunFailed(f"{mode}: {len(stalls)} snapshots recorded, expected {expected}")
    perf = {step: p for step, _, p, _ in read_steps(out)[0]}
    deltas = {s: (perf[s] - perf[s - 1]) * 1e3 for s in perf if s - 1 in perf}
    snaps = range(size.every, size.steps, size.every) if mode != "none" else range(0)
    near = {s + k for s in snaps for k in range(DIP_STEPS + 1)}
    quiet = [d for s, d in deltas.items() if s not in near and s > 2]
    after = [statistics.mean(deltas[s + k] for k in range(1, DIP_STEPS + 1) if s + k in deltas) for s in snaps]
    return Result(mode, rep, stalls, statistics.median(quiet), after)


def render(size: Size, results: list[Result], smoke: bool, info: dict) -> str:
    by = {m: [r for r in results if r.mode == m] for m in MODES}
    base = statistics.median(r.step_ms for r in by["none"])
    stall = {m: statistics.median(s for r in rs for s in r.stalls_s) for m, rs in by.items() if m != "none" and rs}
    lines = ["## Snapshot cost: stall and slowdown (`benchmarks/snapshot_stall.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one repetition; the times are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        f"- Setup: 1 rank under `torchpass launch`, `torchpass_ddp`; MLP {size.features} -> {size.hidden}x"
        f"{size.depth} -> {size.classes} ({size.params:,} parameters), AdamW: {size.state_bytes / 1e6:.0f} MB of "
        f"parameters and optimizer state; a snapshot at the boundary of steps {size.every}, {2 * size.every}, ... "
        f"of {size.steps}; local disk.",
        "- Stall: torchpass = what the loop waited per snapshot (building the state, the copies made at once, and "
        "the fence before the optimizer step); sync / async-io = duration of `trainer.save_checkpoint` "
        "(with Lightning's `AsyncCheckpointIO` for async-io). Dip: mean step time of the "
        f"{DIP_STEPS} steps after a snapshot / the median step time of the runs without snapshots. Cost: what a "
        f"snapshot costs the run, the stall plus the time the {DIP_STEPS} steps after it took beyond that median "
        "(the background write competes with training for the cores).",
        "",
        "| Mode | Runs | Snapshots | Median stall (s) | Max stall (s) | Stall / sync stall | Dip after a snapshot "
        "| Cost per snapshot (s) | Cost / sync cost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cost = {m: statistics.median(s + DIP_STEPS * (a - base) / 1e3 for r in rs
                                 for s, a in zip(r.stalls_s, r.after_ms, strict=True))
            for m, rs in by.items() if m != "none" and rs}
    for m in MODES:
        rs = by[m]
        if not rs or m == "none":
            continue
        stalls = [s for r in rs for s in r.stalls_s]
        dips = [a / base for r in rs for a in r.after_ms]
        lines.append(f"| {m} | {len(rs)} | {len(stalls)} | {stall[m]:.4f} | {max(stalls):.4f} | "
                     f"{stall[m] / stall['sync']:.4f} | {statistics.median(dips):.3f} | {cost[m]:.4f} | "
                     f"{cost[m] / cost['sync']:.4f} |")
    lines.append(f"| none | {len(by['none'])} | 0 | - | - | - | (step {base:.1f} ms) | - | - |")
    ratio = cost["torchpass"] / cost["sync"]
    first = statistics.median(r.stalls_s[0] for r in by["torchpass"] if r.stalls_s)
    later = [s for r in by["torchpass"] for s in r.stalls_s[1:]]
    lines += ["", f"**A torchpass snapshot costs {ratio:.3f} of a synchronous save** (stall + slowdown after, "
              f"medians; the stall alone: {stall['torchpass'] / stall['sync']:.4f}).", ""]
    if later:
        lines += [f"The first snapshot of a run allocates the host staging copy while it fills it, and stalls longer "
                  f"(median {first:.4f} s, {first / stall['sync']:.3f} of a synchronous save); later snapshots reuse "
                  f"that copy (median {statistics.median(later):.4f} s, max {max(later):.4f} s).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, size, reps, info, work_root = begin(__doc__, argv, "snapshot", FULL, SMOKE)
    results: list[Result] = []
    for rep in range(reps):
        for mode in MODES:
            print(f"[snapshot] rep {rep} {mode} ...", flush=True)
            r = run_once(size, mode, work_root / f"rep{rep}-{mode}", rep)
            results.append(r)
            print(f"[snapshot] rep {rep} {mode}: stalls {[round(s, 4) for s in r.stalls_s]} s, step "
                  f"{r.step_ms:.1f} ms, after snapshots {[round(a, 1) for a in r.after_ms]} ms", flush=True)
    body = render(size, results, args.smoke, info)
    publish("snapshot", args.doc, body, work_root, {"machine": info, "size": asdict(size),
                                                     "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
