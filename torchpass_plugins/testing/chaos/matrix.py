"""The chaos matrix: run scenarios under a hard time bound and classify each outcome.

Every outcome but ``failure`` ends with every logical rank's full state (parameters, buffers, optimizer,
schedulers, loop progress, metric states, logged values, RNG) equal to the failure-free run's bit for bit
and every optimizer step applied; the classes say what it cost:

- ``zero-rollback``: a worker was lost and replaced live; no step was computed twice.
- ``no-loss``: no worker was lost (a slowdown the job rode out, a link failure it rerouted around or rode
  out); no state moved.
- ``rolled-back``: an in-memory rollback of the steps logged as ``steps_rolled_back``, recomputed.
- ``resumed``: the job restarted itself from its newest snapshot, recomputing the steps after it (a
  snapshot holds what a checkpoint holds, so the logged values and metric states of the epoch in progress
  are not compared: they start over, as after resuming from a checkpoint).
- ``restarted``: the job restarted before its first snapshot, from the start.
- ``stopped``: the job stopped with a logged reason (or its coordinator's agent was killed); the same job
  submitted again resumed from its newest snapshot (or started over).
- ``logs-at-vote``: replaced live, but the spare entered with its predecessor's logged values as of the
  step's commit vote (event ``rank_state_received``, ``kind: "vote"``): what the predecessor logged after
  that optimizer step is missing; everything else is compared.
- ``logs-reset``: replaced live, but a lost rank's metric states and logged values were lost with the rank
  holding their copy (event ``rank_state_lost``): on that rank they start over, as after resuming from a
  snapshot; they are not compared, everything else is.
- ``failure``: anything else: a divergence, a hang (the bound passed), a process left behind, a step
  applied twice without a log of it, a stop the resubmitted job could not resume from, or a fault that
  never struck (the scenario tested nothing).

A scenario's ``workers_lost`` counts the workers the job declared lost; the headline is, per strategy, the share
of the one-fault scenarios (a fault in a step or in a background thread) that lost one worker and ended
``zero-rollback``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from torchpass_plugins.testing.chaos import jobs
from torchpass_plugins.testing.chaos.oracle import differences
from torchpass_plugins.testing.chaos.scenario import (
    SINGLE_FAULT,
    SNAPSHOT_EVERY,
    STEPS,
    WORLD,
    Scenario,
    draw,
    draw_link,
)
from torchpass_plugins.testing.faults import PHASES
from torchpass_plugins.testing.netns import Hosts

BOUND_S = 150.0  # per job: far above a scenario's worst legitimate time (a hang timeout plus a restart)
HEARTBEAT_TIMEOUT_S = 4.0
COLLECTIVE_TIMEOUT_S = 6.0
# On test hosts: far above the link grace (5 s) and a flap (3 s) with TCP's retransmission after it, so that
# a link fault is the probes' to handle, not the collectives' timeout.
HOSTS_COLLECTIVE_TIMEOUT_S = 30.0
SNAPSHOT_TIMEOUT_S = 10.0
LAUNCH = ("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--max-restarts", "2", "--health-source", "off")
ON_HOSTS = ("--devices", "1", "--num-nodes", str(WORLD))  # the Trainer's layout with a rank per host


@dataclass
class Result:
    index: int
    scenario: str
    kind: str
    phase: str
    action: str
    outcome: str  # one of OUTCOMES
    detail: str
    seconds: float
    strategy: str = ""
    workers_lost: int = 0  # workers the job declared lost


OUTCOMES = ("zero-rollback", "no-loss", "rolled-back", "resumed", "restarted", "stopped", "logs-at-vote", "logs-reset",
            "failure")


def train_args(strategy: str, replicate_every: int, run_dir: Path, on_hosts: bool = False) -> tuple[str, ...]:
    return (
        "--strategy", strategy, "--replicate-every", str(replicate_every), "--max-steps", str(STEPS),
        "--collective-timeout", str(HOSTS_COLLECTIVE_TIMEOUT_S if on_hosts else COLLECTIVE_TIMEOUT_S),
        "--snapshot-dir", str(run_dir / "snapshots"),
        "--snapshot-every", str(SNAPSHOT_EVERY), "--snapshot-timeout", str(SNAPSHOT_TIMEOUT_S),
        *(ON_HOSTS if on_hosts else ()),
    )  # fmt: skip


def run_job(
    run_dir: Path,
    strategy: str,
    replicate_every: int,
    faults: str,
    snapshots: Path | None = None,
    nproc: int = WORLD + 1,
    spares: int = 1,
    hosts: Hosts | None = None,
    on_hosts: bool = False,
) -> tuple[jobs.Job, list[int] | None, list[int]]:
    """One bounded job; returns it, its agents' exit codes (None: it hung) and what it left running. With
    ``hosts``, a worker per host, preferring the path that faults strike; ``on_hosts``: the Trainer's layout of
    such a job (for its failure-free reference on one machine)."""
    args = list(train_args(strategy, replicate_every, run_dir, on_hosts or hosts is not None))
    if snapshots is not None:
        args[args.index("--snapshot-dir") + 1] = str(snapshots)
    layout = {"nproc": nproc}
    launch = LAUNCH
    if hosts is not None:
        layout = {"nproc": 1, "nnodes": nproc, "hosts": hosts}
        launch = (*LAUNCH, "--interfaces", hosts.interfaces())  # the default grace: a flap is ridden out
    job = jobs.start(run_dir, spares=spares, train_args=tuple(args), launch_args=launch, faults=faults, **layout)
    try:
        codes = [agent.wait(timeout=max(1.0, job.started + BOUND_S - time.monotonic())) for agent in job.agents]
    except subprocess.TimeoutExpired:
        codes = None
    left = job.leftovers() if codes is not None else []
    job.kill()
    return job, codes, left


def reference(work: Path, name: str) -> list[dict]:
    """Every logical rank's full state at the end of the failure-free run (run once per strategy and
    replication interval)."""
    path = work / "reference" / name / "out" / "final.pt"
    if not path.exists():
        strategy, _, every = name.removesuffix("-hosts").rpartition("-r")
        shutil.rmtree(path.parents[1], ignore_errors=True)
        job, codes, left = run_job(path.parents[1], strategy, int(every), "", nproc=WORLD, spares=0,
                                   on_hosts=name.endswith("-hosts"))
        if codes != [0] or left:
            raise RuntimeError(f"the failure-free run {name} failed ({codes}, left {left}):\n{job.output()[-3000:]}")
    done = jobs.Job(path.parents[1])
    return [done.state(rank) for rank in range(WORLD)]


# What a snapshot restores (a checkpoint's content); the rest of a rank's state starts the epoch over.
CHECKPOINTED = ("module", "optimizers", "schedulers", "loops", "rng")


def divergence(job: jobs.Job, expected: list[dict], keys: tuple[str, ...] | None = None) -> str | None:
    """The first difference from the failure-free run's full state of any rank (``keys``: only those parts)."""
    for rank, want in enumerate(expected):
        got = job.state(rank)
        if keys is not None:
            want, got = {k: want[k] for k in keys}, {k: got[k] for k in keys}
        found = differences(want, got, f"rank{rank}")
        if found:
            return f"divergence: {found[0]}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
    return None


