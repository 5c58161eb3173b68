"""The backend seam: how one generation's group is built, and aborted, for one device type.

:class:`~torchpass_plugins.core.process_group.ReconfigurableGroup` holds one group per device type per
generation, as ``torch.distributed`` does for a multi-device group: gloo for CPU tensors (always there:
the commit vote, step signals and state hand-over ride on it), NCCL for CUDA tensors where the strategy
communicates on a GPU. A backend is a small object: ``build`` makes the group of one generation (under a
fresh store prefix, so logical rank = backend rank every time), ``abort`` ends it.

NCCL facts this rests on (NVIDIA's fault-tolerance notes for ``ncclCommAbort``; torch's ProcessGroupNCCL):
a communicator can be aborted safely only if it is *nonblocking*, which torch no longer picks on its own,
so :class:`NcclBackend` asks for it; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` must not tear a survivor down
(:func:`nccl_environment`); and an abort can itself hang, so every abort runs under a deadline
(:func:`abort_within`) whose last resort is leaving the process, which a spare then replaces.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpass_plugins._compat.torch_distributed import nccl_options
from torchpass_plugins.errors import ConfigError

ABORT_DEADLINE_S = 10.0
# torch's modes: 0 no handling, 1 tear the process down, 2 abort the communicators and keep the process,
# 3 skip the clean-up. A survivor must keep its process, and our own waits see the failure.
_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_SURVIVABLE = {"0", "2"}


class AbortHung(RuntimeError):
    """A backend's abort did not return within its deadline: this process cannot take part any more."""


class Backend:
    """Builds one generation's group for tensors of ``device``."""

    name = "?"
    device = "cpu"
    can_abort = False  # whether :meth:`abort` ends pending operations (else the group is abandoned)

    def build(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
              path: int = 0) -> dist.ProcessGroup:
        """``path``: the roster's network path (see ``control/links.py``)."""
        raise NotImplementedError

    def abort(self, group: dist.ProcessGroup) -> None:
        """End ``group``'s pending operations (only called where :attr:`can_abort`)."""

    def retire(self, group: dist.ProcessGroup, pending: bool) -> None:
        """Let a replaced generation's ``group`` go, unless an operation is still ``pending`` in some group
        (escaped from a wait, or issued and never waited for): its destructor would then join a thread stuck
        with a dead peer, so it is kept alive for good (a socket per peer until the process ends)."""
        if pending:
            keep_alive(group)


class GlooBackend(Backend):
    """CPU tensors. A gloo operation cannot be interrupted from another thread; one stuck in a replaced
    generation's group ends when its peer's process does, or at the group's timeout. With ``interfaces``
    (the node's ``--interfaces``), path ``p``'s group binds to the ``p``-th, so its traffic takes that link."""

    name = "gloo"
    interfaces: tuple[str, ...] = ()

    def __init__(self, interfaces: tuple[str, ...] = ()) -> None:
        self.interfaces = interfaces

    def build(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
              path: int = 0) -> dist.ProcessGroup:
        if not self.interfaces:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        if path >= len(self.interfaces):
            raise ConfigError(f"torchpass: the job moved to network path {path}, but this node has "
                              f"{len(self.interfaces)} (--interfaces {','.join(self.interfaces)}): give every node "
                              "the same number of interfaces, in the same order")
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(interface=self.interfaces[path])]
        return dist.ProcessGroupGloo(store, rank, world_size, options)

    def retire(self, group: dist.ProcessGroup, pending: bool) -> None:
        """Always kept alive: gloo's teardown of a connection that a dead peer closed can abort the process
        (its removal from gloo's event loop finds the descriptor gone and throws from a destructor,
        ``terminate called ... loop.cc ... epoll_ctl: No such file or directory``, seen when the garbage
        collector dropped such a group), and which peer died is not known here."""
        keep_alive(group)


