"""A user's Hydra app as the launcher wants it, run by the tests: ``@hydra.main`` and a Trainer built from the
config, nothing else of torchpass's. It trains the demo's classifier (loader workers adding random noise);
every logical rank records the optimizer steps it applied and writes its full state at the end, in
``OUTPUT_DIR/out``, so that a job with a failure is compared with a failure-free job rank by rank."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from torchpass_plugins.config import from_mapping


@hydra.main(version_base="1.3", config_path="hydra_app", config_name="app")
def main(cfg: DictConfig) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from torchpass_plugins.demo.train import Augmented, Classifier, make_dataset, rank_state

    torchpass = from_mapping(OmegaConf.to_container(cfg.torchpass, resolve=True))
    L.seed_everything(7)
    model = Classifier()
    model.out_dir = Path(HydraConfig.get().runtime.output_dir) / "out"
    model.out_dir.mkdir(exist_ok=True)
    loader = DataLoader(Augmented(make_dataset(), 0.05), batch_size=8, shuffle=True, num_workers=2)
    trainer = hydra.utils.instantiate(cfg.trainer, **torchpass.trainer_kwargs())
    trainer.fit(model, loader)
    torch.save(rank_state(trainer, model), model.out_dir / f"state_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
