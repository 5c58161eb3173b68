"""``torchpass_fsdp``'s recovery plan, run by :meth:`Runtime.recover`.

Rows are :class:`ShardRow`, the decision a :class:`ShardAgreement`: the newest step every shard can be
brought to. The exchange moves each lost shard, its replica replayed to that step, and the lost rank's own
state from the ring successor holding them, and the rest of the state from a donor. A survivor that stands
in the commit of the step before it applies that step as it would have; the others restore the step in
memory, and the fit loop runs it (again) from its boundary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from torch import Tensor

from torchpass_plugins._compat.lightning import rewind_loops
from torchpass_plugins.core.gradient_log import producible
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.core.process_group import PeerFailure
from torchpass_plugins.core.sharded_recovery import NONE, ShardAgreement, ShardRow
from torchpass_plugins.core.state_transfer import recv_state, send_state, unpack
from torchpass_plugins.core.training_state import MODEL, OPTIMIZER, TRAINER
from torchpass_plugins.testing import faults

if TYPE_CHECKING:
    from torchpass_plugins.integrations.lightning.fsdp import TorchPassFSDPStrategy


class ShardedPlan:
    """The lost shards from their ring successors, the rest from the donor; survivors roll back."""

    def __init__(self, strategy: TorchPassFSDPStrategy) -> None:
        self.strategy = strategy
        self.shard: dict[str, Any] = {}  # a spare's: the lost shard and own state, from the ring successor

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
        predecessor = producible(list(s.replicator.replicas), s.ring_copies.logged()) or (NONE, NONE)
        row = ShardRow(False, applied, rt.last_boundary, s.committing, tuple(s.replicator.own), predecessor)
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
                faults.point("donor")
                t0 = time.perf_counter()
                shard, replayed = s.predecessor_shard(step)
                nbytes = send_state(rt.transport, shard, lost)
                rt.events.emit("state_sent", rank=rt.rank, to=lost, kind="shard", bytes=nbytes,
                               seconds=time.perf_counter() - t0, steps_replayed=replayed)
            elif rt.rank == lost:
                faults.point("promoted")
                t0 = time.perf_counter()
                self.shard, nbytes = recv_state(rt.transport, source)
                rt.events.emit("state_received", rank=rt.rank, src=source, kind="shard", bytes=nbytes,
                               seconds=time.perf_counter() - t0)
        for lost in sorted(a.sources):
            if rt.rank == a.donor:
                faults.point("donor")
                parts = s.training_state(step=step)
                # a replayed shard's hyperparameters are those of its last step: the donor's are the boundary's
                groups = parts[OPTIMIZER].state_dict()["param_groups"] if rt.last_boundary == step else None
                nbytes = send_state(rt.transport, {TRAINER: parts[TRAINER].state_dict(), "groups": groups}, lost)
                rt.events.emit("state_sent", rank=rt.rank, to=lost, kind="host", bytes=nbytes)
            elif rt.rank == lost:
                host, nbytes = recv_state(rt.transport, a.donor)
                rt.events.emit("state_received", rank=rt.rank, src=a.donor, kind="host", bytes=nbytes)
                if host["groups"] is not None:
                    self.shard[OPTIMIZER]["param_groups"] = host["groups"]
                s.adapter.load_state({**self.shard, TRAINER: host[TRAINER]})

    def finish(self, a: ShardAgreement) -> tuple[int, dict[str, Any]]:
        s, rt = self.strategy, self.strategy.runtime
        if rt.is_spare:
            rt.phase = Phase.ENTERING  # the survivors make no collective until its first boundary
        elif not (s.committing and a.restore_step == rt.last_boundary + 1):  # else: it applies the step
            self._restore(a.restore_step)
        s.replicator.reset()
        s.ring_copies.clear()
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
