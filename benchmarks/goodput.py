"""Goodput at cluster scale: a failure simulation fed with the costs the other benchmarks measured.

No cluster here, so this is a model (``_goodput_model.py``), run as a Monte Carlo simulation with a fixed seed
and, beside it, in closed form. Measured inputs (torchpass regain, checkpoint-restart restart + restore,
snapshot stalls, write time and throughput dip, state transfer throughput) come from the raw JSON the other
benchmarks write under ``benchmarks/out/`` when present, else from the figures published in
``docs/benchmarks.md`` (built in below); the table says which. Everything the machine cannot measure
(NCCL, scheduler, hosts) is an assumption with a flag, listed in the output.

Failure rates: the job MTTFs 7.9 h (1,024 GPUs) and 1.8 h (16,384 GPUs) that Meta reports for its research
clusters (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters",
arXiv:2410.21680; a fitted projection there), and, as a second set, the per-GPU rate of the Llama 3 405B
pre-training (Llama 3 paper, section 3.3.4: 419 unexpected interruptions in 54 days on 16,384 H100s),
scaled linearly with the GPU count.

Run ``python benchmarks/goodput.py`` (full: 1,000 runs of 30 days per case, ~1 min) or ``--smoke`` (5 runs).
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import platform
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from _goodput_model import (
    LLAMA3_GPUS,
    LLAMA3_HOST_LEVEL,
    LLAMA3_HOURS,
    LLAMA3_INTERRUPTIONS,
    Assumed,
    Measured,
    Policy,
    Scenario,
    closed_form,
    goodput,
    policies,
    scenarios,
    simulate,
)
from _harness import BENCH_DIR, REPO, bench_args, command_line, fresh_work_root, publish

from torchpass_plugins.observe.provenance import recorded

OUT = BENCH_DIR / "out"
PLOT, SMOKE_PLOT = REPO / "docs" / "goodput.png", OUT / "goodput-smoke.png"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def load_measured() -> Measured:
    """Read the full runs' raw results (never the smoke runs'); keep the published figure where absent."""
    m = Measured()
    src = {k: "docs/benchmarks.md (default)" for k in asdict(m) if k != "source"}

    def take(key: str, value: float | None, where: str) -> None:
        if value is not None:
            setattr(m, key, value)
            src[key] = where

    def load(name: str) -> dict[str, Any] | None:
        path = OUT / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    if (regain := load("regain")) is not None:
        rs = regain["results"]
        take("tp_regain_s", _median([r["regain_s"] for r in rs if r["mode"] == "torchpass"]), "out/regain.json")
        take("cr_restart_s", _median([r["first_step_after_kill_s"] for r in rs if r["mode"] == "ckpt-restart"]),
             "out/regain.json")
    if (snap := load("snapshot")) is not None:
        rs = snap["results"]

        def stalls(mode: str) -> list[float]:
            return [s for r in rs if r["mode"] == mode for s in r["stalls_s"]]

        base = _median([r["step_ms"] for r in rs if r["mode"] == "none"])
        take("sync_stall_s", _median(stalls("sync")), "out/snapshot.json")
        take("tp_stall_s", _median(stalls("torchpass")), "out/snapshot.json")
        take("step_ms", base, "out/snapshot.json")
        if base:
            take("dip", _median([a / base for r in rs if r["mode"] == "torchpass" for a in r["after_ms"]]),
                 "out/snapshot.json")
        committed = [json.loads(line) for f in glob.glob(str(OUT / "snapshot" / "rep*-torchpass" / "run" /
                                                                "events.jsonl"))
                     for line in Path(f).read_text().splitlines() if '"snapshot_committed"' in line]
        take("tp_write_s", _median([e["seconds"] for e in committed]), "out/snapshot/*/events.jsonl")
        take("snapshot_bytes", _median([float(e["bytes"]) for e in committed]), "out/snapshot/*/events.jsonl")
    if (transfer := load("transfer")) is not None and transfer.get("summary"):
        take("transfer_gbps", max(transfer["summary"], key=lambda r: r["bytes"])["torchpass_gbps"], "out/transfer.json")
    if (ft := load("torchft")) is not None:
        take("ft_regain_s", _median([r["regain_s"] for r in ft.get("results", []) if r["mode"] == "torchft"]),
             "out/torchft.json")
    if (steady := load("overhead")) is not None:
        runs = {(r["strategy"], r["rep"]): r["median_ms"] for r in steady["results"] if r["model"] == "~105M"}
        take("tp_overhead", _median([ms / runs["ddp", rep] for (s, rep), ms in runs.items()
                                     if s == "torchpass_ddp" and ("ddp", rep) in runs]), "out/overhead.json")
    m.source = src
    return m


def run_case(sc: Scenario, p: Policy, a: Assumed, trials: int, seed: int) -> dict[str, Any]:
    horizon = a.horizon_days * 86400
    runs = [simulate(p, sc.mttf_h * 3600, horizon, f"{seed}/{sc.label}/{k}") for k in range(trials)]
    ettr = sorted(r["ettr"] for r in runs)
    pick = lambda q: ettr[min(len(ettr) - 1, int(q * len(ettr)))]  # noqa: E731
    return {"scenario": sc.label, "gpus": sc.gpus, "mttf_h": sc.mttf_h, "approach": p.name,
            "policy": asdict(p), "trials": trials, "mean": statistics.fmean(ettr), "p5": pick(0.05),
            "p95": pick(0.95), "closed_form": closed_form(p, sc.mttf_h * 3600),
            "failures": statistics.fmean(r["failures"] for r in runs),
            "swaps": statistics.fmean(r["swaps"] for r in runs),
            "fallbacks": statistics.fmean(r["fallbacks"] for r in runs)}


def _interval(p: Policy) -> str:
    if p.kind == "torchft":
        return f"{p.groups} groups, none restored"
    return f"{p.tau / 60:.1f} min"


def render(rows: list[dict[str, Any]], m: Measured, a: Assumed, plot: str, smoke: bool, info: dict[str, str],
           trials: int, seed: int) -> str:
    lines = ["## Goodput at scale: a failure simulation (`benchmarks/goodput.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: few trials; checks the pipeline only.", ""]
    lines += [f"- Command: `{command_line()}`", f"- Date: {info['date']}; {recorded()}"]
    per_gpu = LLAMA3_INTERRUPTIONS / (LLAMA3_HOURS * LLAMA3_GPUS)
    lines += [
        f"- Method: Monte Carlo, {trials} runs of {a.horizon_days:.0f} days per case (seed {seed}), and the closed "
        "form beside it (exact for checkpoint-restart: Daly's expected segment time under exponential failures; "
        "first order for the others). ETTR = training work kept / wall time. The model and its code: "
        "`benchmarks/_goodput_model.py`.",
        "- Failure rates: job MTTF 7.9 h at 1,024 GPUs and 1.8 h at 16,384 GPUs, the figures Meta reports (we "
        "take them from Kokolis et al., \"Revisiting Reliability in Large-Scale Machine Learning Research "
        "Clusters\", arXiv:2410.21680, a fitted projection for Meta's research clusters; used as given, not "
        "re-checked against the paper here); "
        f"and the Llama 3 405B run's rate (419 unexpected interruptions in 54 days on 16,384 GPUs: {per_gpu:.3g} "
        f"per GPU-hour, one per {1 / per_gpu / 8760:.1f} GPU-years), assumed independent across GPUs and scaled "
        "linearly: job MTTF = 1 / (GPUs x rate). Failures are Poisson at the job's rate in every state, restarts "
        f"included. {a.host_share:.0%} of them take a whole host ({LLAMA3_HOST_LEVEL} of the {LLAMA3_INTERRUPTIONS} "
        "Llama 3 root causes: switch/cable, host maintenance, NIC, SSD, power supply, chassis, IO board, CPU, "
        "system memory); the rest kill one worker (GPU, HBM, SRAM, GSP, software, NCCL watchdog, SDC, ...).",
        f"- Checkpoint-restart: a blocking save every Young/Daly interval sqrt(2 C MTTF); C = the synchronous save "
        f"measured here scaled to {a.state_gb:g} GB per GPU (every rank writes its own shard in parallel at the "
        f"rate measured here); restart = {a.restart_min:g} min assumed at scale (requeue, healthy hosts, process "
        "start, NCCL init, load) + the restart + restore measured here; the work since the last checkpoint is lost.",
        f"- torchpass hot swap: {a.spares_per_1024} spare GPUs per 1,024 active (the next row: twice as many). A "
        f"worker failure takes one spare and pauses the job for {a.detect_s:g} s of detection on NCCL + "
        f"{a.rebuild_s:g} s to abort and rebuild the NCCL communicators (both assumed: torchpass runs on gloo here, "
        "where a dead peer's collective fails at once and the agent reports the exit in ~0.09 s; on NCCL it may "
        f"hang until aborted) + the regain measured here + {a.state_gb:g} GB at the torchpass state transfer rate "
        f"measured here + one step ({a.step_s:g} s: the spare redoes its share of the step in flight). A lost "
        f"host takes {a.gpus_per_host} spares on other hosts and waits {a.heartbeat_s:g} s more (the default "
        "`--heartbeat-timeout` after which node 0's agent writes a silent node off, `docs/failure-semantics.md`); "
        "losing the host of node 0's agent (it holds the job's store) ends the job: 1 host loss in (GPUs / "
        f"{a.gpus_per_host}). A used spare comes back after {a.refill_h:g} h. A failure that finds too few spares, "
        "or node 0's host, restarts the whole job (same restart cost) from its newest written background snapshot "
        f"(interval by Young/Daly on the rate of such restarts, at least one write time, at most "
        f"{a.snapshot_max_min:g} min; stall and post-snapshot dip measured here, scaled to the state size).",
        f"- TorchFT-style: replica groups of {a.ft_group_gpus} GPUs (HSDP: sharded inside a group, replicated "
        "across). A failure drops its group; every group pauses for the TorchFT regain measured here (its "
        "lighthouse's 5 s heartbeat timeout, the new quorum, the discarded step redone) + the same NCCL detection "
        "and rebuild + one step; the others train on at (groups - out) / groups of the throughput; the dropped "
        "group comes back after the restart cost + the state transfer (weights from a peer, at the torchpass rate "
        "measured here: TorchFT's own was not measured), which pauses everyone for one rebuild. No checkpoint is "
        "restored (failures of the whole job, e.g. its lighthouse, are outside the model).",
        f"- Goodput per provisioned GPU, the headline: ETTR / the steady-state step time ratio x active GPUs / "
        "provisioned GPUs. torchpass: the whole-run `torchpass_ddp` / `ddp` ratio measured here (on CPU and gloo; "
        "on NCCL it is not measured), and its idle spares counted; TorchFT-style: its ratio is assumed "
        f"({a.ft_overhead:g}), not measured; checkpoint-restart: 1.",
        "",
        "Inputs (measured on this machine, or assumed: each assumed one is a flag of this script, and the "
        "sensitivity table below varies them):",
        "",
        "| Input | Value | Kind | From |",
        "|---|---|---|---|",
    ]
    labels = {"tp_regain_s": ("torchpass regain", "s"), "cr_restart_s": ("ckpt-restart restart + restore", "s"),
              "sync_stall_s": ("synchronous save stall", "s"), "tp_stall_s": ("torchpass snapshot stall", "s"),
              "tp_write_s": ("torchpass snapshot background write", "s"), "dip": ("step time after a snapshot", "x"),
              "step_ms": ("step time of the snapshot runs", "ms"), "snapshot_bytes": ("snapshot size", "bytes"),
              "transfer_gbps": ("torchpass state transfer", "GB/s"), "ft_regain_s": ("TorchFT regain", "s"),
              "tp_overhead": ("torchpass steady-state step time / ddp's", "x")}
    for key, (label, unit) in labels.items():
        value = getattr(m, key)
        shown = f"{value:,.0f}" if unit == "bytes" else f"{value:.4g}"
        lines.append(f"| {label} | {shown} {unit} | measured | {m.source[key]} |")
    for key, value in asdict(a).items():
        if key not in ("horizon_days", "host_share"):
            lines.append(f"| {key.replace('_', ' ')} | {value:g} | assumed | `--{key.replace('_', '-')}` |")
    lines += ["", "| Case | MTTF (h) | Approach | Checkpoint / snapshot interval | Goodput per provisioned GPU "
              "| ETTR simulated (p5-p95) | ETTR closed form | Failures per run | Live swaps | Job restarts "
              "| Spare GPUs |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = Policy(**r["policy"])
        spares = p.spares if p.kind == "torchpass" else 0
        lines.append(f"| {r['scenario']} | {r['mttf_h']:.2f} | {r['approach']} | {_interval(p)} | "
                     f"**{goodput(p, r['mean'], r['gpus'], m, a):.4f}** | "
                     f"{r['mean']:.4f} ({r['p5']:.4f}-{r['p95']:.4f}) | {r['closed_form']:.4f} | "
                     f"{r['failures']:.1f} | {r['swaps']:.1f} | {r['fallbacks']:.1f} | {spares} |")
    lines += ["", *summary(rows, m, a), "", *sensitivity(m, a), "", f"![ETTR per approach and scale]({plot})", ""]
    return "\n".join(lines)


# Each assumed input, over a range a reader may find more likely than our default (one varied at a time).
SWEEP = {"detect_s": (1.0, 60.0, 300.0), "rebuild_s": (5.0, 120.0), "restart_min": (5.0, 30.0),
         "state_gb": (1.0, 16.0), "step_s": (1.0, 20.0), "refill_h": (1.0, 24.0),
         "ft_overhead": (1.02, 1.05)}


def sensitivity(m: Measured, a: Assumed) -> list[str]:
    """Goodput per provisioned GPU in closed form for the largest case as observed (Llama 3, 16,384 GPUs), with
    each assumed input moved alone, and with torchpass's steady-state overhead moved across its interval."""
    sc = scenarios()[-1]
    approaches = [p.name for p in policies(sc, m, a)]

    def row(label: str, mm: Measured, aa: Assumed) -> str:
        values = [goodput(p, closed_form(p, sc.mttf_h * 3600), sc.gpus, mm, aa) for p in policies(sc, mm, aa)]
        return f"| {label} | " + " | ".join(f"{v:.4f}" for v in values) + " |"

    lines = [f"Sensitivity, {sc.label} (MTTF {sc.mttf_h:.1f} h), goodput per provisioned GPU in closed form:", "",
             "| Changed input | " + " | ".join(approaches) + " |", "|---|" + "---|" * len(approaches),
             row("none (the defaults above)", m, a)]
    for key, values in SWEEP.items():
        lines += [row(f"{key.replace('_', ' ')} = {v:g}", m, replace(a, **{key: type(getattr(a, key))(v)}))
                  for v in values]
    lines += [row(f"torchpass steady-state overhead = {v:g}", replace(m, tp_overhead=v), a) for v in (1.0, 1.05, 1.13)]
    return lines


