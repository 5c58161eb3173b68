"""The ``torchpass`` command: ``launch`` a job with spares, or run the ``demo``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from torchpass_plugins.audit.options import AuditOptions
from torchpass_plugins.config import AgentConfig, TorchPassConfig, settings
from torchpass_plugins.control.agent import launch
from torchpass_plugins.control.launch_config import LaunchConfig


def add_setting_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """A flag for every setting of ``cls`` that names one (its type, default, allowed values and help come
    from the field), stored under the setting's dotted key."""
    for key, f, kind in settings(cls):
        flag, doc = f.metadata["flag"], f.metadata["doc"]
        if flag is None:
            continue
        default = f.metadata.get("launch_default", f.default)
        if kind is bool:
            p.add_argument(flag, dest=key, action="store_false" if default else "store_true", help=doc)
        else:
            p.add_argument(flag, dest=key, type=kind, default=default, choices=f.metadata["choices"], help=doc)


def from_flags(ns: argparse.Namespace, cls: type) -> object:
    """The ``cls`` that the flags of :func:`add_setting_flags` set (the other settings at their defaults)."""
    config = cls()
    for key, f, _ in settings(cls):
        if f.metadata["flag"] is not None:
            *path, name = key.split(".")
            owner = config
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, getattr(ns, key))
    return config


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a job's supervision, shared by ``torchpass launch`` and ``python -m torchpass_plugins.run``."""
    add_setting_flags(p, TorchPassConfig)
    p.add_argument("script", help="training script (a module: -- -m module)")
    p.add_argument("args", nargs=argparse.REMAINDER)


def command(ns: argparse.Namespace) -> list[str]:
    """The training command given after the flags of :func:`add_job_flags`."""
    return [ns.script, *ns.args] if ns.script != "-m" else ["-m", *ns.args]


def _launch_parser(sub: Any) -> None:  # what ``ArgumentParser.add_subparsers`` returns
    p = sub.add_parser("launch", help="start and supervise the workers of this node (torchrun-like)")
    add_setting_flags(p, AgentConfig)
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
    chaos.add_argument("--links", action="store_true", help="the link scenarios: link faults on test hosts "
                       "(network namespaces; needs root)")
    audit = sub.add_parser("audit", help="measure every device, host and link of the nodes at once, run a live "
                           "drill, and fail on what is far worse than its peers (run on every node, as launch)")
    add_setting_flags(audit, AuditOptions)
    audit.add_argument("--local", action="store_true", help="this machine alone (no other node)")
    rep = sub.add_parser("report", help="summary table and timeline PNG of a run, from RUN_DIR/events.jsonl")
    rep.add_argument("run_dir")
    forks = sub.add_parser("fork-server", help="import torch and Lightning once for successive jobs on this machine "
                           "(a sweep, a test suite): their agents fork their workers' fork server from it")
    forks.add_argument("--socket", required=True, help="the path to listen at: what TORCHPASS_FORK_SERVER names")
    forks.add_argument("--preload", default=TorchPassConfig.preload,
                       help="modules to import once: the jobs' --preload, which must be the same")
    ns = parser.parse_args(argv)
    if ns.cmd == "fork-server":
        from torchpass_plugins.control.fork_server import run

        run(ns.socket, [m for m in ns.preload.split(",") if m.strip()])
        return 0
    if ns.cmd == "audit":
        from torchpass_plugins.audit.run import audit as run_audit

        options = from_flags(ns, AuditOptions)
        try:
            if ns.local:
                if (options.nnodes, options.node_rank) != (1, 0):
                    raise ValueError("--local audits this machine alone: leave out --nnodes and --node-rank")
                options.rdzv_endpoint = "127.0.0.1:0"
            options.validate()
        except ValueError as exc:
            parser.error(str(exc))
        return run_audit(options)
    if ns.cmd == "report":
        from torchpass_plugins.observe.report import report

        try:
            report(ns.run_dir)
        except (FileNotFoundError, ValueError) as exc:
            parser.exit(1, f"torchpass report: {exc}\n")
        return 0
    if ns.cmd == "chaos":
        from torchpass_plugins.testing.chaos.cli import run_chaos

        return run_chaos(ns.seed, ns.only if ns.only is not None else range(ns.scenarios), ns.work_dir, ns.doc,
                         ns.links)
    if ns.cmd == "demo":
        from torchpass_plugins.demo.runner import run_demo

        return run_demo(steps=ns.steps, run_dir=ns.run_dir)
    try:
        config = LaunchConfig.derive(command(ns), from_flags(ns, TorchPassConfig), from_flags(ns, AgentConfig),
                                     token=os.environ.get("TORCHPASS_JOIN_TOKEN", ""))
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
