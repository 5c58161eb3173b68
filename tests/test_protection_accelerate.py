"""Platform mode for Accelerate: a loop written without torchpass (``tests/scripts/unmodified_accelerate.py``:
batch normalization, loader workers adding random noise, gradient accumulation, code between the passes that
changes the optimizer's hyperparameters and runs an evaluation through ``gather_for_metrics``) under
``torchpass launch --protect``: snapshots from the launch, and the resume after a lost worker, every rank
compared with the failure-free run."""

from __future__ import annotations

import textwrap

import pytest
from conftest import differences
from jobs import REPO, run

from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.integrations.accelerate.implicit import NO_LIVE_ENTRY, line

pytestmark = pytest.mark.xdist_group("protection-accelerate")  # the failure-free run is made once

SCRIPT = REPO / "tests" / "scripts" / "unmodified_accelerate.py"
STEPS = 27  # 3 passes of 9 optimizer steps (288 samples, 2 ranks x 8 per batch, 2 micro-batches per step)


def _env(spares: int, snapshot_dir: str = "", every: int = 0) -> WorkerEnv:
    return WorkerEnv(store="127.0.0.1:1", token="t", worker_id="n0-s0-i0", world_size=2, node_rank=0,
                     local_slot=0, run_dir="/tmp", seed=0, heartbeat_interval=0.5, protect=True, spares=spares,
                     snapshot_dir=snapshot_dir, snapshot_every=every)


def test_the_line_says_a_restart_replaces_live_entry_and_what_it_resumes_from():
    assert line(_env(0)) == ("torchpass: Accelerator() without TorchPass's four lines runs under torchpass: a lost "
                             "worker restarts the job; no snapshots (pass --snapshot-dir): a restart begins again "
                             "from step 0")
    assert line(_env(2, "s3://b/j", 5)) == (
        "torchpass: Accelerator() without TorchPass's four lines runs under torchpass: its 2 spare(s) cannot enter "
        "this loop live: a lost worker restarts the job; snapshots every 5 step(s) to s3://b/j, resumed from after "
        "a restart; a resume restores what prepare returned, not the loop's own variables (a step counter starts "
        "over)")


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    job, codes = run(tmp_path_factory.mktemp("failure_free"), nproc=2, spares=0, script=SCRIPT,
                     launch_args=("--protect",))
    assert codes == [0], job.output()[-3000:]
    assert line(_env(0)) in job.output()
    [said] = job.events("protection")
    assert (said["asked"], said["strategy"], said["spares"]) == ("Accelerator()", "TorchPass (implicit)", 0)
    for rank in range(2):
        assert job.applied(rank) == list(range(STEPS))
    return job


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [0, 1])
def test_an_unmodified_loop_restarts_from_the_launchs_snapshot_mid_pass_and_ends_bit_exact(tmp_path, failure_free,
                                                                                          victim):
    """Rank ``victim`` is SIGKILLed in step 14 (the second pass). Its spare cannot enter the loop live, so the
    job restarts and resumes from step 12 (or 8, if 12 had not landed): the first pass runs without its
    batches, the code after it again (the weight decay halved once more, undone as the second pass begins),
    then the second pass from its seventh batch."""
    snapshots = tmp_path / "snapshots"
    job, codes = run(tmp_path, nproc=3, spares=1, script=SCRIPT, faults=f"kill@rank={victim},step=14,phase=reduce",
                     launch_args=("--protect", "--snapshot-dir", str(snapshots), "--snapshot-every", "4",
                                  "--spare-wait", "0"))
    assert codes == [0], job.output()[-3000:]
    assert line(_env(1, str(snapshots), 4)) in job.output()
    [restart] = job.events("job_restart")
    assert restart["message"] == NO_LIVE_ENTRY
    resumed = {e["step"] for e in job.events("snapshot_resumed")}
    assert len(resumed) == 1 and resumed <= {8, 12}, resumed
    [step] = resumed
    assert_every_rank_as(failure_free, job)
    for rank in range(2):  # steps 0..13 before the kill, then from the snapshot on, each once
        assert job.applied(rank) == [*range(14), *range(step, STEPS)], job.applied(rank)
    assert job.leftovers() == []


