"""The ``torchpass`` command: ``launch`` a job with spares, or run the ``demo``."""

from __future__ import annotations

import argparse
import os
import sys

from torchpass_plugins.control.agent import LaunchConfig, launch
from torchpass_plugins.health.watch import HealthConfig, HealthPolicy


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a job's supervision, shared by ``torchpass launch`` and ``python -m torchpass_plugins.run``."""
    p.add_argument("--spares", type=int, default=0, help="workers that wait to replace failed ones (job-wide)")
    p.add_argument("--run-dir", default="torchpass_runs/latest", help="where events.jsonl is written")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0, help="seconds without a beat before SIGKILL")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of the whole job when a failure no spare can fix happens (it resumes from its "
                        "newest snapshot); 0: stop instead")
    p.add_argument("--spare-wait", type=float, default=20.0,
                   help="when more workers are lost than spares are free, seconds to wait for refilled workers "
                        "to join the pool before restarting (0: restart at once)")
    p.add_argument("--health-source", default="nvml",
                   help="GPU health readings: nvml, file:PATH (JSON {device: {field: value}}, for drills), or off")
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds between health readings")
    p.add_argument("--temperature-warn", type=float, default=HealthPolicy.temperature_warn_c, help="deg C")
    p.add_argument("--temperature-migrate", type=float, default=HealthPolicy.temperature_migrate_c,
                   help="deg C from which a worker is moved off its GPU to a spare")
    p.add_argument("--straggler-window", type=int, default=50, help="steps per straggler verdict (0: off)")
    p.add_argument("--straggler-factor", type=float, default=1.5,
                   help="a rank whose compute time per step exceeds the median by this factor is a straggler")
    p.add_argument("--straggler-policy", choices=["warn", "migrate"], default="warn",
                   help="log a straggler, or also move it to a spare")
    p.add_argument("--metrics-addr", default=None,
                   help="HOST:PORT for node 0's Prometheus endpoint (needs the 'metrics' extra); off by default")
    p.add_argument("--preload", default="torch,lightning.pytorch",
                   help="modules a per-node fork server imports once; every worker is forked from it and starts "
                        "in milliseconds ('': start each worker as a fresh interpreter)")
    p.add_argument("script", help="training script (or -m module)")
    p.add_argument("args", nargs=argparse.REMAINDER)


def job_config(ns: argparse.Namespace) -> dict:
    """``LaunchConfig`` arguments from the flags of :func:`add_job_flags`."""
    return dict(
        command=[ns.script, *ns.args] if ns.script != "-m" else ["-m", *ns.args], spares=ns.spares,
        run_dir=ns.run_dir, heartbeat_timeout=ns.heartbeat_timeout, max_restarts=ns.max_restarts,
        spare_wait=ns.spare_wait,
        health=HealthConfig(ns.health_source, ns.health_interval,
                            HealthPolicy(temperature_warn_c=ns.temperature_warn,
                                         temperature_migrate_c=ns.temperature_migrate)),
        straggler_window=ns.straggler_window, straggler_factor=ns.straggler_factor,
        straggler_migrate=ns.straggler_policy == "migrate", metrics_addr=ns.metrics_addr,
        preload=tuple(m for m in ns.preload.split(",") if m.strip()),
    )


def _launch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="start and supervise the workers of this node (torchrun-like)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="worker processes on this node, spares included")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", default="127.0.0.1:0",
                   help="HOST:PORT of node 0's store, which listens on HOST's interface only (port 0: any free)")
    p.add_argument("--rdzv-timeout", type=float, default=300.0, help="seconds an agent tries to reach node 0's store")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--no-refill", dest="refill", action="store_false", help="do not restart failed slots as spares")
    p.add_argument("--seed", type=int, default=None, help="job seed for per-step RNG (default: from PL_GLOBAL_SEED)")
    add_job_flags(p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchpass", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _launch_parser(sub)
    demo = sub.add_parser("demo", help="3 active + 1 spare train, one is SIGKILLed, and the result is compared")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--run-dir", default="torchpass_runs/demo")
    chaos = sub.add_parser("chaos", help="run seeded fault scenarios (the demo job) and classify each outcome")
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--scenarios", type=int, default=200, help="scenarios 0..N-1 of the seed")
    chaos.add_argument("--only", type=int, nargs="+", default=None, help="replay these scenario indices")
    chaos.add_argument("--work-dir", default="torchpass_runs/chaos", help="run directories (failures are kept)")
    chaos.add_argument("--doc", default=None, help="write the result table into this Markdown file")
    rep = sub.add_parser("report", help="summary table and timeline PNG of a run, from RUN_DIR/events.jsonl")
    rep.add_argument("run_dir")
    ns = parser.parse_args(argv)
    if ns.cmd == "report":
        from torchpass_plugins.observe.report import report

        try:
            report(ns.run_dir)
        except (FileNotFoundError, ValueError) as exc:
            parser.exit(1, f"torchpass report: {exc}\n")
        return 0
    if ns.cmd == "chaos":
        from torchpass_plugins.testing.chaos.cli import run_chaos

        return run_chaos(ns.seed, ns.only if ns.only is not None else range(ns.scenarios), ns.work_dir, ns.doc)
    if ns.cmd == "demo":
        from torchpass_plugins.demo.runner import run_demo

        return run_demo(steps=ns.steps, run_dir=ns.run_dir)
    config = LaunchConfig(
        nproc_per_node=ns.nproc_per_node, nnodes=ns.nnodes, node_rank=ns.node_rank, rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_timeout=ns.rdzv_timeout,
        heartbeat_interval=ns.heartbeat_interval, refill=ns.refill, seed=ns.seed,
        token=os.environ.get("TORCHPASS_JOIN_TOKEN", ""), **job_config(ns),
    )
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