def _not_struck(run_dir: Path, count: int) -> list[int]:
    return [i for i in range(count) if not (run_dir / "faults" / f"fired-{i}").exists()]


def classify(sc: Scenario, work: Path) -> tuple[str, str, int]:
    """Run the scenario; returns (outcome, detail, workers lost)."""
    run_dir = work / sc.name
    shutil.rmtree(run_dir, ignore_errors=True)
    expected = reference(work, sc.reference)
    if sc.on_hosts:
        with Hosts(WORLD + 1, paths=2) as hosts:
            job, codes, left = run_job(run_dir, sc.strategy, sc.replicate_every, sc.spec, hosts=hosts)
    else:
        job, codes, left = run_job(run_dir, sc.strategy, sc.replicate_every, sc.spec)
    workers_lost = len({e["worker"] for e in job.events("failure_detected")})
    return (*judge(sc, job, codes, left, expected), workers_lost)


def judge(
    sc: Scenario, job: jobs.Job, codes: list[int] | None, left: list[int], expected: list[dict]
) -> tuple[str, str]:
    """The outcome of a scenario's job (``codes`` None: it hung; ``left``: processes it left)."""
    run_dir = job.run_dir
    if codes is None:
        return "failure", f"hang: the job ran past {BOUND_S:.0f}s"
    if left:
        return "failure", f"orphans: {len(left)} process(es) left after the job ended"
    missing = _not_struck(run_dir, len(sc.faults))
    if missing:
        return "failure", f"fault(s) {missing} never struck: the scenario tested nothing"
    events = job.events()
    if any(codes) and sc.on_hosts:
        return "failure", f"a link fault stopped the job ({codes}):\n{job.output()[-1500:]}"
    if any(codes):
        return _resubmitted(sc, job, events, codes, expected)
    restarts = sum(e["event"] == "job_restart" for e in events)
    diverged = divergence(job, expected, CHECKPOINTED if restarts else None)
    before_tail = any(e["event"] == "rank_state_received" and e["kind"] == "vote" for e in events)
    if diverged and before_tail and not divergence(job, expected, CHECKPOINTED):
        return "logs-at-vote", f"a spare entered with its predecessor's logged values as of its last vote ({diverged})"
    reset = any(e["event"] == "rank_state_lost" for e in events)
    if diverged and reset and not divergence(job, expected, CHECKPOINTED):
        return "logs-reset", f"a lost rank's logged values were lost with their holder and started over ({diverged})"
    if diverged:
        return "failure", diverged
    applied = [job.applied(r) for r in range(WORLD)]
    if any(set(a) != set(range(STEPS)) for a in applied):
        return "failure", f"steps missing: applied {applied}"
    recomputed = max(len(a) - STEPS for a in applied)
    rolled = max([e.get("steps_rolled_back") or 0 for e in events if e["event"] == "recovered"], default=0)
    lost = max([e.get("steps_lost") or 0 for e in events if e["event"] == "snapshot_resumed"], default=0)
    recoveries = sum(e["event"] == "roster_published" and e["gen"] > 0 and bool(e["promoted"]) for e in events)
    reroutes = sum(e["event"] == "rerouted" for e in events)
    if sc.on_hosts:
        return _judge_link(sc, recoveries, reroutes, restarts, recomputed)
    if not recomputed and not restarts:
        return ("zero-rollback" if recoveries else "no-loss"), (f"{recoveries} recovery(ies), {reroutes} reroute(s), "
                                                                "0 steps recomputed")
    if restarts and any(e["event"] == "snapshot_resumed" for e in events):
        return "resumed", f"{restarts} restart(s), {lost} step(s) lost, rolled back {rolled}; recomputed {recomputed}"
    if restarts:
        return "restarted", f"{restarts} restart(s) before the first snapshot: started over ({recomputed} recomputed)"
    if rolled:
        return "rolled-back", f"rolled back {rolled} step(s) in memory; recomputed {recomputed}"
    return "failure", f"{recomputed} step(s) applied twice without a log of lost steps"