def assert_every_rank_as(expected, job) -> None:
    for rank in range(2):
        found = differences(expected.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "differs from the failure-free run:\n" + "\n".join(found[:20])


@pytest.mark.timeout(300)
def test_with_the_four_lines_the_same_loop_loses_rank_0_and_a_spare_takes_it_live_batchnorm_included(tmp_path):
    """The buffers a spare receives are those of the step boundary, which every rank holds alike (rank 0's,
    adopted at each commit, as DDP broadcasts them)."""
    four_lines = ("--four-lines",)
    reference, codes = run(tmp_path / "reference", nproc=2, spares=0, script=SCRIPT, train_args=four_lines)
    assert codes == [0], reference.output()[-3000:]
    job, codes = run(tmp_path / "killed", nproc=3, spares=1, script=SCRIPT, train_args=four_lines,
                     faults="kill@rank=0,step=14,phase=reduce")
    assert codes == [0], job.output()[-3000:]
    assert [e["rank"] for e in job.events("failure_detected")] == [0] and not job.events("job_restart")
    assert_every_rank_as(reference, job)
    for rank in range(2):
        assert job.applied(rank) == list(range(STEPS)), job.applied(rank)


_HEAD = ("import torch\n"
         "from accelerate import Accelerator\n"
         "from torch.utils.data import DataLoader, TensorDataset\n"
         "model = torch.nn.Linear(4, 1)\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
         "accelerator = Accelerator(cpu=True)\n"
         "def step(x, y):\n"
         "    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))\n"
         "    optimizer.step()\n"
         "    optimizer.zero_grad()\n")

_LOOPS = {
    "eval_first": ("model, optimizer, held_out, train = accelerator.prepare(\n"
                   "    model, optimizer, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))\n"
                   "for x, y in held_out:\n"
                   "    break\n"
                   "for x, y in train:\n"
                   "    step(x, y)\n",
                   "a backward pass ran on a batch that is not of the first DataLoader given to "
                   "accelerator.prepare, taken for the training loader (or before any pass over it)"),
    "iterable": ("class Stream(torch.utils.data.IterableDataset):\n"
                 "    def __iter__(self):\n"
                 "        return iter([(torch.randn(4), torch.randn(1)) for _ in range(8)])\n"
                 "train = DataLoader(Stream(), batch_size=2)\n"
                 "model, optimizer, train = accelerator.prepare(model, optimizer, train)\n"
                 "for epoch in range(2):\n"
                 "    for x, y in train:\n"
                 "        step(x, y)\n",
                 "is dispatched from rank 0 (an iterable dataset, or dispatch_batches=True)"),
    "left_early": ("model, optimizer, train = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))\n"
                   "for epoch in range(2):\n"
                   "    for i, (x, y) in enumerate(train):\n"
                   "        step(x, y)\n"
                   "        if i == 1:\n"
                   "            break\n",
                   "a pass over the training loader was begun and not finished (a break, or a batch taken"),
    "own_skip": ("model, optimizer, train = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))\n"
                 "for x, y in accelerator.skip_first_batches(train, 2):\n"
                 "    step(x, y)\n",
                 "the script skips batches of the training loader itself"),
    "late_prepare": ("model, optimizer, train = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))\n"
                     "for x, y in train:\n"
                     "    step(x, y)\n"
                     "    break\n"
                     "accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))\n"
                     "for x, y in train:\n"
                     "    step(x, y)\n",
                     "a AcceleratedOptimizer was prepared after training began"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(_LOOPS))
def test_what_an_unmodified_loop_does_that_torchpass_cannot_follow_stops_the_job_with_what_to_change(tmp_path, case):
    loop, message = _LOOPS[case]
    script = tmp_path / f"{case}.py"
    script.write_text(_HEAD + loop + "print('LOOP ENDED')\n")
    job, codes = run(tmp_path, nproc=2, spares=0, script=script, launch_args=("--protect",))
    assert codes == [1], job.output()[-3000:]
    assert message in job.output() and "or add TorchPass's four lines" in job.output()
    assert "LOOP ENDED" not in job.output()


@pytest.mark.timeout(120)
def test_what_an_unmodified_loop_may_do_around_its_steps_is_not_refused(tmp_path):
    """An evaluation inside a training step, a break at a step limit that ends training, a model prepared for a
    final test after training: the job ends normally."""
    script = tmp_path / "around.py"
    script.write_text(_HEAD + textwrap.dedent("""
        model, optimizer, train, held_out = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4),
                                                                DataLoader(data, batch_size=8))
        steps = 0
        for epoch in range(2):
            for x, y in train:
                loss = torch.nn.functional.mse_loss(model(x), y)
                if steps % 3 == 0:
                    with torch.no_grad():
                        held = sum(accelerator.gather_for_metrics(model(a)).sum() for a, _ in held_out)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == 6:
                    break
        final = accelerator.prepare(torch.nn.Linear(4, 1))
        print("LOOP ENDED", steps, sum(1 for _ in held_out))
        """))
    job, codes = run(tmp_path, nproc=2, spares=0, script=script, launch_args=("--protect",))
    assert codes == [0], job.output()[-3000:]
    assert "LOOP ENDED 6 2" in job.output()
