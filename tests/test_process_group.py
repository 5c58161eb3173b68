"""The reconfigurable process group and its backend seam, with the gloo backend: generations under fresh
store prefixes, every backend's group aborted on reconfiguration within a deadline, the NCCL settings a
survivor needs, and the default group installed through torch's public route."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchpass_plugins.control.membership import Member, connect_store
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.core import backends
from torchpass_plugins.core.backends import (
    AbortHung,
    GlooBackend,
    NcclBackend,
    abort_within,
    backend_for,
    nccl_environment,
)
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def _one_rank_group() -> ReconfigurableGroup:
    master = connect_store("127.0.0.1:0", is_master=True, timeout=30)
    env = WorkerEnv(store=f"127.0.0.1:{master.port}", token="tok", worker_id="n0-s0-i0", world_size=1, node_rank=0,
                    local_slot=0, run_dir="", seed=0, heartbeat_interval=0.5)
    group = ReconfigurableGroup(Member(env), timedelta(seconds=30))
    group._master = master  # keep the store server alive with the group
    return group


class _Recording(GlooBackend):
    """Gloo groups whose aborts are recorded (as NCCL's would be carried out)."""

    can_abort = True

    def __init__(self, hang: bool = False) -> None:
        self.aborted: list = []
        self.built: list = []
        self.prefixes: list[str] = []
        self._hang = threading.Event() if hang else None

    def build(self, store, rank, world_size, timeout, path=0):
        self.prefixes.append(store)
        self.built.append(super().build(store, rank, world_size, timeout, path))
        return self.built[-1]

    def abort(self, group) -> None:
        self.aborted.append(group)
        if self._hang is not None:
            self._hang.wait()


def test_each_generation_is_a_new_group_and_the_old_one_is_aborted_first():
    group = _one_rank_group()
    backend = group.backends["cpu"] = _Recording()
    assert group.errored() == "no group built yet"
    group.configure(0, 0)
    [first] = backend.built
    t = torch.ones(3)
    group.all_reduce(t)
    assert group.errored() is None and torch.equal(t, torch.ones(3))
    group.configure(1, 0)
    assert backend.aborted == [first] and len(backend.built) == 2 and group.gen == 1
    group.all_reduce(t)


def test_an_abort_that_does_not_return_in_time_is_reported_not_waited_for(monkeypatch):
    monkeypatch.setattr(backends, "ABORT_DEADLINE_S", 0.2)
    group = _one_rank_group()
    group.backends["cpu"] = _Recording(hang=True)
    group.configure(0, 0)
    t0 = time.monotonic()
    with pytest.raises(AbortHung, match="did not return within"):
        group.abort()
    assert time.monotonic() - t0 < 5
    assert group.errored() == "no group built yet"  # nothing of the aborted generation is used again


class _FailedWork(dist.Work):
    """An operation whose peer died: done, with an error."""

    def wait(self, timeout=None) -> bool:
        raise RuntimeError("Connection closed by peer")

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(RuntimeError("Connection closed by peer"))
        return future


class _DeadPeerGroup:
    """A group whose peer died: every all-reduce fails."""

    def allreduce(self, tensors, opts=None) -> dist.Work:
        return _FailedWork()


class _PeerDies(GlooBackend):
    """Generation 0's group has lost its peer; later generations are plain gloo."""

    built = False

    def build(self, store, rank, world_size, timeout, path=0):
        first, self.built = not self.built, True
        return _DeadPeerGroup() if first else super().build(store, rank, world_size, timeout, path)


def test_a_failed_operation_poisons_its_generation_until_the_next():
    group = _one_rank_group()
    group.backends["cpu"] = _PeerDies()
    group.configure(0, 0)
    with pytest.raises(PeerFailure, match="commit vote: Connection closed by peer"):
        group.all_reduce(torch.ones(1), what="commit vote")
    assert group.errored() == "commit vote: Connection closed by peer"
    with pytest.raises(PeerFailure, match="commit vote"):  # refused at once: nothing is issued any more
        group.broadcast([torch.ones(1)])
    group.configure(1, 0)
    assert group.errored() is None
    group.all_reduce(torch.ones(1))


def test_the_survivor_settings_for_nccl():
    assert nccl_environment({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) == {}
    assert nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) == {}
    for mode in ("1", "3"):
        with pytest.raises(ConfigError, match=f"TORCH_NCCL_ASYNC_ERROR_HANDLING={mode} tears a surviving process"):
            nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode})


def test_the_backend_is_chosen_as_lightning_chooses_it():
    assert backend_for(None, torch.device("cpu")) is None  # gloo's CPU group carries everything
    assert backend_for("gloo", torch.device("cuda", 1)) is None  # gloo on CUDA tensors: ranks sharing a GPU
    nccl = backend_for(None, torch.device("cuda", 1))
    assert isinstance(nccl, NcclBackend) and nccl.device_index == 1 and nccl.can_abort
    with pytest.raises(ConfigError, match="process_group_backend='nccl' on cpu"):
        backend_for("nccl", torch.device("cpu"))
    with pytest.raises(ConfigError, match="process_group_backend='mpi'"):
        backend_for("mpi", torch.device("cuda", 0))


def test_abort_within_returns_once_the_abort_did():
    backend = _Recording()
    abort_within(backend, "the group")
    assert backend.aborted == ["the group"]


def test_the_default_group_is_installed_through_the_public_route_and_found_by_name():
    """In a fresh interpreter (the default group is the process's): DeviceMesh and functional collectives
    find it by name, and ``torch.distributed``'s own calls run on the current generation."""
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        import torch, torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.device_mesh import DeviceMesh
        from test_process_group import _one_rank_group
        from torchpass_plugins.core import default_group
        group = _one_rank_group()
        group.configure(0, 0)
        world = default_group.install(default_group.PoisoningGroup(group, 0, 1, lambda: None), group.timeout)
        assert dist.is_initialized() and dist.group.WORLD is world and dist.get_backend() == "torchpass"
        assert default_group.install(default_group.PoisoningGroup(group, 0, 1, lambda: None), group.timeout) is world
        t = torch.arange(4.0)
        dist.all_reduce(t)
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        out = funcol.all_reduce(torch.ones(2), "sum", mesh)
        assert torch.equal(out, torch.ones(2)) and torch.equal(t, torch.arange(4.0))
        print("ok", world.group_name)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr
