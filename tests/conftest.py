from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import Job, free_port, run

from torchpass_plugins.control.fork_server import VARIABLE
from torchpass_plugins.testing.chaos.jobs import JOB_ENVIRONMENT
from torchpass_plugins.testing.chaos.oracle import differences

STEPS = 20


# The order tests are handed to the workers in (xdist gives out work in collection order, its groups first):
# the modules of the longest single tests first, the in-process ones last, so that at the end of the suite
# neither worker waits alone for the other's long job. Every test runs whatever its place.
_LONGEST_FIRST = ("test_gpu_check", "test_against_the_frameworks", "test_weights_links", "test_fsdp", "test_audit",
                  "test_examples", "test_coordinator_failover", "test_borrowed_spares", "test_hydra_launcher")
_IN_PROCESS_LAST = ("test_agreement", "test_config", "test_engine", "test_goodput_model", "test_grad_buckets",
                    "test_health", "test_idle_copy", "test_lending", "test_membership", "test_metrics", "test_policy",
                    "test_provenance", "test_sampler", "test_sharded_recovery", "test_state_transfer",
                    "test_training_state", "test_units")


assert all((Path(__file__).parent / f"{module}.py").exists() for module in _LONGEST_FIRST + _IN_PROCESS_LAST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def place(item: pytest.Item) -> int:
        module = item.path.stem
        if module in _LONGEST_FIRST:
            return _LONGEST_FIRST.index(module)
        return len(_LONGEST_FIRST) + (module in _IN_PROCESS_LAST)

    items.sort(key=place)  # (stable: each module's own order is kept)


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory):
    """One ``torchpass fork-server`` per test process: the few hundred jobs of the suite fork their agents'
    fork servers from it instead of importing torch and Lightning each time (jobs in network namespaces,
    or with other preloaded modules, start their own, as without it). Every process the tests start gets
    the jobs' environment, so that jobs started otherwise than through ``jobs.start`` (examples, Hydra,
    other launchers) match the server too."""
    saved = {name: os.environ.get(name) for name in JOB_ENVIRONMENT}
    os.environ.update(JOB_ENVIRONMENT)
    path = tmp_path_factory.getbasetemp() / "fork-server.sock"
    log = open(tmp_path_factory.getbasetemp() / "fork-server.log", "w")
    server = subprocess.Popen([sys.executable, "-u", "-c", "import sys; from torchpass_plugins.cli import main; "
                               "sys.exit(main())", "fork-server", "--socket", str(path)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not path.exists():
        assert server.poll() is None and time.monotonic() < deadline, "the fork server did not start"
        time.sleep(0.1)
    os.environ[VARIABLE] = str(path)
    yield path
    os.environ.pop(VARIABLE, None)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    log.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory, worker_id):
    """Failure-free runs, one per (active ranks, train args), shared by every test that compares: run once
    per test session, by whichever xdist worker asks first (the others wait for it and read its result)."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # this session's, beside every worker's own

    def get(world: int = 3, train_args: tuple[str, ...] = ()) -> Job:
        key = hashlib.sha256(repr((world, train_args)).encode()).hexdigest()[:12]
        run_dir = shared / f"reference-w{world}-{key}"
        with open(f"{run_dir}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (run_dir / "finished").exists():
                shutil.rmtree(run_dir, ignore_errors=True)
                job, codes = run(run_dir, nproc=world, spares=0,
                                 train_args=("--devices", str(world), "--max-steps", str(STEPS), *train_args))
                assert codes == [0], job.output()[-3000:]
                (run_dir / "finished").touch()
        return Job(run_dir)

    return get


def assert_bit_exact(job: Job, codes: list[int], ref: Job, world: int = 3, steps: int = STEPS,
                     killed_from_outside: tuple[int, ...] = ()) -> None:
    """Every logical rank ends with the failure-free run's full state, bit for bit (parameters, buffers,
    optimizer, schedulers, loop progress, metric states, ``callback_metrics``, RNG), having applied every
    optimizer step exactly once; no process is left behind. A rank SIGKILLed from outside, at no chosen
    point of its step (``killed_from_outside``), may lack the record of the step it died in: the survivors
    applied it, and the spare received the state after it (the state is compared bit for bit all the same)."""
    assert all(code == 0 for code in codes), job.output()[-4000:]
    final, expected = job.final(), ref.final()
    assert final["global_step"] == steps
    assert final["adam_steps"] == expected["adam_steps"] == [float(steps)] * len(final["adam_steps"])
    for name, tensor in expected["weights"].items():
        assert torch.equal(final["weights"][name], tensor), f"{name} differs from the failure-free run"
    for rank in range(world):
        found = differences(ref.state(rank), job.state(rank), f"rank{rank}")
        assert not found, "differs from the failure-free run:\n" + "\n".join(found[:20])
        applied = job.applied(rank)
        if rank in killed_from_outside:
            assert applied == sorted(set(applied)) and len(set(range(steps)) - set(applied)) <= 1, applied
        else:
            assert applied == list(range(steps)), f"rank {rank} applied {applied}"
    assert job.leftovers() == []


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto) on 127.0.0.1, with one bucket; one per test process (s3fs caches
    its clients by their arguments, which name no endpoint when it comes from the environment)."""
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3fs.S3FileSystem(endpoint_url=endpoint, key="test", secret="test").mkdir("snapshots")
    yield endpoint
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Credentials and endpoint the way a user's job gets them: environment variables botocore reads."""
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    return s3_endpoint
