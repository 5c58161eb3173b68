"""Platform mode: what a Trainer written without torchpass gets under ``torchpass launch --protect`` and
``--snapshot-dir``, decided from its arguments (in-process), and real jobs of an unmodified script: a worker
SIGKILLed (rank 0) or more lost than spares (a restart from the launch's snapshots), every rank compared with
the failure-free run; what cannot be protected refused before training."""

from __future__ import annotations

import textwrap

import pytest
from conftest import differences
from jobs import REPO, run

from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.callback import TorchPassCallback
from torchpass_plugins.integrations.lightning.protection import decide

SCRIPT = REPO / "tests" / "scripts" / "unmodified_lightning.py"
STEPS = 24  # the script's --max-steps


def env(protect: bool = True, world_size: int = 2, spares: int = 1, snapshot_dir: str = "", every: int = 0):
    return WorkerEnv(store="127.0.0.1:1", token="t", worker_id="n0-s0-i0", world_size=world_size, node_rank=0,
                     local_slot=0, run_dir="/tmp", seed=0, heartbeat_interval=0.5, protect=protect, spares=spares,
                     snapshot_dir=snapshot_dir, snapshot_every=every)


@pytest.mark.parametrize(("asked", "given"), [("ddp", "torchpass_ddp"), ("fsdp", "torchpass_fsdp"),
                                              ("auto", "torchpass_ddp"), (None, "torchpass_ddp"),
                                              ("torchpass_fsdp", "torchpass_fsdp")])
def test_protect_gives_lightnings_strategies_their_torchpass_counterpart(asked, given):
    arguments = {"max_steps": 3} if asked is None else {"strategy": asked, "max_steps": 3}
    protection = decide(arguments, env(), TorchPassCallback)
    assert protection.arguments == {"strategy": given, "max_steps": 3}
    assert protection.line(spares=1).startswith(
        f"torchpass: Trainer(strategy={asked or 'auto'!r})" + (f" runs on {given}" if asked != given else "")
        + ": a lost worker is replaced live by one of 1 spare(s); no snapshots (pass --snapshot-dir)")


@pytest.mark.parametrize(("asked", "message"), [
    ("deepspeed", "Trainer(strategy='deepspeed') cannot be protected: only 'ddp', 'fsdp' and 'auto'"),
    ("ddp_spawn", "Trainer(strategy='ddp_spawn') cannot be protected"),
    ("DDPStrategy", "Trainer(strategy=DDPStrategy(...)) cannot be protected: it replaces the strategies asked for "
                    "by name"),
])
def test_protect_refuses_what_has_no_torchpass_counterpart(asked, message):
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(find_unused_parameters=True) if asked == "DDPStrategy" else asked
    with pytest.raises(ConfigError, match=r"^torchpass --protect: ") as refused:
        decide({"strategy": strategy}, env(), TorchPassCallback)
    assert message in str(refused.value) and "Nothing was trained" in str(refused.value)


def test_without_protect_lightnings_own_strategy_is_refused_on_several_ranks_and_left_alone_on_one():
    for world_size in (2, 1):  # (one rank: Lightning's DDP would still start a process group of its own)
        with pytest.raises(ConfigError, match=rf"launch started {world_size} active rank\(s\), but Trainer\("
                                              r"strategy='ddp'\) does not"):
            decide({"strategy": "ddp"}, env(protect=False, world_size=world_size), TorchPassCallback)
    assert decide({"strategy": "auto"}, env(protect=False, world_size=1, spares=0), TorchPassCallback) is None
    ours = type("Ours", (), {"strategy_name": "torchpass_ddp"})()  # (a TorchPassDDPStrategy joins a job as built)
    assert decide({"strategy": ours}, env(protect=False), TorchPassCallback) is None  # nothing to say
    with pytest.raises(ConfigError, match=r"--snapshot-dir: Trainer\(strategy='auto'\) is not a torchpass strategy"):
        decide({}, env(protect=False, world_size=1, snapshot_dir="/s"), TorchPassCallback)


def test_the_launchs_snapshots_reach_a_trainer_and_a_scripts_own_stand():
    launch = env(spares=0, snapshot_dir="s3://b/job", every=5)
    added = decide({"strategy": "ddp"}, launch, TorchPassCallback)
    [callback] = added.arguments["callbacks"]
    assert (callback.snapshot_dir, callback.snapshot_every_n_steps) == ("s3://b/job", 5)
    assert added.line(spares=0, borrow=True) == (
        "torchpass: Trainer(strategy='ddp') runs on torchpass_ddp: no spare (--spares 0): a lost worker restarts the "
        "job, unless a device borrowed from a lending job (--borrow) takes its rank; snapshots every 5 step(s) to "
        "s3://b/job, resumed from after a restart")
    publishing = TorchPassCallback(publish_weights="tcp://127.0.0.1:1")  # the script's, with no snapshots
    completed = decide({"strategy": "ddp", "callbacks": publishing}, launch, TorchPassCallback)
    assert completed.arguments["callbacks"] == [publishing] and publishing.snapshot_dir == "s3://b/job"
    from omegaconf import ListConfig

    listed = TorchPassCallback()  # hydra.utils.instantiate hands callbacks over as a ListConfig
    completed = decide({"callbacks": ListConfig([listed], flags={"allow_objects": True})}, launch, TorchPassCallback)
    assert completed.arguments["callbacks"] == [listed] and listed.snapshot_dir == "s3://b/job"
    own = TorchPassCallback(snapshot_dir="/mine", snapshot_every_n_steps=2)
    kept = decide({"strategy": "torchpass_ddp", "callbacks": [own]}, launch, TorchPassCallback)
    assert kept.arguments["callbacks"] == [own] and own.snapshot_dir == "/mine"
    assert kept.line(spares=0).endswith("snapshots every 2 step(s) to /mine, resumed from after a restart; the "
                                        "script's own snapshots stand, not --snapshot-dir s3://b/job")


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    job, codes = run(tmp_path_factory.mktemp("failure_free"), nproc=2, spares=0, script=SCRIPT,
                     launch_args=("--protect",))
    assert codes == [0], job.output()[-3000:]
    return job


