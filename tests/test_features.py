"""Lightning features users turn on every day, all at once (``scripts/lightning_features.py``: a
``LightningDataModule`` with ``prepare_data``, augmenting loader workers, BatchNorm, two parameter groups,
two LR schedulers, torchmetrics and ``sync_dist`` values per step and per epoch, gradient clipping,
accumulation of 4, validation every 12 batches with ``ModelCheckpoint`` and ``EarlyStopping``, 3 epochs),
under both strategies in ``bf16-mixed`` and ``16-mixed`` (with a loss scaler, whose state is part of
the rank's; ``32-true`` is the other suites' precision). A SIGKILL between
micro-batches of a later epoch, of rank 0 as well as of another rank, must leave every rank's full state
(callbacks' included) equal to the failure-free run's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs import Job, run

from torchpass_plugins.testing.chaos.oracle import differences

SCRIPT = Path(__file__).parent / "scripts" / "lightning_features.py"
STEPS = 15  # 3 epochs of 80 samples per rank, batches of 4, 4 micro-batches per step
DDP_BF16 = ("--strategy", "torchpass_ddp", "--precision", "bf16-mixed", "--persistent-workers")
FSDP_BF16 = ("--strategy", "torchpass_fsdp", "--precision", "bf16-mixed", "--stateful-loader")
# SyncBatchNorm in 16-mixed, with a GradScaler (on CPU too)
DDP_SYNC_BN = ("--strategy", "torchpass_ddp", "--sync-batchnorm", "--precision", "16-mixed")
FSDP_SYNC_BN = ("--strategy", "torchpass_fsdp", "--sync-batchnorm", "--precision", "16-mixed")
pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("features")]  # one worker: shared references


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    cache: dict[tuple[str, ...], Job] = {}

    def get(args: tuple[str, ...]) -> Job:
        if args not in cache:
            job, codes = run(Path(tmp_path_factory.mktemp("features-reference")), nproc=3, spares=0,
                             script=SCRIPT, train_args=args)
            assert codes == [0], job.output()[-3000:]
            cache[args] = job
        return cache[args]

    return get


@pytest.mark.parametrize(
    ("args", "fault"),
    [
        # (the spare enters at step 8's boundary, right after a mid-epoch validation: val_check_interval=12)
        (DDP_BF16, "kill@rank=0,step=8,phase=data,micro=2"),
        (FSDP_BF16, "kill@rank=1,step=9,phase=forward,micro=1"),
        # inside a SyncBatchNorm collective: the default group's 6th operation of the step (backward, micro 2)
        (DDP_SYNC_BN, "kill@rank=0,step=8,phase=collective,micro=5"),
        (FSDP_SYNC_BN, "kill@rank=2,step=9,phase=collective,micro=2"),
        (FSDP_BF16, "kill@rank=0,step=8,phase=reduce"),  # the same boundary, from step 8's replicas
    ],
    ids=["ddp-bf16-rank0", "fsdp-bf16-rank1", "ddp-syncbn-fp16-rank0", "fsdp-syncbn-fp16-rank2",
         "fsdp-after-validation-rank0"],
)
def test_a_kill_between_micro_batches_of_a_later_epoch_is_bit_exact_on_every_rank(tmp_path, failure_free, args, fault):
    expected = failure_free(args)
    job, codes = run(tmp_path, nproc=4, spares=1, script=SCRIPT, train_args=args, faults=fault)
    assert codes == [0], job.output()[-3000:]
    assert len(job.events("failure_detected")) == 1 and len(job.events("spare_promoted")) == 1
    if "phase=reduce" in fault:  # the spare enters at that step's boundary, from its replicas
        assert {(e["restore_step"], e["steps_rolled_back"]) for e in job.events("recovered")} == {(8, 0)}
    for rank in range(3):
        found = differences(expected.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "differs from the failure-free run:\n" + "\n".join(found[:20])
        assert job.applied(rank) == list(range(STEPS)), f"rank {rank} applied {job.applied(rank)}"
    assert job.leftovers() == []


def test_sync_batchnorm_keeps_one_set_of_statistics_over_every_rank(failure_free):
    """``Trainer(sync_batchnorm=True)`` on CPU: the layer is torchpass's ``SyncBatchNorm`` (whose statistics
    over the whole batch ``test_sync_batchnorm.py`` checks), the same on every rank."""
    synced = failure_free(DDP_SYNC_BN)
    states = [synced.state(rank) for rank in range(3)]
    assert {s["batchnorm"] for s in states} == {"SyncBatchNorm"}
    for key in ("body.1.running_mean", "body.1.running_var"):
        assert all(torch.equal(s["module"][key], states[0]["module"][key]) for s in states), key


def test_metrics_are_computed_over_every_rank(failure_free):
    """torchmetrics and ``on_epoch`` values span the job (the default ``torch.distributed`` group is the
    recoverable one), while a metric's per-step value stays the rank's own, as under Lightning's ``ddp``."""
    job = failure_free(DDP_BF16)
    metrics = [job.state(rank)["callback_metrics"] for rank in range(3)]
    for name in ("train_acc_epoch", "train_loss_epoch", "val_acc", "val_loss"):
        assert all(m[name].item() == metrics[0][name].item() for m in metrics), name
    assert len({m["train_acc_step"].item() for m in metrics}) > 1  # local: the ranks' batches differ


def test_a_rank_lost_after_an_epochs_last_optimizer_step_never_leaves_values_of_fewer_ranks(tmp_path, failure_free):
    """Rank 0 dies right after epoch 0's last optimizer step; the others then compute the epoch's metrics
    (collectives no spare can join: it enters at the next step boundary). They must not log their own
    values: the job says why and restarts (from the start: this script writes no snapshots), and every rank
    ends as in the failure-free run. (``torchpass_ddp`` takes the same path as the Accelerate evaluation in
    ``test_accelerate.py``.)"""
    args = FSDP_BF16
    job, codes = run(tmp_path, nproc=4, spares=1, script=SCRIPT, train_args=args,
                     faults="kill@rank=0,step=4,phase=optimizer")
    assert codes == [0], job.output()[-3000:]
    [restart] = job.events("job_restart")
    assert "after step 4's optimizer step" in restart["message"]
    expected = failure_free(args)
    for rank in range(3):
        found = differences(expected.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "differs from the failure-free run:\n" + "\n".join(found[:20])
    assert job.leftovers() == []
