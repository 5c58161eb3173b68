"""``LightningCLI`` as its users run it: ``fit --trainer.strategy=torchpass_ddp
--trainer.callbacks+=torchpass_plugins.TorchPassCallback --trainer.devices=auto`` under ``torchpass launch``,
a worker killed, every rank compared with the failure-free run; and the strategies' and callback's
arguments in ``--help``, each with its documentation."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import run

from torchpass_plugins import TorchPassCallback, TorchPassDDPStrategy, TorchPassFSDPStrategy
from torchpass_plugins.testing.chaos.oracle import differences

CLI = Path(__file__).parent / "scripts" / "cli_app.py"
STEPS = 10
FIT = ("fit", "--trainer.strategy=torchpass_ddp", "--trainer.callbacks+=torchpass_plugins.TorchPassCallback",
       "--trainer.devices=auto",  # the job's active ranks: the count is written once, on the command line
       f"--trainer.max_steps={STEPS}", "--trainer.accumulate_grad_batches=2", "--trainer.enable_progress_bar=false")
# (Lightning's default logger and ModelCheckpoint stay on: their directory is rank 0's, whoever holds it.)


@pytest.mark.timeout(400)
@pytest.mark.xdist_group("lightning-cli")
def test_lightning_cli_under_torchpass_launch_replaces_a_killed_rank_0_bit_exactly(tmp_path):
    failure_free, codes = run(tmp_path / "failure-free", nproc=3, spares=0, script=CLI,
                              train_args=(*FIT, f"--trainer.default_root_dir={tmp_path / 'failure-free' / 'root'}"))
    assert codes == [0], failure_free.output()[-3000:]
    root = tmp_path / "killed" / "root"
    job, codes = run(tmp_path / "killed", nproc=4, spares=1, script=CLI, train_args=(
        *FIT, f"--trainer.default_root_dir={root}"), faults="kill@rank=0,step=4,phase=backward")
    assert codes == [0], job.output()[-3000:]
    assert job.leftovers() == []
    assert [(e["rank"], e["code"]) for e in job.events("failure_detected")] == [(0, -9)]
    assert list(next(e for e in job.events("roster_published") if e["gen"] == 1)["promoted"].values()) == [0]
    # the spare that took rank 0 over logged and checkpointed into the run's one directory
    assert [p.name for p in (root / "lightning_logs").iterdir()] == ["version_0"]
    assert [p.name for p in (root / "lightning_logs" / "version_0" / "checkpoints").iterdir()] == [
        f"epoch=0-step={STEPS}.ckpt"]
    for rank in range(3):  # devices="auto" made 3 active ranks of 4 processes with 1 spare
        assert job.applied(rank) == failure_free.applied(rank) == list(range(STEPS)), f"rank {rank}"
        assert differences(job.state(rank), failure_free.state(rank)) == [], f"rank {rank}"


def _documented_options(help_text: str, prefix: str) -> dict[str, str]:
    """Each ``--PREFIX.NAME`` option of a jsonargparse help text, with its description (its type left out)."""
    blocks = re.split(rf"\n  --{re.escape(prefix)}\.", "\n" + help_text)[1:]
    options = {}
    for block in blocks:
        name, rest = block.split(maxsplit=1)
        if not name.endswith(".help"):
            options[name] = " ".join(rest.split("(type:")[0].split()[1:])  # after the metavar
    return options


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("option", "cls"), [("trainer.strategy", TorchPassDDPStrategy),
                                             ("trainer.strategy", TorchPassFSDPStrategy),
                                             ("trainer.callbacks", TorchPassCallback)])
def test_help_shows_every_argument_of_the_strategies_and_the_callback_with_its_documentation(option, cls):
    result = subprocess.run([sys.executable, str(CLI), "fit", f"--{option}.help", f"torchpass_plugins.{cls.__name__}"],
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-2000:]
    documented = _documented_options(result.stdout, option)
    arguments = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    assert sorted(documented) == sorted(arguments)
    assert [name for name, text in documented.items() if not text] == []  # every one with its documentation