def assert_every_rank_as_failure_free(job, failure_free) -> None:
    for rank in range(2):
        found = differences(failure_free.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "differs from the failure-free run:\n" + "\n".join(found[:20])
    assert job.state(0)["global_step"] == STEPS
    assert job.leftovers() == []


@pytest.mark.timeout(300)
def test_an_unmodified_script_under_protect_loses_rank_0_and_goes_on_bit_exact(tmp_path, failure_free):
    job, codes = run(tmp_path, nproc=3, spares=1, script=SCRIPT, launch_args=("--protect",),
                     faults="kill@rank=0,step=9,phase=reduce")
    assert codes == [0], job.output()[-3000:]
    assert ("torchpass: Trainer(strategy='ddp') runs on torchpass_ddp: a lost worker is replaced live by one of 1 "
            "spare(s); no snapshots (pass --snapshot-dir): a restart begins again from step 0") in job.output()
    [said] = job.events("protection")
    assert (said["asked"], said["strategy"], said["spares"]) == ("'ddp'", "torchpass_ddp", 1)
    assert [e["rank"] for e in job.events("failure_detected")] == [0] and not job.events("job_restarting")
    assert_every_rank_as_failure_free(job, failure_free)
    for rank in range(2):  # every step applied once: the survivor recomputed nothing
        assert job.applied(rank) == list(range(STEPS)), f"rank {rank} applied {job.applied(rank)}"


@pytest.mark.timeout(300)
def test_the_launchs_snapshots_restart_an_unmodified_script_that_lost_more_workers_than_spares(tmp_path,
                                                                                              failure_free):
    snapshots = tmp_path / "snapshots"
    job, codes = run(tmp_path, nproc=2, spares=0, script=SCRIPT, faults="kill@rank=1,step=14,phase=reduce",
                     launch_args=("--protect", "--snapshot-dir", str(snapshots), "--snapshot-every", "4",
                                  "--spare-wait", "0"))
    assert codes == [0], job.output()[-3000:]
    assert (f"no spare (--spares 0): a lost worker restarts the job; snapshots every 4 step(s) to {snapshots}, "
            "resumed from after a restart") in job.output()
    assert len(job.events("job_restarting")) == 1
    resumed = {e["step"] for e in job.events("snapshot_resumed")}
    assert len(resumed) == 1 and resumed <= {8, 12}, resumed  # 8 if rank 1 died before its part of 12 landed
    assert_every_rank_as_failure_free(job, failure_free)


def _write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["accelerate", "own_process_group", "deepspeed"])
def test_what_torchpass_cannot_see_or_protect_is_refused_before_training(tmp_path, case):
    loops = {
        "accelerate": """
            from accelerate import Accelerator
            Accelerator(cpu=True)
            print("TRAINING BEGAN")
            """,
        "own_process_group": """
            import torch.distributed as dist
            dist.init_process_group("gloo")
            print("TRAINING BEGAN")
            """,
    }
    script = _write(tmp_path / f"{case}_loop.py", loops[case]) if case in loops else SCRIPT
    train, launch = (), () if case == "accelerate" else ("--protect",)  # (--protect protects Accelerate loops)
    message = {
        "accelerate": "its Accelerator is built before any TorchPass(), so it does not join the job",
        "own_process_group": "this process starts a process group of its own (init_process_group(backend='gloo'), "
                             "from the script's loop or a strategy of Lightning's own), which torchpass cannot see",
        "deepspeed": "Trainer(strategy='deepspeed') cannot be protected",
    }[case]
    if case == "deepspeed":
        train = ("--strategy", "deepspeed")
    job, codes = run(tmp_path, nproc=2, spares=0, script=script, train_args=train, launch_args=launch)
    assert codes == [1], job.output()[-3000:]
    assert message in job.output() and "stopped on a configuration error before joining the job" in job.output()
    assert "TRAINING BEGAN" not in job.output() and not job.events("worker_ready") and not job.events("progress")
    assert len(job.events("worker_started")) == 2 and job.leftovers() == []
