"""The process's default ``torch.distributed`` group, with what a failure means under each strategy.

torch binds the default group once per process, and FSDP2, DTensor, ``SyncBatchNorm``, torchmetrics and
Accelerate hold on to it, so it must outlive every failure. It is a thin wrapper on the runtime's
:class:`~torchpass_plugins.core.process_group.ReconfigurableGroup`, fixed at the logical rank and world size,
installed through torch's public route (a registered backend, ``init_process_group``) so that group
lookups by name work. The wrapper decides only what a failed collective means:

- :class:`RetryingGroup` (``torchpass_ddp``, ``TorchPass``): the collective runs through
  :meth:`Runtime.collective`: once the group is reconfigured it is retried, or, where others completed it,
  this rank is given their result; a spare skips what ran before the step it enters at.
- :class:`PoisoningGroup` (``torchpass_fsdp``): the first failure poisons the group until it is healed:
  that collective and every later one complete at once, locally, with zeroed outputs, so FSDP's hooks run
  to the end of the step, which the strategy then discards before the optimizer applies it. After the
  optimizer step (``after_step``) nothing is discarded, so there a failed collective raises instead.

Operations complete before they return (:class:`CompletedWork`), except a :class:`PoisoningGroup`'s on
CUDA tensors: their wait only orders the caller's stream after them, so FSDP2's collectives keep
overlapping with compute, and whether they succeeded is settled once per step, before it is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpass_plugins._compat.torch_distributed import carry_name
from torchpass_plugins.control.membership import lost_after_the_step
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.testing import faults

BACKEND = "torchpass"
_SKIPPED = object()
_registered: list[str] = []  # a backend name can be registered once per process
Issue = Callable[[ReconfigurableGroup, list[torch.Tensor]], list[dist.Work]]


class CompletedWork(dist.Work):
    """The work of an operation that completed before it was returned."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


