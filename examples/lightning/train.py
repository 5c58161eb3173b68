"""Train a tiny GPT with Lightning, configured by Hydra, surviving the loss of a worker with torchpass.

    python examples/lightning/train.py                    # torchpass=ddp: 2 active ranks + 1 spare
    python examples/lightning/train.py torchpass=fsdp     # sharded; shards survive through ring replicas
    python examples/lightning/train.py torchpass=off      # plain Lightning, in this process
    python examples/lightning/train.py -m trainer.max_steps=20,40   # a sweep: each job with its own spare
    TORCHPASS_FAULTS=kill@rank=1,step=5 python examples/lightning/train.py   # a worker is SIGKILLed mid-run

The config picks torchpass's Hydra launcher (``hydra/launcher: torchpass``): each job runs under its own
``torchpass launch`` (``trainer.devices`` + ``torchpass.spares`` processes), and this function runs in the
workers it starts. On several nodes, start ``torchpass launch ... train.py`` on each node yourself
(``examples/slurm``, ``examples/kubernetes``).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from torchpass_plugins.config import from_mapping


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    import lightning as L

    torchpass = from_mapping(OmegaConf.to_container(cfg.torchpass, resolve=True))
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
