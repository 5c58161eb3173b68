"""A link cut against a worker lost: how long training stops for each, side by side on the same hosts.

Three test hosts (network namespaces, each with two links: ``eth1``, the path the job prefers, and ``eth0``,
which also carries the store), one worker each: rank 0, rank 1 and a spare. ``torchpass_ddp`` trains the
benchmark MLP; once rank 1 has applied ``at`` steps, one of these strikes host 1, in turn per repetition:

- *cut*: its ``eth1`` pulled for good: the job is rerouted to ``eth0`` (``--link-grace``, 5 s by default,
  then a new generation with the same workers), no spare used;
- *flap*: its ``eth1`` pulled for 3 s, then plugged back: ridden out on the same path;
- *kill*: rank 1's worker SIGKILLed: a spare takes its rank and receives its state.

Stop: from the fault on, the longest time rank 0 waits for its next optimizer step (the step in flight may
still complete over the cut link: the next one waits), against the median step time before the fault. For
the cut, detection is until the coordinator's ``rerouted`` (the grace included) and rebuild from there to
the last rank's ``recovered``; for the kill, detection is until the new roster and rebuild until the last
``recovered`` (the state transfer included).

Run ``python benchmarks/link_reroute.py`` (full, needs root) or ``--smoke``.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

from _harness import REPO, RunFailed, begin, command_line, in_turn, machine_lines, publish, read_events, read_steps

from torchpass_plugins.testing.chaos import jobs
from torchpass_plugins.testing.netns import Hosts

FAULTS = ("cut", "flap", "kill")
FLAP_S = 3.0
SCRIPT = REPO / "benchmarks" / "bench_train.py"


@dataclass(frozen=True)
class Size:
    features: int
    hidden: int
    steps: int
    at: int  # the fault strikes once rank 1 has applied this many steps
    reps: int
    timeout_s: float


FULL = Size(features=256, hidden=512, steps=60, at=20, reps=3, timeout_s=240)
SMOKE = Size(features=32, hidden=64, steps=30, at=10, reps=1, timeout_s=180)


@dataclass
class Row:
    fault: str
    rep: int
    step_s: float  # median step time before the fault
    stop_s: float  # from the fault on, the longest wait of rank 0 for its next step
    detect_s: float | None
    rebuild_s: float | None
    spares_used: int
    rerouted: int


def _run(work: Path, fault: str, rep: int, size: Size) -> Row:
    run_dir = work / f"{fault}-{rep}"
    train = ("--strategy", "torchpass_ddp", "--devices", "1", "--num-nodes", "2", "--max-steps", str(size.steps),
             "--features", str(size.features), "--hidden", str(size.hidden), "--out", str(run_dir / "out"))
    with Hosts(3, paths=2) as hosts:
        job = jobs.start(run_dir, nproc=1, spares=1, nnodes=3, script=SCRIPT, train_args=train, hosts=hosts,
                         launch_args=("--interfaces", hosts.interfaces(), "--health-source", "off"))
        try:
            job.wait_until(lambda: len(read_steps(run_dir / "out").get(1, [])) >= size.at, "rank 1's steps",
                           timeout=size.timeout_s)
            struck = time.time()
            if fault == "kill":
                os.kill(job.pid_of_rank(1), signal.SIGKILL)
            else:
                hosts.link(1, up=False, path=1)
                if fault == "flap":
                    time.sleep(FLAP_S)
                    hosts.link(1, up=True, path=1)
            codes = job.wait(size.timeout_s)
        finally:
            job.kill()
    if any(codes):
        raise RunFailed(f"{fault} #{rep}: exit codes {codes}:\n{job.output()[-2000:]}")
    steps = read_steps(run_dir / "out")[0]
    before = [t for _, t, _, _ in steps if t < struck]
    after = [struck, *(t for _, t, _, _ in steps if t > struck)]
    events = read_events(run_dir)
    first = {e["event"]: e["time"] for e in reversed(events)}  # each event's first time
    recovered = [e["time"] for e in events if e["event"] == "recovered"]
    published = [e["time"] for e in events if e["event"] == "roster_published" and e["gen"] == 1]
    detect = rebuild = None
    if fault == "cut" and "rerouted" in first and recovered:
        detect, rebuild = first["rerouted"] - struck, max(recovered) - first["rerouted"]
    elif fault == "kill" and published and recovered:
        detect, rebuild = published[0] - struck, max(recovered) - published[0]
    step_s, stop_s = statistics.median(b - a for a, b in pairwise(before)), max(b - a for a, b in pairwise(after))
    return Row(fault, rep, step_s, stop_s, detect, rebuild, sum(1 for e in events if e["event"] == "state_received"),
               sum(1 for e in events if e["event"] == "rerouted"))


def _table(rows: list[Row]) -> str:
    lines = ["| Fault | Stop: longest wait for a step, median (min-max) | In steps | Detection | Rebuild | Spares used "
             "| Reroutes |", "|---|---|---|---|---|---|---|"]
    for fault in FAULTS:
        mine = [r for r in rows if r.fault == fault]
        if not mine:
            continue
        stops = [r.stop_s for r in mine]
        step = statistics.median(r.step_s for r in mine)
        detect = [r.detect_s for r in mine if r.detect_s is not None]
        rebuild = [r.rebuild_s for r in mine if r.rebuild_s is not None]
        lines.append(
            f"| {fault} | {statistics.median(stops):.2f} s ({min(stops):.2f}-{max(stops):.2f}) | "
            f"{statistics.median(stops) / step:.0f} | "
            f"{f'{statistics.median(detect):.2f} s' if detect else '-'} | "
            f"{f'{statistics.median(rebuild) * 1e3:.0f} ms' if rebuild else '-'} | "
            f"{sum(r.spares_used for r in mine)} | {sum(r.rerouted for r in mine)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, size, reps, info, work = begin(__doc__, argv, "link_reroute", FULL, SMOKE)
    rows = []
    for rep in range(reps):
        for fault in in_turn(FAULTS, rep):
            rows.append(_run(work, fault, rep, size))
            print(rows[-1], flush=True)
    body = "\n".join([
        "## A link cut against a worker lost (`benchmarks/link_reroute.py`)", "",
        *machine_lines(info, command_line()), "",
        f"3 hosts (network namespaces, two links each), `torchpass_ddp` on 2 of them, a spare on the third; the "
        f"benchmark MLP ({size.features} features, {size.hidden} hidden); {reps} repetition(s) of each fault, "
        "in turn. *Stop*: from the fault on, the longest rank 0 waited for its next optimizer step; *In steps*: "
        "that over the median step time before the fault. *Detection*: to the coordinator's decision "
        "(`rerouted`, or the new roster after the kill); *Rebuild*: from there until every rank recovered. The "
        "cut's detection is the link grace (5 s by default), counted from the path's last answer; the flap "
        f"({FLAP_S:g} s) is ridden out on its path.",
        "", _table(rows)])
    publish("link_reroute", args.doc, body, work, {"info": info, "rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
