"""``torchpass_fsdp``'s recovery plan, run by :meth:`Runtime.recover`.

Rows are :class:`ShardRow`, the decision a :class:`ShardAgreement`: the newest step every shard has a
copy of. The exchange moves each lost shard from the ring successor holding its replica and the rest of
the state from a donor; survivors then restore that step in memory, and the fit loop re-runs from it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from torch import Tensor

from torchpass_plugins._compat.lightning import rewind_loops
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.core.process_group import PeerFailure
from torchpass_plugins.core.sharded_recovery import ShardAgreement, ShardRow
from torchpass_plugins.core.state_transfer import recv_state, send_packed, send_state, unpack
from torchpass_plugins.core.training_state import MODEL, OPTIMIZER, TRAINER
from torchpass_plugins.testing import faults

if TYPE_CHECKING:
    from torchpass_plugins.integrations.lightning.fsdp import TorchPassFSDPStrategy


class ShardedPlan:
    """The lost shards from their ring successors, the rest from the donor; survivors roll back."""

    def __init__(self, strategy: TorchPassFSDPStrategy) -> None:
        self.strategy = strategy
        self.shard: dict[str, Any] = {}  # a spare's: the lost shard, from the ring successor

    def prepare(self) -> None:
        try:
            self.strategy.replicator.fence()  # the round in flight ends at once: its group is stale
        except PeerFailure:
            pass

    def row(self) -> Tensor:
        s, rt = self.strategy, self.strategy.runtime
        if rt.is_spare:
            return ShardRow(spare=True).to_tensor()
        applied = s.lightning_module.trainer.global_step
        row = ShardRow(False, applied, rt.last_boundary, tuple(s.replicator.own), tuple(s.replicator.replicas))
        return row.to_tensor()

    def decide(self, rows: list[Tensor]) -> ShardAgreement:
        return ShardAgreement.decide([ShardRow.from_tensor(t) for t in rows])

    def describe(self, a: ShardAgreement) -> dict[str, Any]:
        return {"restore_step": a.restore_step, "sources": {str(k): v for k, v in a.sources.items()}, "donor": a.donor}

    def exchange(self, a: ShardAgreement) -> None:
        """The lost shards from their ring successors, then the rest of the state from the donor."""
        s, rt, step = self.strategy, self.strategy.runtime, a.restore_step
        for lost, source in sorted(a.sources.items()):
            if rt.rank == source:
                packed = s.replicator.replicas[step]
                faults.point("donor")
                t0 = time.perf_counter()
                nbytes = send_packed(rt.transport, packed.meta, packed.payload, lost)
                rt.events.emit("state_sent", rank=rt.rank, to=lost, kind="shard", bytes=nbytes,
                               seconds=time.perf_counter() - t0)
            elif rt.rank == lost:
                faults.point("promoted")
                t0 = time.perf_counter()
                self.shard, nbytes = recv_state(rt.transport, source)
                rt.events.emit("state_received", rank=rt.rank, src=source, kind="shard", bytes=nbytes,
                               seconds=time.perf_counter() - t0)
        for lost in sorted(a.sources):
            if rt.rank == a.donor:
                faults.point("donor")
                nbytes = send_state(rt.transport, s.training_state(step=step)[TRAINER].state_dict(), lost)
                rt.events.emit("state_sent", rank=rt.rank, to=lost, kind="host", bytes=nbytes)
            elif rt.rank == lost:
                trainer, nbytes = recv_state(rt.transport, a.donor)
                rt.events.emit("state_received", rank=rt.rank, src=a.donor, kind="host", bytes=nbytes)
                s.adapter.load_state({**self.shard, TRAINER: trainer})

    def finish(self, a: ShardAgreement) -> tuple[int, dict[str, Any]]:
        s, rt = self.strategy, self.strategy.runtime
        if rt.is_spare:
            rt.phase = Phase.ENTERING  # the survivors make no collective until its first boundary
        else:
            self._restore(a.restore_step)
        s.replicator.reset()
        s.relay.heal()
        return a.restore_step, {**self.describe(a), "steps_rolled_back": a.lost_steps}

    def _restore(self, step: int) -> None:
        """A survivor: put shards, schedulers, loop progress and data position back to boundary ``step``."""
        s = self.strategy
        trainer = s.lightning_module.trainer
        live = s.runtime.last_boundary == step == trainer.global_step
        host = s.sharded.host_at(step)
        if not live:
            for hook in s.runtime.rollback_hooks:
                hook()
            packed = s.replicator.own[step]
            shard, parts = unpack(packed.meta, packed.payload), s.training_state(complete=False)
            parts[MODEL].load_state_dict(shard[MODEL])
            parts[OPTIMIZER].load_state_dict(shard[OPTIMIZER])
            s.sharded.restore_host(host)
        rewind_loops(trainer.fit_loop, host["loops"])
        s.sharded.load_state_dict(s.sharded.own[step])  # also undoes what a retried step's forward did to them
        if s.fetcher is not None:
            s.fetcher.rewind(step)
        for optimizer in s.optimizers:
            optimizer.zero_grad(set_to_none=True)
