"""``torchpass demo``: 3 active workers + 1 spare train; one is SIGKILLed mid-run; then the same job
runs without failures and the two results are compared bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from torchpass_plugins.observe.report import report, wide_console
from torchpass_plugins.testing.chaos.jobs import Job
from torchpass_plugins.testing.chaos.oracle import differences

TRAIN = Path(__file__).with_name("train.py")
WORLD = 3
_SHOWN = {
    "failure_detected": lambda e: f"failure detected: worker {e['worker']} (rank {e['rank']}) {e['why']}",
    "roster_published": lambda e: f"roster {e['gen']} published: promoted {e['promoted']}" if e["gen"] else None,
    "transport_rebuilt": lambda e: f"rank {e['rank']}: group of generation {e['gen']} up in {e['seconds']:.3f}s",
    "state_sent": lambda e: f"rank {e['rank']}: sent {e['bytes'] / 1e3:.0f} kB of state to rank {e['to']}"
    f" in {e['seconds']:.3f}s",
    "recovered": lambda e: f"rank {e['rank']}: recovered in {e['seconds']:.3f}s",
    "spare_joined": lambda e: f"refilled spare {e['worker']} joined the pool",
}


@dataclass
class _Run:
    run_dir: Path
    proc: subprocess.Popen

    def applied(self, rank: int) -> list[tuple[int, float]]:
        path = self.run_dir / "out" / f"applied_rank{rank}.txt"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        return [(int(step), float(t)) for step, t in rows]

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def pid_of_rank(self, rank: int) -> int:
        events = self.events()
        pids = {e["worker"]: e["pid"] for e in events if e["event"] == "worker_started"}
        roster = [e for e in events if e["event"] == "roster_published"][-1]
        return pids[roster["ranks"][rank]]


def _start(run_dir: Path, nproc: int, spares: int, steps: int) -> _Run:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torchpass_plugins.cli", "launch", "--nproc-per-node", str(nproc),
           "--spares", str(spares), "--run-dir", str(run_dir), str(TRAIN), "--devices", str(WORLD),
           "--max-steps", str(steps), "--out", str(run_dir / "out"), "--sleep-per-step", "0.05"]
    log = open(run_dir / "job.log", "wb")
    return _Run(run_dir, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def _follow(console: Console, run: _Run, steps: int, title: str, kill_at: int | None = None) -> float | None:
    """Show progress until the job ends; SIGKILL logical rank 1 at step ``kill_at``. Returns the kill time."""
    seen, killed_at = 0, None
    with Progress(TextColumn(title), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(title, total=steps)
        while run.proc.poll() is None:
            done = min(len(run.applied(r)) for r in range(WORLD))
            bar.update(task, completed=done)
            if kill_at is not None and killed_at is None and done >= kill_at:
                pid = run.pid_of_rank(1)
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
                bar.console.print(f"[bold red]SIGKILL[/] sent to pid {pid} (logical rank 1) at step {done}")
            events = run.events()
            for event in events[seen:]:
                text = _SHOWN.get(event["event"], lambda e: None)(event)
                if text:
                    bar.console.print(f"  [cyan]{text}[/]")
            seen = len(events)
            time.sleep(0.1)
        bar.update(task, completed=min(len(run.applied(r)) for r in range(WORLD)))
    return killed_at


def _regain(run: _Run, killed_at: float) -> tuple[int, float]:
    """The step in flight at the kill, and the time until every rank had applied it."""
    applied = [dict(run.applied(r)) for r in range(WORLD)]
    in_flight = min(step for step in applied[0] if max(a[step] for a in applied) > killed_at)
    return in_flight, max(a[in_flight] for a in applied) - killed_at


@dataclass
class DrillResult:
    """A kill-and-compare run: the job with a worker SIGKILLed against the same job without failures."""

    run_dir: Path  # the failing job's
    job_failed: bool  # a job exited non-zero
    found: list[str]  # the state differences, by rank
    applied_once: bool  # every optimizer step applied exactly once on every rank
    recomputed: int  # the most steps a rank applied more than once
    in_flight: int  # the step in flight at the kill
    regain_s: float

    @property
    def bit_exact(self) -> bool:
        return not self.job_failed and not self.found

    @property
    def passed(self) -> bool:
        return self.bit_exact and self.applied_once


def drill(root: Path, steps: int, console: Console | None = None) -> DrillResult:
    """3 active workers + 1 spare train for ``steps``; logical rank 1 is SIGKILLed mid-epoch; then the same
    job runs without failures and every rank's full state is compared bit for bit (``console``: progress)."""
    console = console or Console(quiet=True)
    failing = _start(root / "with-failure", nproc=WORLD + 1, spares=1, steps=steps)
    # mid-epoch (an epoch is 10 steps): a kill just after an epoch's last step lands in the epoch-end metric
    # synchronization, which no spare can join, and the job restarts instead (docs/failure-semantics.md)
    killed_at = _follow(console, failing, steps, "with failure", kill_at=steps // 3 + 5)
    console.print("Now the same job without failures, for comparison.")
    reference = _start(root / "reference", nproc=WORLD, spares=0, steps=steps)
    _follow(console, reference, steps, "reference   ")
    if failing.proc.returncode or reference.proc.returncode or killed_at is None:
        return DrillResult(failing.run_dir, True, [], False, 0, -1, float("nan"))
    expected, got = Job(reference.run_dir), Job(failing.run_dir)
    found = [d for r in range(WORLD) for d in differences(expected.state(r), got.state(r), f"rank{r}")]
    counts = [[s for s, _ in failing.applied(r)] for r in range(WORLD)]
    in_flight, regain = _regain(failing, killed_at)
    return DrillResult(failing.run_dir, False, found, all(c == list(range(steps)) for c in counts),
                       max(len(c) - len(set(c)) for c in counts), in_flight, regain)


def run_demo(steps: int = 60, run_dir: str = "torchpass_runs/demo") -> int:
    console = wide_console()
    root = Path(run_dir)
    console.rule("[bold]torchpass demo: lose a worker, not your progress")
    console.print(f"3 active workers + 1 spare train a small classifier for {steps} steps (AdamW, dropout, "
                  "per-step LR schedule, gradient accumulation 2, BatchNorm, augmenting loader workers, a metric). "
                  "One worker is SIGKILLed mid-run.")
    result = drill(root, steps, console)
    if result.job_failed:
        console.print(f"[red]a job failed; see {root}/*/job.log")
        return 1
    table = Table(title="Result")
    table.add_column("check")
    table.add_column("value")
    table.add_row("every rank's full state bit-identical to the failure-free run (parameters, buffers, optimizer, "
                  "schedulers, loop progress, metrics, RNG)",
                  "[green]yes" if result.bit_exact else f"[red]no: {result.found[0]}")
    table.add_row("every optimizer step applied exactly once on every rank",
                  "[green]yes" if result.applied_once else "[red]no")
    table.add_row("steps recomputed (applied again by a rank)", str(result.recomputed))
    table.add_row(f"regain time (kill -> every rank past step {result.in_flight})", f"{result.regain_s:.2f} s")
    table.add_row("event log", str(result.run_dir / "events.jsonl"))
    console.print(table)
    console.rule("torchpass report " + str(result.run_dir))
    report(result.run_dir, console)
    return 0 if result.passed else 1
