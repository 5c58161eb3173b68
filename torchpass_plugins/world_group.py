"""A default ``torch.distributed`` group whose collectives survive the replacement of a worker.

Libraries that drive the default group themselves (Accelerate: DDP's start-up broadcast, ``gather`` and
``reduce`` for metrics, ``wait_for_everyone``) must keep working across a recovery, but torch binds the
default group once per process. So the default group is this Python ``ProcessGroup``, fixed at the
logical rank and world size, and each operation runs through :meth:`Runtime.collective` on the current
generation's transport: a failure rebuilds the transport and retries; a rank behind the agreed position
is given the results the others got (:class:`CollectiveLog`), and a spare skips what ran before the step it
enters at. Operations complete before they return.

Installing a Python group as the default one uses torch's private ``_world`` registry (as the c10d
helpers themselves do); the torch versions the package allows are the ones this is tested with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from torchpass_plugins import faults
from torchpass_plugins.runtime import Runtime
from torchpass_plugins.transport import Transport

BACKEND = "torchpass"
_SKIPPED = object()


def _done(result: object) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class RecoverableWorldGroup(dist.ProcessGroup):
    """The operations Accelerate and DDP issue on the default group; others fail with a clear error."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime.rank, runtime.world_size)
        self._runtime = runtime

    def _run(self, fn: Callable[[Transport], list[torch.Tensor]], outputs: list[torch.Tensor]) -> bool:
        """Run ``fn`` (which returns the results, so that a rank behind can be given them) and write the
        results into ``outputs``; returns False when the operation was skipped (a spare before the step it
        enters at: the state it receives supersedes the result)."""
        faults.point("collective")
        results = self._runtime.collective(fn, _SKIPPED)
        if results is _SKIPPED:
            return False
        for out, result in zip(outputs, results, strict=True):
            out.copy_(result)
        return True

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def run(transport: Transport) -> list[torch.Tensor]:
            # Reduce copies: a failure mid-way must not leave a half-reduced input for the retry.
            out = [t.detach().clone() for t in tensors]
            for t in out:
                transport.all_reduce(t, op)
            return out

        self._run(run, tensors)
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions | None = None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0

        def run(transport: Transport) -> list[torch.Tensor]:
            out = [t.detach().clone() for t in tensors]
            for t in out:
                transport.broadcast(t, root)
            return out

        self._run(run, tensors)
        return _done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: object = None) -> dist.Work:
        def run(transport: Transport) -> list[torch.Tensor]:
            return [part for t in inputs for part in transport.all_gather(t.contiguous())]

        flat = [dst for out in outputs for dst in out]
        if not self._run(run, flat):  # superseded: filled only so that the caller's shapes work out
            for out, t in zip(outputs, inputs, strict=True):
                for dst in out:
                    dst.copy_(t)
        return _done(outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        self.allgather([list(output.chunk(self.size()))], [input])
        return _done(output)

    def barrier(self, opts: object = None) -> dist.Work:
        faults.point("collective")
        self._runtime.collective(lambda transport: transport.barrier(), None)
        return _done(None)

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND


def install(runtime: Runtime) -> RecoverableWorldGroup:
    """Make a :class:`RecoverableWorldGroup` the process's default group (``dist.is_initialized()``); a
    second call (``trainer.fit`` then ``trainer.test``) finds it in place."""
    if dist.is_initialized() and isinstance(dist.group.WORLD, RecoverableWorldGroup):
        return dist.group.WORLD
    if dist.is_initialized():
        raise RuntimeError(
            "torchpass: torch.distributed is initialized already; create TorchPass() before Accelerator() "
            "(and before anything else that initializes torch.distributed)"
        )
    group = RecoverableWorldGroup(runtime)
    c10d._update_default_pg(group)
    c10d._world.pg_map[group] = (BACKEND, dist.HashStore())
    c10d._world.pg_names[group] = BACKEND
    c10d._world.pg_group_ranks[group] = {r: r for r in range(runtime.world_size)}
    c10d._world.pg_backend_config[group] = BACKEND
    return group