class NcclBackend(Backend):
    """CUDA tensors on ``device``, through a nonblocking communicator that :meth:`abort` can end."""

    name = "nccl"
    device = "cuda"
    can_abort = True

    def __init__(self, device: torch.device) -> None:
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()

    def build(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
              path: int = 0) -> dist.ProcessGroup:
        # NCCL picks its interfaces once per process (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): ``path`` cannot move it
        group = dist.ProcessGroupNCCL(store, rank, world_size, nccl_options(timeout))
        # The communicator now, while the build can still be abandoned for a newer roster (it is the
        # rendezvous of every rank), rather than lazily in the training thread's first collective.
        group.eager_connect_single_device(torch.device("cuda", self.device_index))
        return group

    def abort(self, group: dist.ProcessGroup) -> None:
        group.abort()


def keep_alive(group: dist.ProcessGroup) -> None:
    """Never destroy ``group``: a reference no one holds keeps it from its destructor until the process ends."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def abort_within(backend: Backend, group: dist.ProcessGroup) -> None:
    """Run ``backend.abort(group)`` in a helper thread and give it :data:`ABORT_DEADLINE_S`; :class:`AbortHung`
    past it (the thread is left behind: nothing can end a hung abort, which is why the caller must leave)."""
    deadline_s = ABORT_DEADLINE_S

    def run() -> None:
        try:
            backend.abort(group)
        except Exception as exc:  # the group is given up on either way
            print(f"torchpass: aborting the {backend.name} group raised: {exc}", file=sys.stderr)

    thread = threading.Thread(target=run, name=f"torchpass-abort-{backend.name}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise AbortHung(f"torchpass: aborting the {backend.name} group did not return within {deadline_s:.0f} s")


def slot_gpu(slot: int) -> torch.device:
    """The GPU of worker slot ``slot`` on its node: slot i uses GPU i (modulo the visible ones), so a spare
    trains on its own GPU whichever logical rank it takes."""
    return torch.device("cuda", slot % torch.cuda.device_count())


def backend_for(process_group_backend: str | None, device: torch.device) -> Backend | None:
    """The backend for ``device``'s tensors besides gloo's CPU group, as Lightning picks it (``nccl`` on
    CUDA, unless the strategy was given ``process_group_backend``); None for CPU training."""
    chosen = process_group_backend or ("nccl" if device.type == "cuda" else "gloo")
    if chosen == "gloo":
        return None  # gloo carries CUDA tensors too (staged through the host), as for several ranks on one GPU
    if chosen != "nccl" or device.type != "cuda":
        raise ConfigError(
            f"torchpass: process_group_backend={chosen!r} on {device.type} is not supported: use 'nccl' on "
            "CUDA devices or 'gloo' (any device)"
        )
    return NcclBackend(device)


def nccl_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What to set before the first NCCL group: async error handling that keeps a survivor's process
    (mode 2 unless the user chose 0). Raises ``ConfigError`` for a mode under which a survivor would die."""
    mode = env.get(_ASYNC_ERROR_HANDLING)
    if mode is not None and mode not in _SURVIVABLE:
        raise ConfigError(
            f"torchpass: {_ASYNC_ERROR_HANDLING}={mode} tears a surviving process down when a peer fails; "
            "unset it (torchpass sets 2: abort the communicators, keep the process) or set it to 0"
        )
    return {} if mode is not None else {_ASYNC_ERROR_HANDLING: "2"}


def prepare_nccl() -> None:
    """Apply :func:`nccl_environment` to this process (before its first NCCL group is built)."""
    os.environ.update(nccl_environment(os.environ))


def communicate_on(group, device: torch.device, process_group_backend: str | None) -> None:
    """Let ``group`` (a ``ReconfigurableGroup``) carry ``device``'s tensors over the backend Lightning
    would pick for it, binding this process to its slot's GPU first."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(process_group_backend, device)
    if backend is not None:
        prepare_nccl()
        group.use_backend(backend)