class _FailureSemantics(dist.ProcessGroup):
    """c10d's collectives issued on a :class:`ReconfigurableGroup`; :meth:`_run` says what a failure means.
    ``issue(group, outputs)`` issues one operation writing into ``outputs`` and returns its works."""

    def __init__(self, group: ReconfigurableGroup, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.group = group

    def _run(self, what: str, outputs: list[torch.Tensor], issue: Issue,
             fill_skipped: Callable[[], None] | None = None) -> dist.Work:
        raise NotImplementedError

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def allreduce(self, tensors, opts=None) -> dist.Work:
        if not isinstance(opts, dist.AllreduceOptions):  # c10d passes the op alone on some paths
            op, opts = opts, dist.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        return self._run("all_reduce", list(tensors), lambda g, outs: [g.allreduce(outs, opts)])

    def broadcast(self, tensors, opts=None) -> dist.Work:
        return self._run("broadcast", list(tensors), lambda g, outs: [g.broadcast(outs, opts)])

    def allgather(self, outputs, inputs, opts=None) -> dist.Work:
        def issue(g: ReconfigurableGroup, flat: list[torch.Tensor]) -> list[dist.Work]:
            return [g.allgather(_nested_like(outputs, flat), [t.contiguous() for t in inputs])]

        def local() -> None:  # superseded: filled only so that the caller's shapes work out
            for out, t in zip(outputs, inputs, strict=True):
                for dst in out:
                    dst.copy_(t)

        return self._run("all_gather", [o for out in outputs for o in out], issue, local)

    def _allgather_base(self, output, input, opts=None) -> dist.Work:
        return self._run("all_gather", [output], lambda g, outs: [g._allgather_base(outs[0], input)],
                         lambda: output.copy_(torch.cat([input] * self.size())))

    all_gather_single = _allgather_base  # the name c10d's dispatcher calls

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        pairs = list(zip(outputs, inputs, strict=True))
        return self._run("all_gather", list(outputs),
                         lambda g, outs: [g._allgather_base(o, i) for o, (_, i) in zip(outs, pairs, strict=True)])

    def _reduce_scatter_base(self, output, input, opts=None) -> dist.Work:
        return self._run("reduce_scatter", [output], lambda g, outs: [g._reduce_scatter_base(outs[0], input, opts)])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        return self._run("reduce_scatter", list(outputs), lambda g, outs: [
            g._reduce_scatter_base(o, i, opts) for o, i in zip(outs, inputs, strict=True)])

    def gather(self, outputs, inputs, opts=None) -> dist.Work:
        def issue(g: ReconfigurableGroup, flat: list[torch.Tensor]) -> list[dist.Work]:
            return [g.gather(_nested_like(outputs, flat), inputs, opts)]

        return self._run("gather", [o for out in outputs for o in out], issue)

    def scatter(self, outputs, inputs, opts=None) -> dist.Work:
        return self._run("scatter", list(outputs), lambda g, outs: [g.scatter(outs, inputs, opts)])

    def barrier(self, opts=None) -> dist.Work:
        return self._run("barrier", [], lambda g, _: [g.barrier()])


def _nested_like(outputs: list[list[torch.Tensor]], flat: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``flat`` (the outputs as one list, or copies of them) in the nesting of ``outputs``."""
    nested, i = [], 0
    for out in outputs:
        nested.append(flat[i : i + len(out)])
        i += len(out)
    return nested


class RetryingGroup(_FailureSemantics):
    """Each collective through :meth:`Runtime.collective`: retried once the group is reconfigured."""

    def __init__(self, runtime) -> None:
        super().__init__(runtime.transport, runtime.rank, runtime.world_size)
        self._runtime = runtime

    def _run(self, what, outputs, issue, fill_skipped=None) -> dist.Work:
        faults.point("collective")

        def attempt(group: ReconfigurableGroup) -> list[torch.Tensor]:
            # Into copies: a failure mid-way must not leave a half-reduced input for the retry, and the
            # results are kept to be handed to a rank behind.
            outs = [t.detach().clone() for t in outputs]
            for work in issue(group, outs):
                group.wait(work, what)
            return outs

        results = self._runtime.collective(attempt, _SKIPPED)
        if results is _SKIPPED:
            if fill_skipped is not None:
                fill_skipped()
        else:
            for out, result in zip(outputs, results, strict=True):
                out.copy_(result)
        return CompletedWork(outputs)


class PoisoningGroup(_FailureSemantics):
    """Forwards collectives; poisoned after the first failure until :meth:`heal`."""

    def __init__(self, group: ReconfigurableGroup, rank: int, world_size: int,
                 before_reduce: Callable[[], None]) -> None:
        super().__init__(group, rank, world_size)
        self.poisoned: str | None = None
        self.after_step: int | None = None  # the step whose optimizer step was applied, until the next boundary
        self._before_reduce = before_reduce
        self._in_flight: list[tuple[dist.Work, str]] = []  # device-backend collectives not yet known to have completed

    def heal(self) -> None:
        """The group was reconfigured and the state made consistent: forward collectives again."""
        self.poisoned = None
        self._in_flight.clear()

    def refuse_made_up(self) -> None:
        """After the optimizer step, a failed collective's local result would be kept: raise instead."""
        if self.poisoned is not None and self.after_step is not None:
            raise lost_after_the_step(self.after_step)

    def settle(self) -> None:
        """Wait until the device-backend collectives issued since the last call have completed, poisoning the group if
        one failed: called before a step is applied, the one place the host waits for them."""
        if not self._in_flight:  # host collectives are settled as they run
            return
        in_flight, self._in_flight = self._in_flight, []
        for work, what in in_flight:
            try:
                self.group.wait(work, what)
            except PeerFailure as exc:
                self.poisoned = self.poisoned or f"{what}: {exc}"
        self.refuse_made_up()

    def _run(self, what, outputs, issue, fill_skipped=None) -> dist.Work:
        faults.point("collective")
        if what == "reduce_scatter":
            self._before_reduce()
        works: list[dist.Work] = []
        if self.poisoned is None:
            try:
                works = issue(self.group, outputs)
            except PeerFailure as exc:
                self.poisoned = f"{what}: {exc}"
        if works and all(self.group.on_device(work) for work in works):
            # On the device: the caller's wait orders its stream after the collective (FSDP2's overlap
            # stays); whether it succeeded is settled before the step is applied (:meth:`settle`). Work
            # that would block the caller's wait (gloo, CUDA tensors too) is waited for here, escapably.
            self._in_flight += [(work, what) for work in works]
            return _StreamOrdered(works, outputs)
        for work in works:
            try:
                self.group.wait(work, what)
            except PeerFailure as exc:
                self.poisoned = f"{what}: {exc}"
                break
        self.refuse_made_up()
        if self.poisoned is not None and what != "broadcast":  # a poisoned broadcast leaves local values
            for out in outputs:
                out.zero_()
        return CompletedWork(outputs)


class _StreamOrdered(CompletedWork):
    """CUDA collectives whose ``wait`` only orders the caller's stream after them (no host wait); a backend
    error is reported by :meth:`PoisoningGroup.settle`."""

    def __init__(self, works: list[dist.Work], outputs: list[torch.Tensor]) -> None:
        super().__init__(outputs)
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            try:
                work.wait()
            except RuntimeError:  # settled, and reported, before the step is applied
                pass
        return True


def install(group: _FailureSemantics, timeout: timedelta) -> _FailureSemantics:
    """Make ``group`` the default process group (``dist.is_initialized()``, ``dist.group.WORLD``); a second
    call (``trainer.fit`` then ``trainer.test``) finds a group of the same kind in place and returns it."""
    if dist.is_initialized():
        if type(dist.group.WORLD) is type(group):
            return dist.group.WORLD
        raise RuntimeError(
            "torchpass: torch.distributed is initialized already; create TorchPass() before Accelerator() "
            "(and before anything else that initializes torch.distributed)"
        )
    if not _registered:
        dist.Backend.register_backend(BACKEND, _created, extended_api=True, devices=["cpu", "cuda"])
        _registered.append(BACKEND)
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=group.rank(), world_size=group.size(),
                            timeout=timeout, pg_options=group)
    return group


def _created(options, group: _FailureSemantics | None) -> _FailureSemantics:
    """The backend's constructor: the group was made already and comes in as the ``pg_options``."""
    if not isinstance(group, _FailureSemantics):
        raise ConfigError(
            "torchpass: the torchpass backend is the default group only; create other groups with "
            "backend='gloo' or 'nccl' (they are not recovered after a failure)"
        )
    carry_name(group, options.timeout)
    return group
