"""``python -m torchpass_plugins.run [flags] script.py [args]``: a per-slot supervisor for torchrun and
``accelerate launch``.

torchrun's agent (which ``accelerate launch`` runs) kills every process it started as soon as one exits.
So under it, each process it starts is this thin supervisor instead of the training script: a torchpass
agent with one slot, whose node rank is torchrun's ``RANK``, sharing torchrun's store. The supervisors
never exit early, so torchrun never sees a failure; each runs the script as its worker, restarts or
replaces it as ``torchpass launch`` would, and spares work. Accelerate's settings reach the script
through the environment as usual::

    accelerate launch --multi_gpu --num_processes 4 -m torchpass_plugins.run --spares 1 train.py --lr 3e-4
    torchrun --nproc-per-node 4 -m torchpass_plugins.run --spares 1 train.py
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

from torchpass_plugins.cli import add_job_flags, command, from_flags
from torchpass_plugins.config import AgentConfig, TorchPassConfig
from torchpass_plugins.control.agent import launch
from torchpass_plugins.control.launch_config import LaunchConfig
from torchpass_plugins.errors import with_prefix

# torchrun's view of this process: the script must not mistake it for its own (its ranks are torchpass's).
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def config_from_torchrun(argv: list[str], environ: dict[str, str]) -> LaunchConfig:
    p = argparse.ArgumentParser(prog="python -m torchpass_plugins.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_flags(p)
    ns = p.parse_args(argv)
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in environ]
    if missing:
        p.error(f"not started by torchrun / accelerate launch (no {', '.join(missing)}): use `torchpass launch`, "
                "or give accelerate launch --multi_gpu (without it, a machine with no GPU gets one plain process)")
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    # Every supervisor of the job derives the same join token (unless one is given).
    token = environ.get("TORCHPASS_JOIN_TOKEN") or hashlib.sha256(
        f"{run_id}|{environ['MASTER_ADDR']}|{environ['MASTER_PORT']}".encode()).hexdigest()[:32]
    # torchrun's layout: each of its processes is a one-slot node of the job; the rest at AgentConfig's defaults.
    layout = AgentConfig(nproc_per_node=1, nnodes=int(environ["WORLD_SIZE"]), node_rank=int(environ["RANK"]),
                         rdzv_endpoint=f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}")
    return LaunchConfig.derive(command(ns), from_flags(ns, TorchPassConfig), layout, token=token,
                               first_slot=int(environ["LOCAL_RANK"]), external_store=True)


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_torchrun(sys.argv[1:] if argv is None else argv, dict(os.environ))
        config.validate()
    except ValueError as exc:
        print(with_prefix(str(exc)), file=sys.stderr)
        return 2
    for var in _TORCHRUN_VARS:
        os.environ.pop(var, None)
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
