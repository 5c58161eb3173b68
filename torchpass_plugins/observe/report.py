"""``torchpass report RUN_DIR``: what happened in a run, read from its event log.

Prints a summary (steps, failures, each recovery's phases and bytes, steps lost, goodput) and writes
``RUN_DIR/timeline.png``: step progress per rank over time, with failures, recoveries, migrations,
snapshots and restarts marked. The definitions are in ``docs/events.md``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from torchpass_plugins.observe.events import read_events

TIMELINE = "timeline.png"
FIGSIZE_IN, DPI = (10.0, 5.0), 100  # the PNG is 1000 x 500 pixels


@dataclass
class Recovery:
    """One roster change after the start of an attempt: a replacement (failure) or a migration."""

    attempt: int
    gen: int
    kind: str  # "failure", "migration" or "reroute" (a failed link left for another path)
    reason: str
    detected: float  # failure reported by the agent, or migration requested
    published: float  # the coordinator's new roster
    done: float  # the last rank's ``recovered``
    bytes: int  # state sent to the spare(s)
    rolled_back: int

    @property
    def seconds(self) -> float:
        return self.done - self.detected

    @property
    def pause(self) -> float:
        """Training time lost: from the failure, or for a migration from the new roster (the moving worker
        trains until its step boundary), until every rank recovered."""
        return self.done - (self.published if self.kind == "migration" else self.detected)


@dataclass
class Subscriber:
    """What the publisher sent one subscriber: the newest version, the largest lag (versions published and
    not yet sent to it when a send ended), and the seconds of each send (one per version)."""

    last: int = -1
    max_lag: int = 0
    seconds: list[float] = field(default_factory=list)


@dataclass
class Weights:
    published: set[int] = field(default_factory=set)
    skipped: int = 0
    stalls: list[float] = field(default_factory=list)
    subscribers: dict[str, Subscriber] = field(default_factory=dict)


def summarize_weights(events: list[dict[str, Any]]) -> Weights | None:
    """The weights published to rollout replicas, when the run published any."""
    weights = Weights()
    for e in events:
        if e["event"] == "weights_published":
            weights.published.add(e["version"])
            weights.stalls.append(e["stall_s"])
        elif e["event"] == "weights_skipped":
            weights.skipped += 1
        elif e["event"] == "weights_sent":
            sub = weights.subscribers.setdefault(e["subscriber"], Subscriber())
            sub.last = max(sub.last, e["version"])
            sub.max_lag = max(sub.max_lag, e["newest"] - e["version"])
            sub.seconds.append(e["seconds"])
    return weights if weights.published or weights.skipped else None


@dataclass
class RunSummary:
    start: float
    end: float
    world_size: int | None
    steps: int
    failures: int
    hangs: int
    restarts: int
    snapshots: int
    recoveries: list[Recovery] = field(default_factory=list)
    steps_lost: int = 0
    step_time: float | None = None  # median seconds per step
    downtime: float = 0.0
    weights: Weights | None = None
    links: list[dict] = field(default_factory=list)  # link_failure, link_recovered, link_degraded, rerouted

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float | None:
        """Productive time / wall time: the wall time less recoveries, restarts and recomputed steps."""
        return None if self.wall <= 0 else max(0.0, 1.0 - self.downtime / self.wall)


def _attempt_of(events: list[dict], t: float) -> int:
    return sum(1 for e in events if e["event"] == "job_restarting" and e["time"] <= t)


def _median_step_time(progress: list[dict]) -> float | None:
    by_rank: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in progress:
        by_rank[e["rank"]].append((e["time"], e["step"]))
    rates = [(t1 - t0) / (s1 - s0) for points in by_rank.values()
             for (t0, s0), (t1, s1) in pairwise(points) if s1 > s0]
    return statistics.median(rates) if rates else None


def summarize(events: list[dict[str, Any]]) -> RunSummary:
    if not events:
        raise ValueError("the event log is empty")
    by: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        by[e["event"]].append(e)
    started = by.get("agent_started", [{}])
    summary = RunSummary(
        start=min(e["time"] for e in events), end=max(e["time"] for e in events),
        world_size=started[0].get("world_size"), steps=max((e["step"] for e in by["progress"]), default=0),
        failures=len(by["failure_detected"]), hangs=len(by["hang_detected"]), restarts=len(by["job_restarting"]),
        snapshots=len(by["snapshot_committed"]),
    )
    for roster in by["roster_published"]:
        if roster["gen"] == 0:
            continue
        attempt = _attempt_of(events, roster["time"])
        same = [e for e in events if _attempt_of(events, e["time"]) == attempt]
        kind = {"migrate": "migration", "reroute": "reroute"}.get(roster["reason"].split(" ")[0].rstrip(":"),
                                                                    "failure")
        cause = {"migration": "migration_requested", "reroute": "rerouted", "failure": "failure_detected"}[kind]
        causes = [e for e in same if e["time"] <= roster["time"] and e["event"] == cause
                  and (kind == "migration" or e["gen"] == roster["gen"] - (kind == "failure"))]
        recovered = [e for e in same if e["event"] == "recovered" and e.get("gen") == roster["gen"]]
        done = max((e["time"] for e in recovered), default=roster["time"])
        sent = [e for e in same if e["event"] == "state_sent" and roster["time"] <= e["time"] <= done]
        summary.recoveries.append(Recovery(
            attempt, roster["gen"], kind, roster["reason"],
            # a reroute's link failed when it last answered: its report came the grace later
            detected=max((e["time"] - e.get("seconds", 0.0) * (kind == "reroute") for e in causes),
                         default=roster["time"]), published=roster["time"],
            done=done, bytes=sum(e.get("bytes", 0) for e in sent),
            rolled_back=max((e.get("steps_rolled_back", 0) for e in recovered), default=0),
        ))
    resumed = defaultdict(int)
    for e in by["snapshot_resumed"]:
        resumed[_attempt_of(events, e["time"])] = max(resumed[_attempt_of(events, e["time"])], e["steps_lost"] or 0)
    summary.steps_lost = sum(resumed.values()) + sum(r.rolled_back for r in summary.recoveries)
    summary.step_time = _median_step_time(by["progress"])
    restart_gaps = []
    for restart in by["job_restarting"]:
        later = [e["time"] for e in by["progress"] if e["time"] > restart["time"]]
        restart_gaps.append((min(later) if later else restart["time"]) - restart["time"])
    summary.downtime = (sum(r.pause for r in summary.recoveries) + sum(restart_gaps)
                        + summary.steps_lost * (summary.step_time or 0.0))
    summary.weights = summarize_weights(events)
    summary.links = [e for e in events if e["event"] in ("link_failure", "link_recovered", "link_degraded", "rerouted")]
    return summary


def render(summary: RunSummary, console: Console) -> None:
    run = Table(title="Run", show_header=False)
    goodput = "-" if summary.goodput is None else f"{summary.goodput:.3f}"
    step_time = "-" if summary.step_time is None else f"{summary.step_time:.3f}"
    for key, value in [
        ("Wall time (s)", f"{summary.wall:.1f}"), ("Active ranks", str(summary.world_size)),
        ("Steps reached", str(summary.steps)), ("Failures", str(summary.failures)), ("Hangs", str(summary.hangs)),
        ("Recoveries", str(sum(r.kind == "failure" for r in summary.recoveries))),
        ("Migrations", str(sum(r.kind == "migration" for r in summary.recoveries))),
        ("Reroutes", str(sum(r.kind == "reroute" for r in summary.recoveries))),
        ("Restarts", str(summary.restarts)), ("Snapshots committed", str(summary.snapshots)),
        ("Steps lost", str(summary.steps_lost)), ("Median step (s)", step_time), ("Goodput", goodput),
    ]:
        run.add_row(key, value)
    console.print(run)
    if summary.weights is not None:
        render_weights(summary.weights, console)
    if summary.links:
        render_links(summary.links, summary.start, console)
    if not summary.recoveries:
        return
    table = Table(title="Recoveries and migrations")
    for column in ("#", "Attempt", "Gen", "Kind", "Reason", "Detect (s)", "Restore (s)", "Total (s)",
                   "Bytes to spare", "Rolled back"):
        table.add_column(column)
    for i, r in enumerate(summary.recoveries, 1):
        table.add_row(str(i), str(r.attempt), str(r.gen), r.kind, r.reason, f"{r.published - r.detected:.3f}",
                      f"{r.done - r.published:.3f}", f"{r.seconds:.3f}", f"{r.bytes:,}", str(r.rolled_back))
    console.print(table)


def _link_detail(e: dict) -> str:
    if e["event"] == "link_degraded":
        return f"round trip {e['round_trip_ms']} ms, other paths {e['other_paths_ms']} ms"
    if e["event"] in ("link_recovered", "rerouted"):
        return f"down {e['seconds']:.1f} s" + (" before" if e["event"] == "rerouted" else "")
    return ""


def render_links(links: list[dict], start: float, console: Console) -> None:
    table = Table(title="Links between nodes")
    for column in ("Time (s)", "What", "Node", "Peer", "Path", "Detail"):
        table.add_column(column)
    what = {"link_failure": "failed", "link_recovered": "back (flap)", "link_degraded": "degraded",
            "rerouted": "job rerouted"}
    for e in links:
        path = f"{e['from']} -> {e['to']}" if e["event"] == "rerouted" else f"{e['path']} ({e['interface']})"
        detail = _link_detail(e)
        table.add_row(f"{e['time'] - start:.1f}", what[e["event"]], str(e["node"]), str(e["peer"]), path, detail)
    console.print(table)


def render_weights(weights: Weights, console: Console) -> None:
    versions = sorted(weights.published)
    stall = f"{statistics.median(weights.stalls) * 1e3:.2f}" if weights.stalls else "-"
    console.print(f"Weights: {len(versions)} version(s) published"
                  + (f" ({versions[0]}..{versions[-1]})" if versions else "")
                  + f", {weights.skipped} skipped (no free copy), median stall {stall} ms")
    if not weights.subscribers:
        return
    table = Table(title="Weights sent to subscribers")
    for column in ("Subscriber", "Versions", "Newest", "Max lag (versions)", "Median send (s)"):
        table.add_column(column)
    for name, sub in sorted(weights.subscribers.items()):
        table.add_row(name, str(len(sub.seconds)), str(sub.last), str(sub.max_lag),
                      f"{statistics.median(sub.seconds):.4f}")
    console.print(table)


def plot_timeline(events: list[dict[str, Any]], summary: RunSummary, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = summary.start
    fig, ax = plt.subplots(figsize=FIGSIZE_IN, dpi=DPI)
    series: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        if e["event"] == "progress":
            series[e["rank"]].append((e["time"] - t0, e["step"]))
    for rank in sorted(series):
        xs, ys = zip(*series[rank], strict=True)
        ax.plot(xs, ys, marker=".", linewidth=1, label=f"rank {rank}")
    marks = {"failure_detected": ("tab:red", "failure"), "hang_detected": ("tab:purple", "hang"),
             "drained": ("tab:orange", "migration"), "job_restarting": ("black", "restart"),
             "rerouted": ("tab:cyan", "reroute"), "link_degraded": ("tab:brown", "slow link")}
    labelled: set[str] = set()
    for e in events:
        if e["event"] in marks:
            color, label = marks[e["event"]]
            ax.axvline(e["time"] - t0, color=color, linestyle="--", linewidth=1,
                       label=None if label in labelled else label)
            labelled.add(label)
    for r in summary.recoveries:
        ax.axvspan(r.detected - t0, r.done - t0, color="tab:green", alpha=0.25,
                   label=None if "recovery" in labelled else "recovery")
        labelled.add("recovery")
    snaps = [e["time"] - t0 for e in events if e["event"] == "snapshot_committed"]
    if snaps:
        ax.plot(snaps, [0] * len(snaps), "|", color="tab:blue", markersize=12, label="snapshot committed")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("optimizer step")
    ax.set_title("torchpass run timeline")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def wide_console() -> Console:
    """The terminal's width, or 140 columns when the output is a file or a pipe (rich would use 80)."""
    return Console(width=None if Console().is_terminal else 140)


def report(run_dir: str | Path, console: Console | None = None) -> RunSummary:
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    if not events:
        raise FileNotFoundError(f"no events in {run_dir / 'events.jsonl'}: is this a torchpass run directory?")
    summary = summarize(events)
    console = console or wide_console()
    render(summary, console)
    console.print(f"timeline: {plot_timeline(events, summary, run_dir / TIMELINE)}")
    return summary