def summary(rows: list[dict[str, Any]], m: Measured, a: Assumed) -> list[str]:
    """One line per case: goodput per provisioned GPU of each approach, side by side."""
    out = []
    for case in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == case]
        parts = "; ".join(f"{r['approach']} {goodput(Policy(**r['policy']), r['mean'], r['gpus'], m, a):.3f}"
                          for r in mine)
        out.append(f"- **{case}** (MTTF {mine[0]['mttf_h']:.1f} h), goodput per provisioned GPU: {parts}.")
    return out


def plot(rows: list[dict[str, Any]], m: Measured, a: Assumed, path: Path) -> None:
    """Left: simulated ETTR per case (bars, p5-p95 whiskers; closed form as dots). Right: closed form against
    the job MTTF at 16,384-GPU sizing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    approaches = list(dict.fromkeys(r["approach"] for r in rows))
    cases = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(approaches)
    for i, name in enumerate(approaches):
        mine = [next(r for r in rows if r["scenario"] == c and r["approach"] == name) for c in cases]
        xs = [k + (i - (len(approaches) - 1) / 2) * width for k in range(len(cases))]
        means = [r["mean"] for r in mine]
        err = [[r["mean"] - r["p5"] for r in mine], [r["p95"] - r["mean"] for r in mine]]
        left.bar(xs, means, width, yerr=err, capsize=2, label=name, color=f"C{i}")
        left.plot(xs, [r["closed_form"] for r in mine], "k.", ms=4)
    mttf_of = {r["scenario"]: r["mttf_h"] for r in rows}
    left.set_xticks(range(len(cases)), [f"{c.replace(', ', chr(10))}\nMTTF {mttf_of[c]:.1f} h" for c in cases],
                    fontsize=7)
    low = min(r["p5"] for r in rows)
    left.set_ylim(max(0.0, low - 0.03), 1.0)
    left.set_ylabel("ETTR")
    left.set_title("Simulated ETTR (bars: mean, p5-p95; dots: closed form)", fontsize=9)
    mttfs = [0.25 * 1.1**k for k in range(80)]
    for i, name in enumerate(approaches):
        ys = []
        for h in mttfs:
            sc = Scenario("sweep", 16384, h, "")
            ys.append(closed_form(next(p for p in policies(sc, m, a) if p.name == name), h * 3600))
        right.plot(mttfs, ys, label=name, color=f"C{i}", ls=("-", "--", ":", "-.")[i % 4])
    for sc in scenarios():
        if sc.gpus == 16384:
            right.axvline(sc.mttf_h, color="grey", lw=0.6, ls=":")
            right.annotate(f"{sc.mttf_h:.1f} h", (sc.mttf_h, 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                           rotation=90, ha="right")
    right.set_xscale("log")
    right.set_xlabel("job MTTF (h), 16,384-GPU sizing")
    right.set_ylabel("ETTR (closed form)")
    right.set_title("Closed form against failure rate", fontsize=9)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(approaches), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    defaults = Assumed()

    def extra(p: Any) -> None:
        p.add_argument("--trials", type=int, default=None, help="runs per case (default 1000, smoke 5)")
        p.add_argument("--seed", type=int, default=0)
        for name, value in asdict(defaults).items():
            p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, help=f"(default {value:g})")

    args = bench_args(__doc__, argv, extra)
    a = Assumed(**{k: getattr(args, k) for k in asdict(defaults)})
    trials = args.trials or (5 if args.smoke else 1000)
    if args.smoke:
        a.horizon_days = min(a.horizon_days, 7.0)
    m = load_measured()
    # No measurement runs here, so only the date matters (machine() would import Lightning for its version).
    info = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}
    work_root = fresh_work_root("goodput", args.smoke)
    rows = []
    for sc in scenarios():
        for p in policies(sc, m, a):
            rows.append(run_case(sc, p, a, trials, args.seed))
            r = rows[-1]
            print(f"[goodput] {sc.label:28s} {p.name:42s} ETTR {r['mean']:.4f} (closed form {r['closed_form']:.4f})",
                  flush=True)
    path = SMOKE_PLOT if args.smoke else PLOT
    plot(rows, m, a, path)
    rel = os.path.relpath(path, args.doc.resolve().parent)
    body = render(rows, m, a, rel, args.smoke, info, trials, args.seed)
    publish("goodput", args.doc, body, work_root, {"machine": info, "measured": asdict(m), "assumed": asdict(a),
                                                   "trials": trials, "seed": args.seed, "rows": rows})
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
