"""``torchpass_fsdp``'s side of Lightning's collectives and of the model's sharding.

A failed collective poisons the relay (:class:`PoisoningGroup`): within a step each rank then goes on
with its local value, so the step runs to its end and is discarded before the optimizer applies it;
after the optimizer step no value may be made up (:meth:`PoisoningGroup.refuse_made_up`). A spare
that has not reached its entry boundary makes no collective: the survivors make none meanwhile.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from typing_extensions import override

from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.core.process_group import PeerFailure
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.ddp_collectives import _REDUCE_OPS

WrapPolicy = Union[set[type[nn.Module]], int, None]


def shard_children(module: nn.Module, policy: WrapPolicy, shard_kwargs: dict[str, Any]) -> None:
    """``fully_shard`` the units ``policy`` selects (module classes, or a parameter count from which a module
    is its own unit), then every direct child still holding parameters of its own; nothing where the
    LightningModule sharded itself in ``configure_model``."""
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return
    if any(True for _ in module.parameters(recurse=False)):
        raise ConfigError(
            "torchpass_fsdp shards the LightningModule's child modules; move the parameters registered "
            "directly on it into a submodule, or shard the model yourself in configure_model()"
        )
    managed: set[int] = set()
    for sub in reversed(list(module.modules())):
        if sub is module or not _wraps(sub, policy, managed):
            continue
        fully_shard(sub, **shard_kwargs)
        managed.update(id(p) for p in sub.parameters())
    for child in module.children():
        if not isinstance(child, FSDPModule) and any(id(p) not in managed for p in child.parameters()):
            fully_shard(child, **shard_kwargs)


def _wraps(module: nn.Module, policy: WrapPolicy, managed: set[int]) -> bool:
    if isinstance(policy, int):
        return sum(p.numel() for p in module.parameters() if id(p) not in managed) >= policy
    return bool(policy) and isinstance(module, tuple(policy))


class PoisonedCollectives:
    """Lightning's collective hooks over the poisoning relay (mixed into ``TorchPassFSDPStrategy``)."""

    def _local_only(self) -> bool:
        self.relay.refuse_made_up()
        return self.runtime.phase is Phase.ENTERING or self.relay.poisoned is not None

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not self._local_only():
            dist.barrier()

    @override
    def _wait_for_all(self, name: str) -> None:
        if self._local_only():
            return
        try:
            self.relay.group.wait_for_all(name)
        except PeerFailure as exc:
            self.relay.poisoned = f"{name}: {exc}"

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if self._local_only():
            return obj
        buf = io.BytesIO()
        if self.global_rank == src:
            pickle.dump(obj, buf)
        size = torch.tensor([len(buf.getvalue())], dtype=torch.int64)
        dist.broadcast(size, src)
        if self.relay.poisoned is not None:
            return obj
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8) if self.global_rank == src else (
            torch.empty(int(size), dtype=torch.uint8))
        dist.broadcast(data, src)
        if self.relay.poisoned is not None or self.global_rank == src:
            return obj
        return pickle.loads(data.numpy().tobytes())

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self._local_only():
            return tensor
        op = (reduce_op or "mean").lower() if isinstance(reduce_op, str) else reduce_op
        mean = op in ("mean", "avg")
        out = tensor.detach().clone().to(torch.float32 if mean and not tensor.is_floating_point() else tensor.dtype)
        dist.all_reduce(out, _REDUCE_OPS.get("sum" if mean else op, op))
        if self.relay.poisoned is not None:
            return tensor
        return out / self.world_size if mean else out

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        if not self._local_only():
            dist.all_gather(parts, tensor.detach().contiguous())
        if self._local_only():
            return torch.stack([tensor] * self.world_size)
        return torch.stack(parts)
