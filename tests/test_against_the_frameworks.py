"""A second oracle: torchpass against the frameworks' own distributed training.

Every bit-exact test compares a run of torchpass with another run of torchpass, so a mistake both share
(a missing average, the data sharded wrong, a gradient scaled twice) would pass them all. Here the same
model and data train under torchpass and under what a user would run without it: Lightning's ``ddp``
(for ``torchpass_ddp``), plain FSDP2 with the same units (Lightning's ``ModelParallelStrategy``, for
``torchpass_fsdp``) and the Accelerate loop without ``TorchPass`` (its
``DistributedDataParallel``), with nothing random that torchpass draws differently by design (no dropout,
no augmentation). The final weights must agree to float tolerance (the sums run in another order), while
training has moved them far from where they started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from jobs import REPO, free_port, run, run_command

SCRIPT = Path(__file__).parent / "scripts" / "framework_pair.py"
EXAMPLE = REPO / "examples" / "accelerate" / "train.py"
EXACT_RANDOMNESS = ("--noise", "0", "--dropout", "0")
pytestmark = pytest.mark.timeout(300)


def assert_agree(got: dict, want: dict, start: dict | None = None) -> None:
    for name, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(got[name], value), name
    if start is not None:  # the comparison has teeth: training moved every weight matrix 1000x the tolerance
        for name, value in start.items():
            if name.endswith("weight") and value.dim() == 2:
                assert (want[name] - value).abs().max() > 1e-3, name


def framework_run(out: Path, strategy: str) -> dict:
    job, codes = run_command(out, [sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out / "out")])
    assert codes == [0], job.output()[-3000:]
    return torch.load(out / "out" / "weights.pt")


@pytest.mark.parametrize(("strategy", "framework"), [("torchpass_ddp", "ddp"), ("torchpass_fsdp", "fsdp2")])
def test_a_torchpass_strategy_trains_as_the_frameworks_own(tmp_path, strategy, framework):
    want = framework_run(tmp_path / framework, framework)
    job, codes = run(tmp_path / strategy, nproc=3, spares=0, script=SCRIPT, train_args=("--strategy", strategy))
    assert codes == [0], job.output()[-3000:]
    from torchpass_plugins.demo.train import Classifier

    torch.manual_seed(7)  # L.seed_everything(7), as the script
    assert_agree(torch.load(job.out / "weights.pt"), want, start=Classifier().state_dict())


def test_an_accelerate_loop_trains_as_without_torchpass(tmp_path):
    plain, codes = run_command(tmp_path / "plain", [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "3",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(EXAMPLE), "--out", str(tmp_path / "plain" / "out"),
        *EXACT_RANDOMNESS])  # fmt: skip
    assert codes == [0], plain.output()[-3000:]
    assert "UnprotectedRunWarning" in plain.output()  # it did run without torchpass
    job, codes = run(tmp_path / "torchpass", nproc=3, spares=0, script=EXAMPLE, train_args=EXACT_RANDOMNESS)
    assert codes == [0], job.output()[-3000:]
    assert_agree(torch.load(job.out / "final.pt")["weights"], torch.load(plain.out / "final.pt")["weights"])
