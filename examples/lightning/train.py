"""Train a tiny GPT with Lightning, configured by Hydra, surviving the loss of a worker with torchpass.

    python examples/lightning/train.py                    # torchpass=ddp: 2 active ranks + 1 spare
    python examples/lightning/train.py torchpass=fsdp     # sharded; shards survive through ring replicas
    python examples/lightning/train.py torchpass=off      # plain Lightning, in this process
    TORCHPASS_FAULTS=kill@rank=1,step=5 python examples/lightning/train.py   # a worker is SIGKILLed mid-run

Started by hand with torchpass on, the script runs ``torchpass launch`` of itself (``trainer.devices`` +
``torchpass.spares`` processes, the same overrides, one Hydra run directory) and waits for it; in the
workers that launch starts, it trains. On several nodes, start ``torchpass launch ... train.py`` on
each node yourself (``examples/slurm``, ``examples/kubernetes``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from torchpass_plugins.config import TorchPassConfig, from_mapping, in_torchpass_worker
from torchpass_plugins.errors import ConfigError


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        torchpass = from_mapping(OmegaConf.to_container(cfg.torchpass, resolve=True))
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    if torchpass.enabled and not in_torchpass_worker():
        code = relaunch(cfg, torchpass)
        if code:
            sys.exit(code)
        return
    train(cfg, torchpass)


def relaunch(cfg: DictConfig, torchpass: TorchPassConfig) -> int:
    """Run this script under ``torchpass launch`` and return its exit code. A child rather than ``exec``, so
    that a multirun (``-m``) goes on to its next job; Lightning is imported by the workers only."""
    if cfg.trainer.num_nodes != 1 or not isinstance(cfg.trainer.devices, int):
        sys.exit("error: the self-launch covers one node and an integer trainer.devices; on several nodes run "
                 "`torchpass launch` on each (see examples/slurm)")
    hydra_cfg = HydraConfig.get()
    replaced = ("hydra.mode=", "hydra.run.dir=", "hydra.output_subdir=")
    argv = [sys.executable, "-m", "torchpass_plugins.cli", "launch",
            "--nproc-per-node", str(cfg.trainer.devices + torchpass.spares), *torchpass.launch_argv(),
            str(Path(__file__).resolve()), *hydra_cfg.overrides.task,
            *(o for o in hydra_cfg.overrides.hydra if not o.startswith(replaced)),
            f"hydra.run.dir={hydra_cfg.runtime.output_dir}", "hydra.output_subdir=null"]  # one run dir, one .hydra/
    agent = subprocess.Popen(argv)
    forward = {sig: signal.signal(sig, lambda signum, _: agent.send_signal(signum))  # it stops its workers
               for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return agent.wait()
    finally:
        for sig, previous in forward.items():
            signal.signal(sig, previous)


def train(cfg: DictConfig, torchpass: TorchPassConfig) -> None:
    import lightning as L

    L.seed_everything(cfg.seed)
    data = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model, vocab_size=data.vocab_size)
    trainer = hydra.utils.instantiate(cfg.trainer, **torchpass.trainer_kwargs())
    trainer.fit(model, data)
    if cfg.save_checkpoint:
        trainer.save_checkpoint(cfg.save_checkpoint)  # every rank calls it; the strategy decides who writes
    if trainer.is_global_zero:
        loss = trainer.callback_metrics.get("train_loss")
        print(f"trained {trainer.global_step} steps with {type(trainer.strategy).__name__}, "
              f"last train_loss {'-' if loss is None else f'{float(loss):.3f}'}", flush=True)


if __name__ == "__main__":
    main()
