"""The process group that FSDP2 and DTensor are built on, kept while the real groups come and go.

FSDP2 binds a ``DeviceMesh`` (hence one ``ProcessGroup``) at ``fully_shard`` time, so the group it holds
must outlive failures. :class:`RelayGroup` is a Python ``ProcessGroup`` registered as the c10d backend
``"torchpass"``: every collective is forwarded to the current generation's gloo group and waited on
through the escapable :class:`Transport` waits. When one fails, the relay is *poisoned*: that collective
and every later one complete at once, locally, with zeroed outputs, so FSDP's hooks run to the end of
the step in a consistent state and nothing blocks. The strategy then discards the step (before the
optimizer applies it) and the recovery restores a consistent state on every rank. After the optimizer
step (``after_step``: validation, an epoch's end) nothing is discarded, so a zeroed result would stay:
there a failed collective raises instead (the job restarts from its newest snapshot).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from torchpass_plugins.membership import lost_after_the_step
from torchpass_plugins.transport import PeerFailure, Transport

BACKEND = "torchpass"


class RelayGroup(dist.ProcessGroup):
    """Forwards collectives to ``transport.pg``; poisoned after the first failure until :meth:`heal`."""

    def __init__(self, transport: Transport, rank: int, world_size: int, before_reduce: Callable[[], None]) -> None:
        super().__init__(rank, world_size)
        self.transport = transport
        self.poisoned: str | None = None
        self.after_step: int | None = None  # the step whose optimizer step was applied, until the next boundary
        self._before_reduce = before_reduce

    def heal(self) -> None:
        """The transport was rebuilt and the state made consistent: forward collectives again."""
        self.poisoned = None

    def getBackendName(self) -> str:
        return BACKEND

    def refuse_made_up(self) -> None:
        """After the optimizer step, a failed collective's local result would be kept: raise instead."""
        if self.poisoned is not None and self.after_step is not None:
            raise lost_after_the_step(self.after_step)

    def _run(self, what: str, outputs: list[torch.Tensor], issue: Callable[[dist.ProcessGroup], list]) -> dist.Work:
        if self.poisoned is None:
            t = self.transport
            try:
                if t.stale() or t.pg is None:
                    raise PeerFailure("newer roster")
                for work in issue(t.pg):
                    t.wait(work, what)
            except PeerFailure as exc:
                self.poisoned = f"{what}: {exc}"
        self.refuse_made_up()
        if self.poisoned is not None:
            for out in outputs:
                out.zero_()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(outputs)
        return _create_work_from_future(fut)

    # -- what FSDP2, DTensor and Lightning call ---------------------------------------------------------
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        return self._run("all_gather", [output], lambda pg: [pg._allgather_base(output, input)])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        pairs = list(zip(outputs, inputs, strict=True))
        return self._run("all_gather", list(outputs), lambda pg: [pg._allgather_base(o, i) for o, i in pairs])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        self._before_reduce()
        return self._run("reduce_scatter", [output], lambda pg: [pg._reduce_scatter_base(output, input, opts)])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        self._before_reduce()
        return self._run(
            "reduce_scatter",
            list(outputs),
            lambda pg: [pg._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
        )

    def allreduce(self, tensors, opts=None) -> dist.Work:
        if not isinstance(opts, dist.AllreduceOptions):
            op, opts = opts, dist.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        return self._run("all_reduce", list(tensors), lambda pg: [pg.allreduce(list(tensors), opts)])

    def allgather(self, outputs, inputs, opts=None) -> dist.Work:
        flat = [o for outs in outputs for o in outs]
        return self._run("all_gather", flat, lambda pg: [pg.allgather(outputs, inputs)])

    def gather(self, outputs, inputs, opts=None) -> dist.Work:
        flat, opts = [o for outs in outputs for o in outs], opts or dist.GatherOptions()
        return self._run("gather", flat, lambda pg: [pg.gather(outputs, inputs, opts)])

    def scatter(self, outputs, inputs, opts=None) -> dist.Work:
        opts = opts or dist.ScatterOptions()
        return self._run("scatter", list(outputs), lambda pg: [pg.scatter(outputs, inputs, opts)])

    def broadcast(self, tensors, opts=None) -> dist.Work:
        return self._run("broadcast", [], lambda pg: [pg.broadcast(list(tensors), opts)])

    def barrier(self, opts=None) -> dist.Work:
        return self._run("barrier", [], lambda pg: [pg.allreduce([torch.zeros(1)])])


def init_relay_world(transport: Transport, rank: int, world_size: int, before_reduce: Callable[[], None],
                     timeout: timedelta) -> RelayGroup:
    """Make a :class:`RelayGroup` torch's default process group (what ``DeviceMesh`` and DTensor use)."""
    relay = RelayGroup(transport, rank, world_size, before_reduce)

    def create(opts, _options) -> RelayGroup:
        # c10d reads a group's name from a backend, so a one-rank gloo group carries it; it never communicates.
        holder = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)
        relay._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, holder)
        return relay

    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size, timeout=timeout)
    return relay
