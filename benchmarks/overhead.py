"""Steady-state step time: ``torchpass_ddp`` under ``torchpass launch`` vs plain Lightning ``ddp`` under torchrun.

No failure is injected: this is the price of being recoverable. Same model, data and seed in both; runs
alternate (torchpass, plain, torchpass, plain, ...) so slow drifts of the machine hit both alike. Rank 0
records ``perf_counter`` after every optimizer step; a run's step time is the median of the step-to-step
deltas after the warmup steps, and each side's figure is the median over its runs.

Run ``python benchmarks/overhead.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from _harness import (
    MLPSize,
    RunFailed,
    bench_args,
    command_line,
    fresh_work_root,
    install_cleanup,
    machine,
    machine_lines,
    publish,
    read_steps,
    run_bounded,
    summarize,
    tail,
    torchpass_cmd,
    torchrun_cmd,
    worker_env,
)

TORCHPASS, PLAIN = "torchpass_ddp", "ddp"


@dataclass(frozen=True)
class Size(MLPSize):
    """Model and schedule of one benchmark mode."""

    steps: int
    warmup: int
    ranks: int = 3


FULL = Size(features=1024, hidden=1024, depth=4, classes=10, batch_size=64, steps=70, warmup=10, reps=3,
            timeout_s=600)
SMOKE = Size(features=32, hidden=64, depth=2, classes=4, batch_size=8, steps=12, warmup=4, reps=1, timeout_s=240)


@dataclass
class Result:
    """One run: the median step time after warmup and the spread of the deltas."""

    strategy: str
    rep: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    steps_timed: int


def script_args(size: Size, strategy: str, out: Path) -> list[str]:
    return ["--strategy", strategy, "--devices", str(size.ranks), "--max-steps", str(size.steps), "--accumulate", "1",
            *size.model_args(), "--out", str(out)]


def run_once(size: Size, strategy: str, work: Path, rep: int) -> Result:
    out = work / "out"
    args = script_args(size, strategy, out)
    if strategy == TORCHPASS:
        cmd = torchpass_cmd(size.ranks, 0, work / "run", args)
    else:
        cmd = torchrun_cmd(size.ranks, args)
    code = run_bounded(cmd, worker_env(), size.timeout_s, work / "launcher.log")
    if code != 0:
        raise RunFailed(f"{strategy}: launcher exited {code}\n{tail(work / 'launcher.log')}")
    rows = read_steps(out).get(0, [])
    steps = [step for step, *_ in rows]
    if steps != list(range(size.steps)):
        raise RunFailed(f"{strategy}: rank 0 recorded steps {steps}, expected 0..{size.steps - 1}")
    perf = [p for _, _, p, _ in rows]
    deltas = [(b - a) * 1e3 for a, b in itertools.pairwise(perf[size.warmup :])]
    if not deltas:
        raise RunFailed(f"{strategy}: no step after warmup to time")
    deciles = statistics.quantiles(deltas, n=10) if len(deltas) >= 2 else [deltas[0]] * 9
    return Result(strategy, rep, statistics.median(deltas), deciles[0], deciles[-1], len(deltas))


def render(size: Size, results: list[Result], failures: list[str], smoke: bool, info: dict[str, str]) -> str:
    by = {s: [r for r in results if r.strategy == s] for s in (TORCHPASS, PLAIN)}
    med = {s: summarize(r.median_ms for r in rs) for s, rs in by.items()}
    ratio = med[TORCHPASS][0] / med[PLAIN][0] if by[TORCHPASS] and by[PLAIN] else float("nan")
    pairs = [a.median_ms / b.median_ms for a in by[TORCHPASS] for b in by[PLAIN] if a.rep == b.rep]
    launch = {TORCHPASS: f"`torchpass launch --nproc-per-node {size.ranks} --spares 0`",
              PLAIN: f"`torchrun --nproc-per-node {size.ranks}`"}
    lines = ["## Steady-state overhead (`benchmarks/overhead.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one repetition. It checks that the pipeline works; the times "
                  "are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        f"- Setup: {size.ranks} ranks, no spares, no failure; MLP {size.features} -> {size.hidden}x{size.depth} -> "
        f"{size.classes} ({size.params:,} parameters), batch {size.batch_size} per rank, no gradient "
        "accumulation, AdamW, gloo, one intra-op thread per worker, no logging or checkpointing.",
        f"- Step time: median of rank 0's step-to-step `perf_counter` deltas over steps {size.warmup}.."
        f"{size.steps - 1} (the first {size.warmup} steps are warmup); runs alternate torchpass / plain.",
        "- What differs: both overlap bucketed gradient all-reduces with backward; `torchpass_ddp` keeps its "
        "buckets fixed (4 MB), reduces a copy (the local gradients stay intact for a retry) and commits each step "
        "with a small all-reduce (the commit vote, 2 x ranks values that also carry migration flags and step "
        "times); Lightning's `ddp` broadcasts a one-element tensor each "
        "step (its SIGTERM check).",
        "",
        "| Strategy | Launch | Runs | Median step (ms) | Min-max of run medians (ms) | p10-p90 within runs (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for s, rs in by.items():
        if not rs:
            continue
        m, lo, hi = med[s]
        p10, p90 = statistics.median(r.p10_ms for r in rs), statistics.median(r.p90_ms for r in rs)
        lines.append(f"| `{s}` | {launch[s]} | {len(rs)} | {m:.1f} | {lo:.1f}-{hi:.1f} | {p10:.1f}-{p90:.1f} |")
    spread = f"; per interleaved pair {min(pairs):.3f}-{max(pairs):.3f}" if pairs else ""
    lines += ["", f"**Step time torchpass / plain: {ratio:.3f}** (medians{spread}).", ""]
    if failures:
        lines += [f"Failed runs ({len(failures)}), left out:", ""]
        lines += [f"- {f.splitlines()[0]}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__, argv, lambda p: p.add_argument(
        "--ranks", type=int, default=3, help="ranks per run (3 on 2 cores oversubscribes; 2 does not)"))
    install_cleanup()
    size = replace(SMOKE if args.smoke else FULL, ranks=args.ranks)
    section = "overhead" if args.ranks == 3 else f"overhead-{args.ranks}ranks"
    reps = args.reps or size.reps
    info = machine()
    work_root = fresh_work_root(section, args.smoke)
    results: list[Result] = []
    failures: list[str] = []
    for rep in range(reps):
        for strategy in (TORCHPASS, PLAIN):
            print(f"[overhead] rep {rep} {strategy} ...", flush=True)
            try:
                r = run_once(size, strategy, work_root / f"rep{rep}-{strategy}", rep)
            except RunFailed as exc:
                failures.append(f"rep {rep} {strategy}: {exc}")
                print(f"[overhead] rep {rep} {strategy} FAILED: {exc}", file=sys.stderr, flush=True)
                if args.smoke:
                    return 1
                continue
            results.append(r)
            print(f"[overhead] rep {rep} {strategy}: median step {r.median_ms:.2f} ms over {r.steps_timed} steps "
                  f"(p10 {r.p10_ms:.2f}, p90 {r.p90_ms:.2f})", flush=True)
    body = render(size, results, failures, args.smoke, info)
    raw = {"machine": info, "size": asdict(size), "results": [asdict(r) for r in results], "failures": failures}
    publish(section, args.doc, body, work_root, raw)
    if {r.strategy for r in results} != {TORCHPASS, PLAIN}:
        print("[overhead] missing results for one strategy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
