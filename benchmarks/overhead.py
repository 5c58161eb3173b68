"""Steady-state step time: each torchpass strategy against its plain Lightning counterpart.

No failure is injected: this is the price of being recoverable. Two groups on the same model, data and seed:
``torchpass_ddp`` (``torchpass launch``) vs Lightning's ``ddp`` (torchrun), and ``torchpass_fsdp`` with ring
replication off and every step (``torchpass_fsdp+replicas``: a replica round and the gradient log every
step) vs plain FSDP2 (Lightning's ``ModelParallelStrategy``, ``fully_shard`` on each ``nn.Linear`` as
``torchpass_fsdp`` does, torchrun); for a small MLP and a ~105M-parameter one. Each worker
is pinned to one core (its slot mod cores; by default 2 ranks, one per core, as one process per GPU on a
cluster). Runs alternate within each group, so slow drifts of the machine hit every contender alike.
Rank 0 records ``perf_counter`` after every optimizer step; a run's step time is the median of the
step-to-step deltas after the warmup steps, and each side's figure is the median over its runs.

Run ``python benchmarks/overhead.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import (
    STEADY_NOTE,
    STEADY_RANKS,
    MLPSize,
    RunFailed,
    attempt,
    bench_args,
    command_line,
    fresh_work_root,
    in_turn,
    install_cleanup,
    machine,
    machine_lines,
    median_ci,
    publish,
    read_steps,
    run_bounded,
    summarize,
    tail,
    torchpass_cmd,
    torchrun_cmd,
    worker_env,
)

# Each group: torchpass's contenders, then the plain strategy each is compared with.
PAIRS = {"ddp": ("torchpass_ddp", "ddp"), "fsdp": ("torchpass_fsdp", "torchpass_fsdp+replicas", "fsdp2")}
STRATEGY_ARGS = {
    "torchpass_ddp": ("--strategy", "torchpass_ddp"),
    "ddp": ("--strategy", "ddp"),
    "torchpass_fsdp": ("--strategy", "torchpass_fsdp", "--replicate-every", "0"),
    "torchpass_fsdp+replicas": ("--strategy", "torchpass_fsdp", "--replicate-every", "1"),
    "fsdp2": ("--strategy", "fsdp2"),
}
WHAT_DIFFERS = {
    "ddp": "both overlap bucketed gradient all-reduces with backward; `torchpass_ddp` keeps its buckets fixed "
           "(4 MB), reduces a copy (the local gradients stay intact for a retry) and commits each step with a "
           "small all-reduce (the commit vote, which also carries migration flags and step times); Lightning's "
           "`ddp` broadcasts a one-element tensor each step (its SIGTERM check)",
    "fsdp": "the same FSDP2 units, settings and collectives; `torchpass_fsdp` routes them through its relay group "
            "(so a failure can break them) and commits each step with a small all-reduce; "
            "`torchpass_fsdp+replicas` also hands its ring successor its rank-local state at each boundary, and "
            "in the commit each step's gradient shard (the gradient log), written into memory the successor maps, "
            "and packs its shard state at every boundary, in a background thread of the idle class, into memory "
            "that its ring neighbour maps",
}


@dataclass(frozen=True)
class Size(MLPSize):
    """Model and schedule of one model size."""

    name: str
    steps: int
    warmup: int


SMALL = Size(features=1024, hidden=1024, depth=4, classes=10, batch_size=64, reps=8, timeout_s=600, name="small",
             steps=70, warmup=10)
LARGE = Size(features=1024, hidden=4096, depth=7, classes=10, batch_size=64, reps=4, timeout_s=900, name="~105M",
             steps=16, warmup=4)
SMOKE = Size(features=32, hidden=64, depth=2, classes=4, batch_size=8, reps=1, timeout_s=240, name="tiny",
             steps=12, warmup=4)


@dataclass
class Result:
    """One run: the median step time after warmup and the spread of the deltas."""

    model: str
    strategy: str
    rep: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    steps_timed: int


def run_once(size: Size, strategy: str, ranks: int, work: Path, rep: int,
             extra: tuple[str, ...] = ("--pin",)) -> Result:
    """One timed run; ``extra``: more ``bench_train.py`` flags (by default each worker pinned to a core)."""
    out = work / "out"
    args = [*STRATEGY_ARGS[strategy], "--devices", str(ranks), "--max-steps", str(size.steps), "--accumulate", "1",
            *extra, *size.model_args(), "--out", str(out)]
    cmd = torchpass_cmd(ranks, 0, work / "run", args) if strategy.startswith("torchpass") else torchrun_cmd(ranks, args)
    code = run_bounded(cmd, worker_env(steady=True), size.timeout_s, work / "launcher.log")
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
    return Result(size.name, strategy, rep, statistics.median(deltas), deciles[0], deciles[-1], len(deltas))


def launch_of(strategy: str, ranks: int) -> str:
    if strategy.startswith("torchpass"):
        return f"`torchpass launch --nproc-per-node {ranks} --spares 0`"
    return f"`torchrun --nproc-per-node {ranks}`"


def render(sizes: list[Size], pairs: list[str], ranks: int, results: list[Result], failures: list[str], smoke: bool,
           info: dict[str, str]) -> str:
    lines = ["## Steady-state overhead (`benchmarks/overhead.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one repetition. It checks that the pipeline works; the times "
                  "are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    models = "; ".join(f"{s.name}: MLP {s.features} -> {s.hidden}x{s.depth} -> {s.classes} ({s.params:,} parameters), "
                       f"steps {s.warmup}..{s.steps - 1} timed after {s.warmup} warmup steps" for s in sizes)
    lines += [
        f"- Setup: {ranks} ranks, no spares, no failure, each worker pinned to one core (its slot mod cores); "
        f"batch {sizes[0].batch_size} per rank, no gradient accumulation, AdamW, gloo, one intra-op thread per "
        f"worker, no logging or checkpointing; {STEADY_NOTE}. Models: {models}.",
        "- Step time: median of rank 0's step-to-step `perf_counter` deltas after warmup; a side's figure is "
        "the median over its runs; each repetition runs a group's contenders back to back (in reverse order every "
        "other repetition). Ratio: the median over repetitions of torchpass / plain within the repetition, with a 95% "
        "distribution-free interval for that median (`median_ci` in `_harness.py`).",
        *(f"- What differs ({p}): {WHAT_DIFFERS[p]}." for p in pairs),
        "",
        "| Model | Strategy | Launch | Runs | Median step (ms) | Min-max of run medians (ms) "
        "| p10-p90 within runs (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios: list[str] = []
    for size, pair in itertools.product(sizes, pairs):
        by = {s: [r for r in results if r.model == size.name and r.strategy == s] for s in PAIRS[pair]}
        for s, rs in by.items():
            if rs:
                m, lo, hi = summarize(r.median_ms for r in rs)
                p10, p90 = statistics.median(r.p10_ms for r in rs), statistics.median(r.p90_ms for r in rs)
                lines.append(f"| {size.name} | `{s}` | {launch_of(s, ranks)} | {len(rs)} | {m:.1f} | {lo:.1f}-{hi:.1f} "
                             f"| {p10:.1f}-{p90:.1f} |")
        *contenders, baseline = PAIRS[pair]
        plain = by[baseline]
        for contender in contenders:
            mine = by[contender]
            per_pair = [a.median_ms / b.median_ms for a in mine for b in plain if a.rep == b.rep]
            if per_pair:
                ratio, lo, hi = median_ci(per_pair)
                of_medians = summarize(r.median_ms for r in mine)[0] / summarize(r.median_ms for r in plain)[0]
                ratios.append(f"| {size.name} | `{contender}` / `{baseline}` | **{ratio:.3f}** "
                              f"| {lo:.3f}-{hi:.3f} | {min(per_pair):.3f}-{max(per_pair):.3f} | {of_medians:.3f} |")
    lines += ["", "| Model | Step time ratio | Median over repetitions | 95% interval | Min-max | Ratio of the "
              "sides' medians |", "|---|---|---|---|---|---|", *ratios, ""]
    if failures:
        lines += [f"Failed runs ({len(failures)}), left out:", ""]
        lines += [f"- {f.splitlines()[0]}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def extra(p) -> None:
        p.add_argument("--ranks", type=int, default=STEADY_RANKS,
                       help="ranks per run (more than cores oversubscribes)")
        p.add_argument("--models", default="small,~105M", help="comma-separated: small, ~105M (smoke: tiny)")
        p.add_argument("--pairs", default="ddp,fsdp", help="comma-separated: ddp, fsdp")

    args = bench_args(__doc__, argv, extra)
    install_cleanup()
    known = {s.name: s for s in (SMALL, LARGE)}
    sizes = [SMOKE] if args.smoke else [known[m] for m in args.models.split(",")]
    pairs = args.pairs.split(",")
    section = "overhead" if args.ranks == STEADY_RANKS else f"overhead-{args.ranks}ranks"
    info = machine()
    work_root = fresh_work_root(section, args.smoke)
    results: list[Result] = []
    failures: list[str] = []
    for size in sizes:
        for rep in range(args.reps or size.reps):
            for strategy in (s for pair in pairs for s in in_turn(PAIRS[pair], rep)):
                tag = f"[overhead] {size.name} rep {rep} {strategy}"
                work = work_root / f"{size.name}-rep{rep}-{strategy}"
                r = attempt(tag, lambda: run_once(size, strategy, args.ranks, work, rep), failures,  # noqa: B023
                            strict=args.smoke)
                if r is not None:
                    results.append(r)
                    print(f"{tag}: median step {r.median_ms:.2f} ms over {r.steps_timed} steps "
                          f"(p10 {r.p10_ms:.2f}, p90 {r.p90_ms:.2f})", flush=True)
    body = render(sizes, pairs, args.ranks, results, failures, args.smoke, info)
    raw = {"machine": info, "sizes": [asdict(s) for s in sizes], "ranks": args.ranks,
           "results": [asdict(r) for r in results], "failures": failures}
    publish(section, args.doc, body, work_root, raw)
    expected = {(s.name, c) for s in sizes for p in pairs for c in PAIRS[p]}
    if {(r.model, r.strategy) for r in results} != expected:
        print("[overhead] missing results for some contender", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
