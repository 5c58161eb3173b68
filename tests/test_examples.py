"""The examples: the Lightning one runs (under ``torchpass launch`` with a SIGKILL, and as plain Lightning);
the Slurm and Kubernetes ones cannot run here, so their syntax and their ``torchpass launch`` flags are checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jobs import Job, service_port

from torchpass_plugins.cli import main as torchpass_cli

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "lightning" / "train.py"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
MANIFESTS = REPO / "examples" / "kubernetes" / "torchpass-job.yaml"
RL = REPO / "examples" / "rl" / "run.py"
ETCD_MANIFESTS = REPO / "examples" / "kubernetes" / "etcd.yaml"
SMOKE = ("trainer.max_steps=12",)
# Runs the example as ``python train.py ...`` would, then reports which torchpass modules were imported.
_PROBE = """
import json, runpy, sys
sys.argv = sys.argv[1:]
sys.path[0] = sys.argv[0].rsplit("/", 1)[0]
runpy.run_path(sys.argv[0], run_name="__main__")
print("MODULES", json.dumps(sorted(m for m in sys.modules if m.startswith("torchpass_plugins"))))
"""


def _env(faults: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    return {**env, "TORCHPASS_FAULTS": faults} if faults else env


def _run_example(tmp_path: Path, faults: str = "") -> Job:
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_dir = tmp_path / "run"  # hydra.run.dir: also the torchpass run directory
    log = tmp_path / "example.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(EXAMPLE), "torchpass=ddp", *SMOKE, f"hydra.run.dir={run_dir}",
                                 f"save_checkpoint={tmp_path / 'final.ckpt'}"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=_env(faults),
                                start_new_session=True)
    job = Job(run_dir, agents=[proc], logs=[log])
    try:
        codes = job.wait(timeout=200)
    finally:
        job.kill()
    assert codes == [0], job.output()[-4000:]
    assert job.leftovers() == []
    return job


@pytest.mark.timeout(400)
def test_lightning_example_runs_each_job_under_torchpass_launch_with_a_spare_and_survives_a_kill(tmp_path):
    job = _run_example(tmp_path / "killed", "kill@rank=1,step=5")
    started = job.events("agent_started")[0]
    assert (started["slots"], started["spares"], started["world_size"]) == (3, 1, 2)  # devices 2 + 1 spare
    failure = job.events("failure_detected")[0]
    assert (failure["rank"], failure["code"]) == (1, -9)
    roster = next(e for e in job.events("roster_published") if e["gen"] == 1)
    assert list(roster["promoted"].values()) == [1]  # a spare took logical rank 1
    assert sorted(e["rank"] for e in job.events("recovered") if e["gen"] == 1) == [0, 1]
    assert job.events("job_finished")[-1]["outcome"] == "done"
    assert "trained 12 steps with TorchPassDDPStrategy" in job.output()
    # The model it trained is, bit for bit, the one a run without the kill trains.
    _run_example(tmp_path / "failure-free")
    got, want = (torch.load(tmp_path / run / "final.ckpt", weights_only=False) for run in ("killed", "failure-free"))
    assert got["global_step"] == want["global_step"] == 12
    assert want["state_dict"].keys() == got["state_dict"].keys()
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), f"{name} differs from the failure-free run"
    for mine, theirs in zip(got["optimizer_states"], want["optimizer_states"], strict=True):
        for key, state in theirs["state"].items():
            for field, value in state.items():
                assert torch.equal(mine["state"][key][field], value), f"optimizer state {key}.{field}"


@pytest.mark.timeout(400)
def test_rl_example_goes_on_through_a_killed_publisher_and_a_killed_replica(tmp_path):
    """The trainer's rank 0, which publishes, is SIGKILLed at step 12 and a replica mid-run: the replicas
    get every version whole and in order from whichever process holds rank 0, and the trained weights
    equal a failure-free run's on the same batches, and the replicas'."""
    run_dir = tmp_path / "rl"
    example = subprocess.Popen([sys.executable, str(RL), "--run-dir", str(run_dir), "--port", str(service_port())],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        output = example.communicate(timeout=360)[0]
    finally:  # on a timeout, SIGTERM makes the example stop everything it started
        if example.poll() is None:
            example.terminate()
            try:
                example.wait(timeout=30)
            except subprocess.TimeoutExpired:
                example.kill()
    assert example.returncode == 0, output[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checks"] and all(summary["checks"].values()), summary["checks"]
    assert summary["published"] == list(range(41))
    job = Job(run_dir / "with-failures")
    killed = job.events("failure_detected")[0]["time"]
    before = {e["version"] for e in job.events("weights_published") if e["time"] < killed}
    after = {e["version"] for e in job.events("weights_published") if e["time"] > killed}
    assert before and after and min(after) <= max(before) + 1  # the spare that took rank 0 over went on at once
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"


@pytest.mark.timeout(120)
def test_lightning_example_with_torchpass_off_is_plain_lightning_in_process(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(EXAMPLE), "torchpass=off", "trainer.devices=1", *SMOKE,
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=100,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 12 steps with SingleDeviceStrategy" in result.stdout
    modules = json.loads(result.stdout.split("MODULES", 1)[1])
    training = ("torchpass_plugins.integrations", "torchpass_plugins.core.runtime", "torchpass_plugins.control.agent",
                "torchpass_plugins.control.coordinator", "torchpass_plugins.control.zygote")
    assert [m for m in modules if m.startswith(training)] == []
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no agent, no worker


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("override", "message"),
    [("torchpass.spare=2", "Key 'spare' not in 'TorchPassConfig'"),
     ("torchpass.mode=dpp", "mode='dpp' is not allowed; use ddp | fsdp")],
)
def test_lightning_example_refuses_a_bad_setting_with_its_name(tmp_path, override, message):
    result = subprocess.run([sys.executable, str(EXAMPLE), override], capture_output=True, text=True, cwd=tmp_path,
                            env=_env(), timeout=50)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def launch_flags() -> set[str]:
    """Every flag that ``torchpass launch --help`` lists."""
    import contextlib
    import io

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        torchpass_cli(["launch", "--help"])
    return set(re.findall(r"--[a-z][a-z-]*", help_text.getvalue()))


def _flags_of_launch(command: str) -> list[str]:
    """The flags between ``torchpass launch`` and the training script."""
    launch = re.search(r"torchpass launch (--.*?)examples/lightning/train\.py", command, re.DOTALL)
    assert launch, "no torchpass launch command"
    return re.findall(r"(--[a-z][a-z-]*)", launch.group(1))


def test_slurm_script_is_valid_bash_and_starts_one_agent_per_node(launch_flags):
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "srun --ntasks-per-node=1" in text
    store_flags = re.findall(r"(--[a-z][a-z-]*)", " ".join(re.findall(r'STORE_FLAGS="(.*)"', text)))
    flags = _flags_of_launch(text.replace("\\\n", " ")) + store_flags
    assert {"--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--spares"} <= set(flags)
    assert set(flags) <= launch_flags
    assert "export TORCHPASS_JOIN_TOKEN" in text


def test_kubernetes_manifests_parse_and_agree_with_each_other(launch_flags):
    docs = {d["kind"]: d for d in yaml.safe_load_all(MANIFESTS.read_text())}
    service, job = docs["Service"], docs["Job"]
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    argv = container["command"] + container["args"]
    flags = dict(a.split("=", 1) for a in argv if a.startswith("--"))
    assert set(flags) <= launch_flags and argv[:2] == ["torchpass", "launch"]
    # One agent per pod, the pods indexed as node ranks and named through the headless Service; a failed
    # pod is created again with its index (and rejoins the same run: the Job's uid names it in etcd).
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["backoffLimitPerIndex"] > 0
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(flags["--nnodes"])
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert flags["--rdzv-backend"] == "etcd" and "$(JOB_UID)" in flags["--rdzv-id"]
    assert "controller-uid" in env["JOB_UID"]["fieldRef"]["fieldPath"]
    # The store: every member of etcd.yaml's StatefulSet, by its name through the etcd Service.
    etcd = {d["kind"]: d for d in yaml.safe_load_all(ETCD_MANIFESTS.read_text())}
    members, etcd_service = etcd["StatefulSet"], etcd["Service"]
    client = next(p["port"] for p in etcd_service["spec"]["ports"] if p["name"] == "client")
    assert members["spec"]["serviceName"] == etcd_service["metadata"]["name"]
    names = [f"{members['metadata']['name']}-{i}.{etcd_service['metadata']['name']}:{client}"
             for i in range(members["spec"]["replicas"])]
    assert flags["--rdzv-endpoint"] == ",".join(names)
    assert flags["--node-rank"] == "$(NODE_RANK)"
    assert "job-completion-index" in env["NODE_RANK"]["fieldRef"]["fieldPath"]
    assert "secretKeyRef" in env["TORCHPASS_JOIN_TOKEN"]
    # The Trainer's ranks are the active ones: nodes x processes - spares.
    devices = int(next(a for a in argv if a.startswith("trainer.devices=")).split("=")[1])
    nodes, nproc, spares = int(flags["--nnodes"]), int(flags["--nproc-per-node"]), int(flags["--spares"])
    assert devices * nodes == nodes * nproc - spares