def _judge_link(sc: Scenario, recoveries: int, reroutes: int, restarts: int, recomputed: int) -> tuple[str, str]:
    """A link fault costs no worker, no restart and no recomputed step; a cut is routed around once, a flap is
    ridden out, and a slow link may be left (its queue can hold probes past the grace) or not."""
    expected = {"link-down": {1}, "link-flap": {0}, "link-slow": {0, 1}}[sc.target.action]
    detail = f"{recoveries} worker(s) replaced, {reroutes} reroute(s), {restarts} restart(s), {recomputed} recomputed"
    if recoveries or restarts or recomputed or reroutes not in expected:
        return "failure", f"{detail}; a {sc.target.action} should cost {sorted(expected)} reroute(s) and nothing else"
    return "no-loss", detail


def _resubmitted(
    sc: Scenario, job: jobs.Job, events: list[dict], codes: list[int], expected: list[dict]
) -> tuple[str, str]:
    """The job stopped. Documented only with a reason in the log (an abort) or when its agent was killed
    (the coordinator's host); then the same job submitted again must resume from its newest snapshot."""
    aborted = [e for e in events if e["event"] == "job_aborted" and "message" in e]
    agent_lost = any(f.action == "kill-agent" for f in sc.faults)
    if not aborted and not agent_lost:
        return "failure", f"the job stopped ({codes}) without a logged reason:\n{job.output()[-1500:]}"
    again, codes2, left = run_job(
        job.run_dir / "resubmitted", sc.strategy, sc.replicate_every, "", snapshots=job.run_dir / "snapshots"
    )
    if codes2 != [0] or left:
        return "failure", f"the resubmitted job failed ({codes2}, left {left}):\n{again.output()[-1500:]}"
    diverged = divergence(again, expected, CHECKPOINTED)
    if diverged:
        return "failure", f"{diverged}, after resuming from the snapshot"
    resumed = [e["step"] for e in again.events("snapshot_resumed")]
    reached = max([len(job.applied(r)) for r in range(WORLD)], default=0)
    why = aborted[0]["message"].splitlines()[0] if aborted else "the coordinator's agent was killed"
    start = f"resumed from step {resumed[0]}" if resumed else "no snapshot yet: started over"
    return "stopped", f"stopped ({why}); resubmitted, {start} (the stopped job had applied {reached} steps)"


