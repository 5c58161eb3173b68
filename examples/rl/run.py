"""Run the RL example end to end: a trainer (2 active ranks + 1 spare, under ``torchpass launch``) and two
rollout replicas; trainer rank 0, the one that publishes, is SIGKILLed mid-run and a replica is SIGKILLed
and restarted. Then the trainer runs again on the same batches without failures, and the results are
compared. Prints what happened and writes ``RUN_DIR/summary.json``; exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from torchpass_plugins.observe.events import read_events
from torchpass_plugins.observe.report import report

HERE = Path(__file__).resolve().parent
RANKS, REPLICAS = 2, 2
MARKER = ".torchpass-rl-example"  # in a run directory this script made (the only kind it deletes)


def start_trainer(run: Path, rollouts: Path, steps: int, spares: int, faults: str, env: dict,
                  port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torchpass_plugins.cli", "launch", "--nproc-per-node", str(RANKS + spares),
           "--spares", str(spares), "--run-dir", str(run), str(HERE / "trainer.py"), str(rollouts),
           "--publish", f"tcp://127.0.0.1:{port}", "--ranks", str(RANKS), "--steps", str(steps),
           "--out", str(run / "trained.pt")]
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "job.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**env, "TORCHPASS_FAULTS": faults} if faults else env)


def start_replica(i: int, endpoint: str, rollouts: Path, steps: int, events: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE / "rollout.py"), endpoint, str(rollouts), "--replica", str(i), "--replicas",
           str(REPLICAS), "--ranks", str(RANKS), "--steps", str(steps), "--events", str(events)]
    with open(events.parent / f"replica{i}.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--run-dir", type=Path, default=Path("torchpass_runs/rl"))
    p.add_argument("--kill-step", type=int, default=12, help="trainer rank 0 is SIGKILLed at this step")
    p.add_argument("--port", type=int, default=29600, help="where the trainer publishes its weights")
    args = p.parse_args()
    console = Console(width=None if Console().is_terminal else 120)
    root, rollouts = args.run_dir.resolve(), args.run_dir.resolve() / "rollouts"
    if root.exists() and any(root.iterdir()):
        if not (root / MARKER).exists():
            p.error(f"{root} is not empty and not an earlier run of this example: choose another --run-dir")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).touch()
    env = {**os.environ, "TORCHPASS_WEIGHTS_TOKEN": secrets.token_hex(16)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM stops everything started, as Ctrl-C
    started: list[subprocess.Popen] = []
    try:
        return run_all(console, root, rollouts, args, env, started)
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_all(console: Console, root: Path, rollouts: Path, args, env: dict, started: list) -> int:
    console.rule("[bold]RL: trainer with a spare, two rollout replicas")
    run = root / "with-failures"
    trainer = start_trainer(run, rollouts, args.steps, spares=1, faults=f"kill@rank=0,step={args.kill_step}", env=env,
                            port=args.port)
    events, endpoint = run / "events.jsonl", f"tcp://127.0.0.1:{args.port}"
    replicas = [start_replica(i, endpoint, rollouts, args.steps, events, env) for i in range(REPLICAS)]
    started += [trainer, *replicas]
    halfway = rollouts / f"batch{args.steps | 1:05d}.pt"  # one of replica 1's, about halfway
    replica_killed, codes = None, None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if trainer.poll() is not None or any(r.poll() for r in replicas):  # ended, or a replica failed
            break
        if replica_killed is None and halfway.exists():  # replica 1 is killed, and restarted a second later
            replicas[1].kill()
            replicas[1].wait()
            replica_killed = time.time()
            console.print("[bold red]SIGKILL[/] replica 1; restarted in 1 s")
            time.sleep(1.0)
            replicas[1] = start_replica(1, endpoint, rollouts, args.steps, events, env)
            started.append(replicas[1])
        time.sleep(0.1)
    if trainer.poll() == 0:
        with contextlib.suppress(subprocess.TimeoutExpired):
            codes = [0] + [r.wait(timeout=60) for r in replicas]
    if codes is None or any(codes):
        console.print(f"[red]the trainer or a replica failed or timed out (exit codes: trainer "
                      f"{trainer.poll()}, replicas {[r.poll() for r in replicas]}); see {root}/*/*.log")
        return 1
    console.print("The trainer again, on the same batches, without failures, for comparison.")
    reference = start_trainer(root / "reference", rollouts, args.steps, spares=0, faults="", env=env, port=args.port)
    started.append(reference)
    if reference.wait(timeout=600):
        console.print(f"[red]the reference run failed; see {root / 'reference' / 'job.log'}")
        return 1
    return summarize(console, root, run, rollouts, args, replica_killed)


def summarize(console: Console, root: Path, run: Path, rollouts: Path, args, replica_killed: float | None) -> int:
    log = read_events(run)
    trained = torch.load(run / "trained.pt")
    received: dict[str, list[int]] = {}  # by replica process (a restarted replica is a new one)
    for e in log:
        if e["event"] == "weights_received":
            received.setdefault(e["source"], []).append(e["version"])
    killed = next((e["time"] for e in log if e["event"] == "failure_detected" and e["rank"] == 0), float("inf"))
    promoted = [e for e in log if e["event"] == "roster_published" and 0 in e["promoted"].values() and e["gen"]]
    batches = [torch.load(rollouts / f"batch{k:05d}.pt") for k in range(args.steps * RANKS)]
    staleness = [k // RANKS - int(b["version"]) for k, b in enumerate(batches)]
    reward = [float(torch.stack([b["reward"].mean() for b in batches[s * RANKS:(s + 1) * RANKS]]).mean())
              for s in range(args.steps)]
    checks = {
        "trainer rank 0 SIGKILLed, replaced by the spare, which went on publishing":
            bool(promoted) and any(e["event"] == "weights_published" and e["time"] > killed for e in log),
        "a replica SIGKILLed and restarted": replica_killed is not None,
        "each replica process received strictly increasing versions":
            len(received) > REPLICAS and all(v == sorted(set(v)) for v in received.values()),
        "every batch played with a version at most 2 steps old": max(staleness) <= 2,
        "trained weights bit-identical to the failure-free run on the same batches":
            same(trained, torch.load(root / "reference" / "trained.pt")),
        "both replicas hold the trained weights, bit for bit":
            all(same(trained, torch.load(root / f"replica{i}_final.pt")) for i in range(REPLICAS)),
        "the policy learned (mean reward of the last 5 steps > first 5 + 0.2)":
            statistics.mean(reward[-5:]) > statistics.mean(reward[:5]) + 0.2,
    }
    published = [e["version"] for e in log if e["event"] == "weights_published"]
    table = Table(title="RL result")
    table.add_column("")
    table.add_column("value")
    table.add_row("versions published (by either process holding rank 0)", f"{len(set(published))}, "
                  f"{min(published)}..{max(published)}")
    for name, versions in sorted(received.items()):
        table.add_row(f"versions {name} received", f"{len(versions)} ({versions[0]}..{versions[-1]})")
    table.add_row("staleness of the batches (steps; median, max)",
                  f"{statistics.median(staleness)}, {max(staleness)}")
    table.add_row("mean reward, first 5 steps -> last 5", f"{statistics.mean(reward[:5]):.3f} -> "
                  f"{statistics.mean(reward[-5:]):.3f}")
    for check, ok in checks.items():
        table.add_row(check, "[green]yes" if ok else "[red]no")
    console.print(table)
    (root / "summary.json").write_text(json.dumps({
        "checks": checks, "published": sorted(set(published)), "received": received, "staleness": staleness,
        "reward": reward}, indent=1))
    console.rule(f"torchpass report {run}")
    report(run, console)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
