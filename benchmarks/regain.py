"""Regain time after a SIGKILL: torchpass hot swap vs checkpoint-restart of the same training.

Regain = from the kill until every logical rank has completed the optimizer step that was in flight.
torchpass: ``torchpass launch --nproc-per-node 4 --spares 1``; the spare takes the dead rank over live,
so no step is recomputed. Checkpoint-restart: plain Lightning ``ddp`` under
``torchrun --max-restarts 1`` (torchrun tears the group down and restarts it; its best case, since no
scheduler round-trip is involved), ``ModelCheckpoint(every_n_train_steps=10, save_last=True)`` and
``fit(ckpt_path="last")``; regain then includes restart, restore and the steps since the checkpoint.

Run ``python benchmarks/regain.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _harness import (
    MLPSize,
    RunFailed,
    attempt,
    begin,
    command_line,
    machine_lines,
    publish,
    read_events,
    read_steps,
    run_bounded,
    summarize,
    tail,
    torchpass_cmd,
    torchrun_cmd,
    worker_env,
)

TORCHPASS, CKPT = "torchpass", "ckpt-restart"


@dataclass(frozen=True)
class Size(MLPSize):
    """Model, schedule and failure of one benchmark mode."""

    accumulate: int
    ckpt_every: int
    kill_step: int
    max_steps: int
    devices: int = 3  # logical ranks (smoke: 2, fewer processes to start)


FULL = Size(features=512, hidden=1024, depth=3, classes=10, batch_size=32, accumulate=2, ckpt_every=10,
            kill_step=25, max_steps=30, reps=3, timeout_s=600)
SMOKE = Size(features=16, hidden=32, depth=1, classes=4, batch_size=8, accumulate=2, ckpt_every=4,
             kill_step=6, max_steps=8, reps=1, timeout_s=240, devices=2)
KILL_RANK = 1


@dataclass
class Result:
    """One run: the regain time and what it is made of."""

    mode: str
    rep: int
    regain_s: float
    per_rank_s: dict[int, float]
    first_step_after_kill_s: float
    steps_recomputed: int
    exit_code: int
    kill_time: float
    extra: dict[str, float] = field(default_factory=dict)


def script_args(size: Size, out: Path, strategy: str, ckpt: bool) -> list[str]:
    args = ["--strategy", strategy, "--devices", str(size.devices), "--max-steps", str(size.max_steps),
            "--accumulate", str(size.accumulate), *size.model_args(), "--out", str(out), "--kill-rank", str(KILL_RANK),
            "--kill-step", str(size.kill_step)]
    return [*args, "--ckpt-every", str(size.ckpt_every)] if ckpt else args


def measure(mode: str, rep: int, out: Path, kill_step: int, ranks: int, exit_code: int) -> Result:
    """Regain from the records: the victim's kill mark, then each rank's first completion of ``kill_step``."""
    marks_path = out / f"kill_marks_rank{KILL_RANK}.txt"
    marks = [float(line.split()[1]) for line in marks_path.read_text().splitlines()] if marks_path.exists() else []
    if not marks:
        raise RunFailed(f"{mode}: no kill mark: the fault never fired")
    kill = min(marks)  # later marks come from the worker that replayed the step
    records = read_steps(out)
    if sorted(records) != list(range(ranks)):
        raise RunFailed(f"{mode}: step records for ranks {sorted(records)}, expected 0..{ranks - 1}")
    per_rank: dict[int, float] = {}
    recomputed = 0
    for rank, rows in records.items():
        after = [(step, t) for step, t, _, _ in rows if t > kill]
        done = [t for step, t in after if step == kill_step]
        if not done:
            raise RunFailed(f"{mode}: rank {rank} never completed step {kill_step} after the kill")
        if any(step == kill_step and t <= kill for step, t, _, _ in rows):
            raise RunFailed(f"{mode}: rank {rank} completed step {kill_step} before the kill mark")
        per_rank[rank] = min(done) - kill
        # A step this rank completes again after having completed it before the kill. (Merely finishing
        # step K-1 after the victim's mark is scheduling skew between ranks, not a recomputation.)
        before = {step for step, t, _, _ in rows if t <= kill}
        recomputed = max(recomputed, len({step for step, _ in after if step in before}))
    first = min(t for rows in records.values() for _, t, _, _ in rows if t > kill) - kill
    return Result(mode, rep, max(per_rank.values()), per_rank, first, recomputed, exit_code, kill)


def run_torchpass(size: Size, work: Path, rep: int, extra: Sequence[str] = ()) -> Result:
    """One run with the kill; ``extra``: more ``bench_train.py`` flags (``torchft_compare.py`` saves weights)."""
    run_dir, out = work / "run", work / "out"
    env = worker_env()
    env["TORCHPASS_FAULTS"] = f"kill@rank={KILL_RANK},step={size.kill_step},phase=reduce"
    cmd = torchpass_cmd(size.devices + 1, 1, run_dir, [*script_args(size, out, "torchpass_ddp", ckpt=False), *extra])
    code = run_bounded(cmd, env, size.timeout_s, work / "launcher.log")
    if code != 0:
        raise RunFailed(f"torchpass launch exited {code}\n{tail(work / 'launcher.log')}")
    result = measure(TORCHPASS, rep, out, size.kill_step, size.devices, code)
    events = read_events(run_dir)
    kill = result.kill_time
    exited = [e for e in events if e["event"] == "worker_exited" and e.get("code") == -9]
    detected = [e for e in events if e["event"] == "failure_detected"]
    if not exited or not detected:
        raise RunFailed(f"torchpass: no worker_exited(-9)/failure_detected event in {run_dir / 'events.jsonl'}")
    result.extra = {
        "worker_exited_s": exited[0]["time"] - kill,
        "failure_detected_s": detected[0]["time"] - kill,
        "recovered_max_s": max((e["seconds"] for e in events if e["event"] == "recovered"), default=float("nan")),
        "state_bytes": float(sum(e["bytes"] for e in events if e["event"] == "state_received")),
    }
    return result


def run_ckpt_restart(size: Size, work: Path, rep: int) -> Result:
    out = work / "out"
    cmd = torchrun_cmd(size.devices, script_args(size, out, "ddp", ckpt=True), max_restarts=1)
    code = run_bounded(cmd, worker_env(restarts=True), size.timeout_s, work / "launcher.log")
    if code != 0:
        raise RunFailed(f"torchrun exited {code}\n{tail(work / 'launcher.log')}")
    result = measure(CKPT, rep, out, size.kill_step, size.devices, code)
    pids = {pid for rows in read_steps(out).values() for *_, pid in rows}
    if len(pids) < 2 * size.devices:
        raise RunFailed(f"ckpt-restart: expected a restarted worker group, saw {len(pids)} worker pids")
    return result


def render(size: Size, results: list[Result], failures: list[str], smoke: bool, info: dict[str, str]) -> str:
    by_mode = {m: [r for r in results if r.mode == m] for m in (TORCHPASS, CKPT)}
    med = {m: summarize(r.regain_s for r in rs) for m, rs in by_mode.items()}
    ratio = med[CKPT][0] / med[TORCHPASS][0] if by_mode[TORCHPASS] and by_mode[CKPT] else float("nan")
    tp, ck = by_mode[TORCHPASS], by_mode[CKPT]

    def notes_tp() -> str:
        if not tp:
            return ""
        exited = summarize(r.extra["worker_exited_s"] for r in tp)[0]
        detected = summarize(r.extra["failure_detected_s"] for r in tp)[0]
        state = summarize(r.extra["state_bytes"] for r in tp)[0]
        return (f"agent saw the exit after {exited:.3f} s, roster change at {detected:.3f} s; "
                f"{state / 1e6:.2f} MB of state sent to the spare")

    def notes_ck() -> str:
        if not ck:
            return ""
        first = summarize(r.first_step_after_kill_s for r in ck)[0]
        return f"first step completed {first:.2f} s after the kill (restart + restore), then the recomputation"

    def row(mode: str, launch: str, rs: list[Result], notes: str) -> str:
        m, lo, hi = med[mode]
        steps = summarize(r.steps_recomputed for r in rs)[0]
        return f"| {mode} | {launch} | {len(rs)} | {m:.2f} | {lo:.2f}-{hi:.2f} | {steps:.0f} | {notes} |"

    target = "met" if ratio >= 20 else "not met"
    lines = ["## Regain time after a SIGKILL (`benchmarks/regain.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one repetition. It checks that the pipeline works; the times "
                  "are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        f"- Setup: {size.devices} logical ranks; MLP {size.features} -> {size.hidden}x{size.depth} -> {size.classes} "
        f"({size.params:,} parameters), batch {size.batch_size} per rank, gradient accumulation "
        f"{size.accumulate}, AdamW, gloo; one intra-op thread per worker. Logical rank {KILL_RANK} is SIGKILLed in "
        f"step {size.kill_step} (0-based), in its last micro-batch, before the step's gradient all-reduce "
        "completes: under torchpass inside that all-reduce "
        f"(`TORCHPASS_FAULTS=kill@rank={KILL_RANK},step={size.kill_step},phase=reduce`), under plain DDP (which "
        "all-reduces inside backward) just before that backward. Repetitions alternate the two modes.",
        "- Regain: from the victim's own timestamp written just before the kill until the last logical rank "
        f"has completed step {size.kill_step} (each rank logs `time.time()` after every optimizer step). Steps "
        "recomputed: steps a rank completed both before and after the kill (max over ranks).",
        f"- Checkpoint-restart: `ModelCheckpoint(every_n_train_steps={size.ckpt_every}, save_last=True)`, "
        "`fit(ckpt_path=\"last\")` when `last.ckpt` exists; torchrun `--max-restarts 1 --monitor-interval 0.1` "
        "restarts the whole group in place (no scheduler delay, so this is its best case).",
        "",
        "| Mode | Launch | Runs | Regain median (s) | Min-max (s) | Steps recomputed | Notes |",
        "|---|---|---|---|---|---|---|",
    ]
    if tp:
        launch = f"`torchpass launch --nproc-per-node {size.devices + 1} --spares 1`, `torchpass_ddp`"
        lines.append(row(TORCHPASS, launch, tp, notes_tp()))
    if ck:
        lines.append(row(CKPT, f"`torchrun --nproc-per-node {size.devices} --max-restarts 1`, `ddp`", ck, notes_ck()))
    lines += ["", f"**Checkpoint-restart / torchpass regain: {ratio:.1f}x** (target >= 20x: {target}).", ""]
    lines += ["Per run:", "", "| Run | Mode | Regain (s) | Per rank (s) | Steps recomputed |", "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.rep, r.mode != TORCHPASS)):
        ranks = ", ".join(f"{k}: {v:.2f}" for k, v in sorted(r.per_rank_s.items()))
        lines.append(f"| {r.rep} | {r.mode} | {r.regain_s:.2f} | {ranks} | {r.steps_recomputed} |")
    if failures:
        lines += ["", f"Failed runs ({len(failures)}), left out of the medians:", ""]
        lines += [f"- {f.splitlines()[0]}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, size, reps, info, work_root = begin(__doc__, argv, "regain", FULL, SMOKE)
    results: list[Result] = []
    failures: list[str] = []
    for rep in range(reps):
        for mode, fn in ((TORCHPASS, run_torchpass), (CKPT, run_ckpt_restart)):
            work = work_root / f"rep{rep}-{mode}"
            r = attempt(f"[regain] rep {rep} {mode}", lambda: fn(size, work, rep), failures,  # noqa: B023
                        strict=args.smoke)
            if r is not None:
                results.append(r)
                print(f"[regain] rep {rep} {mode}: regain {r.regain_s:.3f} s, recomputed {r.steps_recomputed} step(s), "
                      f"per rank {({k: round(v, 3) for k, v in r.per_rank_s.items()})} {r.extra}", flush=True)
    body = render(size, results, failures, args.smoke, info)
    raw = {"machine": info, "size": asdict(size), "results": [asdict(r) for r in results], "failures": failures}
    publish("regain", args.doc, body, work_root, raw)
    modes = {r.mode for r in results}
    if modes != {TORCHPASS, CKPT}:
        print(f"[regain] missing results for {sorted({TORCHPASS, CKPT} - modes)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
