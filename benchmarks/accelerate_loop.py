"""The Accelerate loop API: steady-state step time with and without torchpass, and regain after a SIGKILL.

Overhead: ``benchmarks/bench_accelerate.py`` under ``accelerate launch --multi_gpu --num_processes 3 -m
torchpass_plugins.run --spares 0`` (protected) vs the same script under plain ``accelerate launch
--num_processes 3`` (``TorchPass`` passes through; Accelerate's DDP reduces), runs interleaved. Regain:
4 processes with 1 spare, logical rank 1 SIGKILLed in the gradient reduction of a step; from the victim's
mark to the last rank's completion of that step.

Run ``python benchmarks/accelerate_loop.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import (
    BENCH_DIR,
    STEADY_NOTE,
    STEADY_RANKS,
    RunFailed,
    begin,
    command_line,
    free_port,
    in_turn,
    machine_lines,
    median_ci,
    publish,
    read_events,
    read_steps,
    run_bounded,
    summarize,
    tail,
    worker_env,
)
from regain import KILL_RANK, measure

SCRIPT = BENCH_DIR / "bench_accelerate.py"
PROTECTED, PLAIN = "torchpass", "plain"


@dataclass(frozen=True)
class Size:
    features: int
    hidden: int
    depth: int
    batch_size: int
    steps: int
    warmup: int
    kill_step: int
    reps: int
    timeout_s: float
    regain_ranks: int = 3  # the regain's active ranks (+ 1 spare)

    @property
    def params(self) -> int:
        return (self.features * self.hidden + self.hidden + (self.depth - 1) * (self.hidden**2 + self.hidden)
                + self.hidden * 10 + 10)

    def args(self, out: Path, accumulate: int, kill: bool) -> list[str]:
        args = ["--steps", str(self.steps), "--accumulate", str(accumulate), "--batch-size", str(self.batch_size),
                "--features", str(self.features), "--hidden", str(self.hidden), "--depth", str(self.depth),
                "--out", str(out)]
        return [*args, "--kill-rank", str(KILL_RANK), "--kill-step", str(self.kill_step)] if kill else args


FULL = Size(features=1024, hidden=1024, depth=4, batch_size=64, steps=70, warmup=10, kill_step=25, reps=6,
            timeout_s=600)
SMOKE = Size(features=32, hidden=64, depth=2, batch_size=8, steps=12, warmup=4, kill_step=6, reps=1, timeout_s=240,
             regain_ranks=2)


def launch(processes: int, protected: bool, spares: int, run_dir: Path, script_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port())]
    if protected:
        cmd += ["-m", "torchpass_plugins.run", "--spares", str(spares), "--run-dir", str(run_dir)]
    return [*cmd, str(SCRIPT), *script_args]


def step_time(size: Size, mode: str, work: Path) -> float:
    out = work / "out"
    cmd = launch(STEADY_RANKS, mode == PROTECTED, 0, work / "run", [*size.args(out, accumulate=1, kill=False), "--pin"])
    code = run_bounded(cmd, worker_env(steady=True), size.timeout_s, work / "launcher.log")
    if code != 0:
        raise RunFailed(f"{mode}: exited {code}\n{tail(work / 'launcher.log')}")
    rows = read_steps(out).get(0, [])
    if [s for s, *_ in rows] != list(range(size.steps)):
        raise RunFailed(f"{mode}: rank 0 recorded steps {[s for s, *_ in rows]}")
    perf = [p for _, _, p, _ in rows][size.warmup:]
    return statistics.median((b - a) * 1e3 for a, b in itertools.pairwise(perf))


def regain(size: Size, work: Path, rep: int) -> dict[str, float]:
    out, run_dir = work / "out", work / "run"
    env = {**worker_env(), "TORCHPASS_FAULTS": f"kill@rank={KILL_RANK},step={size.kill_step},phase=reduce"}
    cmd = launch(size.regain_ranks + 1, True, 1, run_dir, size.args(out, accumulate=2, kill=True))
    code = run_bounded(cmd, env, size.timeout_s, work / "launcher.log")
    if code != 0:
        raise RunFailed(f"regain: exited {code}\n{tail(work / 'launcher.log')}")
    result = measure(PROTECTED, rep, out, size.kill_step, size.regain_ranks, code)
    events = read_events(run_dir)
    return {"regain_s": result.regain_s, "steps_recomputed": result.steps_recomputed,
            "state_bytes": sum(e["bytes"] for e in events if e["event"] == "state_received"),
            "recovered_max_s": max((e["seconds"] for e in events if e["event"] == "recovered"), default=float("nan"))}


def render(size: Size, times: dict[str, list[float]], regains: list[dict[str, float]], smoke: bool,
           info: dict[str, str]) -> str:
    med = {m: summarize(v) for m, v in times.items()}
    pairs = [a / b for a, b in zip(times[PROTECTED], times[PLAIN], strict=False)]
    lines = ["## Accelerate loop: overhead and regain (`benchmarks/accelerate_loop.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one repetition; checks the pipeline only.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        f"- Setup: `benchmarks/bench_accelerate.py`, a plain Accelerate loop (`Accelerator(cpu=True)`, seedable "
        f"shuffled loader, AdamW); MLP {size.features} -> {size.hidden}x{size.depth} -> 10 ({size.params:,} "
        f"parameters), batch {size.batch_size} per rank, gloo, one intra-op thread per worker.",
        f"- Step time: {STEADY_RANKS} ranks, each pinned to one core, no accumulation, median of rank 0's "
        f"step-to-step deltas over steps {size.warmup}..{size.steps - 1}; each repetition runs protected and "
        "plain back to back (in turn first). "
        f"Protected: `accelerate launch --multi_gpu --num_processes {STEADY_RANKS} -m torchpass_plugins.run "
        f"--spares 0`; plain: `accelerate launch --multi_gpu --num_processes {STEADY_RANKS}` (Accelerate's DDP; "
        f"`TorchPass` passes through); {STEADY_NOTE}.",
        "",
        "| Loop | Runs | Median step (ms) | Min-max of run medians (ms) |",
        "|---|---|---|---|",
    ]
    for mode, label in ((PROTECTED, "with torchpass"), (PLAIN, "without torchpass")):
        m, lo, hi = med[mode]
        lines.append(f"| {label} | {len(times[mode])} | {m:.1f} | {lo:.1f}-{hi:.1f} |")
    if pairs:
        ratio, lo, hi = median_ci(pairs)
        lines += ["", f"**Step time with / without torchpass: {ratio:.3f}**: the median over {len(pairs)} repetitions "
                  f"of the ratio within each; 95% distribution-free interval {lo:.3f}-{hi:.3f} (`median_ci` in "
                  f"`_harness.py`), min-max {min(pairs):.3f}-{max(pairs):.3f}; ratio of the sides' medians "
                  f"{med[PROTECTED][0] / med[PLAIN][0]:.3f}.", ""]
    if regains:
        r = {k: statistics.median(x[k] for x in regains) for k in regains[0]}
        lines += [
            f"Regain ({len(regains)} runs, medians): {size.regain_ranks} active + 1 spare under `accelerate launch "
            f"--num_processes {size.regain_ranks + 1} -m torchpass_plugins.run --spares 1`, gradient accumulation 2, "
            f"logical rank {KILL_RANK} SIGKILLed in "
            f"the gradient reduction of step {size.kill_step}; from the victim's mark until every rank has "
            "completed that step.",
            "",
            "| Regain (s) | Longest `recovered` (s) | State to the spare (bytes) | Steps recomputed |",
            "|---|---|---|---|",
            f"| {r['regain_s']:.2f} | {r['recovered_max_s']:.2f} | {int(r['state_bytes']):,} | "
            f"{int(r['steps_recomputed'])} |",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, size, reps, info, work_root = begin(__doc__, argv, "accelerate", FULL, SMOKE)
    times: dict[str, list[float]] = {PROTECTED: [], PLAIN: []}
    regains: list[dict[str, float]] = []
    try:
        for rep in range(reps):
            for mode in in_turn((PROTECTED, PLAIN), rep):
                times[mode].append(step_time(size, mode, work_root / f"rep{rep}-{mode}"))
                print(f"[accelerate] rep {rep} {mode}: median step {times[mode][-1]:.2f} ms", flush=True)
            regains.append(regain(size, work_root / f"regain{rep}", rep))
            print(f"[accelerate] rep {rep} regain {regains[-1]['regain_s']:.2f} s", flush=True)
    except RunFailed as exc:
        print(f"[accelerate] FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    body = render(size, times, regains, args.smoke, info)
    publish("accelerate", args.doc, body, work_root, {"machine": info, "size": asdict(size), "times": times,
                                                      "regains": regains})
    return 0


if __name__ == "__main__":
    sys.exit(main())
