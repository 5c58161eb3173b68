"""``torchpass_ddp``'s side of Lightning's collectives: each goes through the runtime, so that a failure
during one is recovered and the collective made again in the new generation (every rank holds the same
state, so nothing is rolled back)."""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from typing_extensions import override

from torchpass_plugins.core.process_group import ReconfigurableGroup

_REDUCE_OPS = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
               "min": torch.distributed.ReduceOp.MIN}


class RecoverableCollectives:
    """Lightning's barrier, broadcast, reduce and all-gather over the runtime's recoverable group."""

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        self.runtime.collective(lambda t: t.sync(), None)

    def _wait_for_all(self, name: str) -> None:
        """A barrier with no time limit (:meth:`ReconfigurableGroup.wait_for_all`)."""
        self.runtime.collective(lambda t: t.wait_for_all(name), None)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        def run(t: ReconfigurableGroup) -> TBroadcast:
            buf = io.BytesIO()
            if t.rank == src:
                pickle.dump(obj, buf)
            data = torch.frombuffer(bytearray(buf.getvalue() or b"\0"), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            t.broadcast_from(size, src)
            if t.rank != src:
                data = torch.empty(int(size), dtype=torch.uint8)
            t.broadcast_from(data, src)
            return obj if t.rank == src else pickle.loads(data.numpy().tobytes())

        return self.runtime.collective(run, obj)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        op = (reduce_op or "mean").lower() if isinstance(reduce_op, str) else reduce_op
        mean = op in ("mean", "avg")
        dist_op = _REDUCE_OPS.get("sum" if mean else op, op)

        def run(t: ReconfigurableGroup) -> Tensor:
            out = tensor.detach().clone().to(torch.float32 if mean and not tensor.is_floating_point() else tensor.dtype)
            t.all_reduce(out, dist_op)
            return out / t.world_size if mean else out

        return self.runtime.collective(run, tensor)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return self.runtime.collective(
            lambda t: torch.stack(t.all_gather(tensor.detach().contiguous())),
            torch.stack([tensor] * self.world_size),
        )