def run_matrix(seed: int, indices: Iterable[int], work: Path, log=print, links: bool = False) -> list[Result]:
    """Scenarios ``indices`` of ``seed``; ``links``: of the link family (``draw_link``)."""
    work.mkdir(parents=True, exist_ok=True)
    results = []
    with open(work / "results.jsonl", "a") as out:
        for index in indices:
            sc = (draw_link if links else draw)(seed, index)
            t0 = time.monotonic()
            try:
                outcome, detail, workers_lost = classify(sc, work)
            except Exception as exc:  # a harness error is a failure of the scenario, not of the matrix
                outcome, detail, workers_lost = "failure", f"harness: {type(exc).__name__}: {exc}", 0
            seconds = round(time.monotonic() - t0, 1)
            result = Result(index, sc.spec, sc.kind, sc.target.phase, sc.target.action, outcome, detail, seconds,
                            sc.strategy, workers_lost)  # fmt: skip
            out.write(json.dumps({"seed": seed, **asdict(result)}) + "\n")
            out.flush()
            results.append(result)
            log(f"{outcome:9s} {result.seconds:5.1f}s  {sc}  -- {detail.splitlines()[0]}")
            if outcome != "failure":
                shutil.rmtree(work / sc.name, ignore_errors=True)  # keep failures for inspection
    return results


def summary(results: list[Result], seed: int) -> str:
    """Per strategy, the zero-rollback rate of single failures that lost a worker and the classes; counts per
    phase and fault (Markdown), then the replay command of every failure."""
    strategies = sorted({r.strategy for r in results})
    outcomes = Counter(r.outcome for r in results)
    lines = [f"{len(results)} scenarios (seed {seed}): {outcomes['failure']} failure(s).", ""]
    for strategy in strategies:
        single = [r for r in results if r.strategy == strategy and r.kind in SINGLE_FAULT and r.workers_lost == 1]
        live = sum(r.outcome == "zero-rollback" for r in single)
        share = f" ({100 * live / len(single):.0f}%)" if single else ""
        lines.append(f"- `{strategy}`: a single failure that lost a worker, replaced with zero rollback in {live} of "
                     f"{len(single)} scenarios{share}")  # fmt: skip
    shown = [o for o in OUTCOMES if outcomes[o]]
    lines += ["", "| strategy | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown)]
    for strategy in strategies:
        counts = Counter(r.outcome for r in results if r.strategy == strategy)
        lines.append(f"| {strategy} | " + " | ".join(str(counts[o]) for o in shown) + " |")
    actions = sorted({r.action for r in results})
    cells: dict[tuple[str, str], Counter] = {}
    for r in results:
        cells.setdefault((r.phase, r.action), Counter())[_group(r.outcome)] += 1
    lines += [
        "",
        "By the phase and the fault of the scenario's target; each cell: zero rollback or no loss / recovered "
        "at a cost (rolled back, resumed, restarted, stopped, logs at the vote, logs reset) / failure.",
        "",
        "| phase | " + " | ".join(actions) + " |",
        "|---|" + "---|" * len(actions),
    ]
    for phase in sorted({r.phase for r in results}, key=PHASES.index):
        row = []
        for action in actions:
            c = cells.get((phase, action))
            row.append(f"{c['free']} / {c['cost']} / {c['failure']}" if c else "")
        lines.append(f"| {phase} | " + " | ".join(row) + " |")
    failures = [r for r in results if r.outcome == "failure"]
    if failures:
        lines += ["", "Failures (replay each with `torchpass chaos --seed SEED --only INDEX`):", ""]
        lines += [f"- #{r.index} `{r.scenario}`: {r.detail.splitlines()[0]}" for r in failures]
    return "\n".join(lines)


def _group(outcome: str) -> str:
    if outcome in ("zero-rollback", "no-loss"):
        return "free"
    return "failure" if outcome == "failure" else "cost"
