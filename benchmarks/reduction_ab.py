"""Per-step cost of torchpass's gradient reduction and commit, against DDP's, alternated step by step.

``overhead.py`` compares whole runs; on this 2-core VM adjacent runs of the same configuration differ by
up to 15%, more than the 1% being asked about. Here one process per rank holds one model and alternates,
step by step, the three ways of reducing and committing a step (``reduction_ab_worker.py``): DDP's reducer,
the same plus Lightning's per-batch SIGTERM broadcast (what Lightning's ``ddp`` strategy adds), and
torchpass's runtime (step boundary, fixed buckets, commit vote), each followed by the same AdamW step. A
drift of the machine hits the three arms of a cycle alike. The estimate is the median over cycles of the
ratio of the arms' step times within a cycle, with its 95% interval.

It leaves out what the arms share (forward, backward, AdamW) by construction, and what is not on this
path: Lightning's hooks (the same in both strategies apart from torchpass's step-boundary record, one
``fit_loop.state_dict()``), Accelerate's wrappers.

Run ``python benchmarks/reduction_ab.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import overhead
from _harness import (
    BENCH_DIR,
    STEADY_NOTE,
    STEADY_RANKS,
    MLPSize,
    RunFailed,
    attempt,
    bench_args,
    command_line,
    fresh_work_root,
    install_cleanup,
    machine,
    machine_lines,
    median_ci,
    publish,
    run_bounded,
    tail,
    worker_env,
)

WORKER = BENCH_DIR / "reduction_ab_worker.py"
ARMS = ("ddp", "ddp_sigterm", "torchpass")
RATIOS = (("torchpass", "ddp_sigterm", "`torchpass_ddp` / Lightning `ddp`"),
          ("torchpass", "ddp", "`TorchPass` / plain Accelerate (DDP)"))


@dataclass(frozen=True)
class Size(MLPSize):
    """Model and schedule of one model size: ``reps`` runs of ``cycles`` cycles (one step of each arm)."""

    name: str
    cycles: int
    warmup: int


def _schedule(model: overhead.Size, reps: int, timeout_s: float, cycles: int, warmup: int) -> Size:
    """``overhead.py``'s model and batch (the same figures side by side), with this script's schedule."""
    return Size(features=model.features, hidden=model.hidden, depth=model.depth, classes=model.classes,
                batch_size=model.batch_size, name=model.name, reps=reps, timeout_s=timeout_s, cycles=cycles,
                warmup=warmup)


SMALL = _schedule(overhead.SMALL, reps=3, timeout_s=900, cycles=400, warmup=10)
LARGE = _schedule(overhead.LARGE, reps=2, timeout_s=1200, cycles=45, warmup=3)
SMOKE = _schedule(overhead.SMOKE, reps=1, timeout_s=240, cycles=20, warmup=2)


def run_once(size: Size, ranks: int, work: Path) -> dict[str, list[float]]:
    """One run: per arm, the step time (ms) of every cycle after warmup, in cycle order."""
    out = work / "out"
    cmd = [sys.executable, "-m", "torchpass_plugins.cli", "launch", "--nproc-per-node", str(ranks), "--spares", "0",
           "--run-dir", str(work / "run"), str(WORKER), *size.model_args(), "--cycles", str(size.cycles),
           "--out", str(out)]
    code = run_bounded(cmd, worker_env(steady=True), size.timeout_s, work / "launcher.log")
    if code != 0:
        raise RunFailed(f"launcher exited {code}\n{tail(work / 'launcher.log')}")
    by_arm: dict[str, list[float]] = defaultdict(list)
    for cycle, arm, ms in json.loads((out / "steps_rank0.json").read_text()):
        if cycle >= size.warmup:
            by_arm[arm].append(ms)
    if sorted(by_arm) != sorted(ARMS) or {len(v) for v in by_arm.values()} != {size.cycles - size.warmup}:
        raise RunFailed(f"expected {size.cycles - size.warmup} timed cycles of {ARMS}, got "
                        f"{ {a: len(v) for a, v in by_arm.items()} }")
    return dict(by_arm)


def render(sizes: list[Size], ranks: int, runs: dict[str, list[dict[str, list[float]]]], failures: list[str],
           smoke: bool, info: dict[str, str]) -> str:
    lines = ["## Reduction and commit, alternated step by step (`benchmarks/reduction_ab.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one run. It checks that the pipeline works; the times are not a "
                  "measurement.", ""]
    lines += machine_lines(info, command_line())
    models = "; ".join(f"{s.name}: MLP {s.features} -> {s.hidden}x{s.depth} -> {s.classes} ({s.params:,} "
                       f"parameters), {s.reps} runs of {s.cycles} cycles, the first {s.warmup} not timed"
                       for s in sizes)
    lines += [
        f"- Setup: {ranks} ranks under `torchpass launch --spares 0`, each pinned to one core; one process per "
        f"rank holds one model and runs, in every cycle, one step of each arm in an order that rotates through "
        f"the 6 permutations; batch {sizes[0].batch_size} per rank, AdamW, gloo, one intra-op thread; "
        f"{STEADY_NOTE}. Models: {models}.",
        "- Arms: `ddp`: `DistributedDataParallel` (default buckets) on a plain gloo group; `ddp_sigterm`: the "
        "same plus the one-element broadcast Lightning's loop makes before each batch; `torchpass`: the "
        "runtime's step boundary, fixed 4 MB buckets on its transport, `Runtime.reduce_gradients` (the "
        "commit vote) and `write_back`. Each then applies the same AdamW step to the same parameters.",
        "- Step time: rank 0's `perf_counter` from the start of the step to the end of `optimizer.step`. Ratio: "
        "the median over cycles of the two arms' step times within the cycle, with a 95% distribution-free "
        "interval (`median_ci`); per run and over all runs' cycles.",
        "",
        "| Model | Run | Cycles | `ddp` median (ms) | `ddp_sigterm` median (ms) | `torchpass` median (ms) "
        "| torchpass / ddp_sigterm (95% interval) | torchpass / ddp (95% interval) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        size_runs = runs.get(size.name, [])
        rows = [(str(i), r) for i, r in enumerate(size_runs)]
        if len(size_runs) > 1:
            rows.append(("all", {a: [ms for r in size_runs for ms in r[a]] for a in ARMS}))
        for label, r in rows:
            cells = [f"{statistics.median(r[a]):.1f}" for a in ARMS]
            for mine, plain, _ in RATIOS:
                ratio, lo, hi = median_ci(a / b for a, b in zip(r[mine], r[plain], strict=True))
                cells.append(f"**{ratio:.4f}** ({lo:.4f}-{hi:.4f})")
            lines.append(f"| {size.name} | {label} | {len(r[ARMS[0]])} | " + " | ".join(cells) + " |")
    lines += ["", "What the ratios stand for: " + "; ".join(f"torchpass / {plain}: {what}" for _, plain, what in RATIOS)
              + ", on the path that differs.", ""]
    if failures:
        lines += [f"Failed runs ({len(failures)}), left out:", ""]
        lines += [f"- {f.splitlines()[0]}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def extra(p) -> None:
        p.add_argument("--models", default="small,~105M", help="comma-separated: small, ~105M (smoke: tiny)")

    args = bench_args(__doc__, argv, extra)
    install_cleanup()
    known = {s.name: s for s in (SMALL, LARGE)}
    sizes = [SMOKE] if args.smoke else [known[m] for m in args.models.split(",")]
    info = machine()
    work_root = fresh_work_root("reduction_ab", args.smoke)
    runs: dict[str, list[dict[str, list[float]]]] = defaultdict(list)
    failures: list[str] = []
    for size in sizes:
        for rep in range(args.reps or size.reps):
            tag = f"[reduction_ab] {size.name} run {rep}"
            work = work_root / f"{size.name}-run{rep}"
            r = attempt(tag, lambda: run_once(size, STEADY_RANKS, work), failures, strict=args.smoke)  # noqa: B023
            if r is not None:
                runs[size.name].append(r)
                print(f"{tag}: medians " + ", ".join(f"{a} {statistics.median(r[a]):.2f} ms" for a in ARMS),
                      flush=True)
    body = render(sizes, STEADY_RANKS, runs, failures, args.smoke, info)
    raw = {"machine": info, "sizes": [asdict(s) for s in sizes], "runs": runs, "failures": failures}
    publish("reduction_ab", args.doc, body, work_root, raw)
    if any(not runs.get(s.name) for s in sizes):
        print("[reduction_ab] missing results for some model", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
