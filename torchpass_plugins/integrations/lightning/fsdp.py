"""``torchpass_fsdp``: fully sharded training (torch FSDP2) whose shards survive the loss of a rank.

FSDP2 is built on a :class:`PoisoningGroup` (the default process group), so the group it holds survives
failures while the real gloo group is rebuilt per generation. Each rank's shard is replicated to its ring
successor every ``replicate_every_n_steps`` steps (:class:`RingReplicator`), and every step, before the
commit vote, the successor also receives what the optimizer is about to apply to the shard and the rank's
own state (:mod:`gradient_log`). A failed collective poisons the relay: the step runs to its end locally and
is discarded before the optimizer applies it; every member of the new roster agrees on the newest step that
every shard can be brought to (:class:`ShardAgreement`), the spare receives the lost shard (its replica
with the logged steps replayed) from the successor and the rest of the state from a survivor, and the
others restore that step in memory or, standing in its commit, apply it; the fit loop goes on from there
(:mod:`step_replay`). No survivor rolls back a step it applied.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.optim import Optimizer
from typing_extensions import override

from torchpass_plugins._compat.lightning import apply_layer_sync, refuse_unsupported
from torchpass_plugins.control.membership import Unrecoverable
from torchpass_plugins.core import default_group
from torchpass_plugins.core.default_group import PoisoningGroup
from torchpass_plugins.core.gradient_log import replay_refusal
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.core.rank_state import RankStateRing
from torchpass_plugins.core.ring_replication import RingReplicator
from torchpass_plugins.core.training_state import (
    OWN,
    TRAINER,
    Stateful,
    capture,
    local_parts,
)
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.ddp import TorchPassDDPStrategy
from torchpass_plugins.integrations.lightning.fsdp_checkpoint import ShardedCheckpoints
from torchpass_plugins.integrations.lightning.fsdp_collectives import PoisonedCollectives, WrapPolicy, shard_children
from torchpass_plugins.integrations.lightning.fsdp_commit import LoggedCommit, closure_first
from torchpass_plugins.integrations.lightning.fsdp_recovery import ShardedPlan
from torchpass_plugins.integrations.lightning.fsdp_state import ShardedState
from torchpass_plugins.integrations.lightning.state_parts import Incoming
from torchpass_plugins.integrations.lightning.step_replay import ReplayFetcher, StepDiscarded, StepFailed
from torchpass_plugins.testing import faults

StateFilter = Callable[[str, nn.Parameter], bool]


class TorchPassFSDPStrategy(LoggedCommit, ShardedCheckpoints, PoisonedCollectives, TorchPassDDPStrategy):
    """Fully sharded data parallel with hot spares. Use ``strategy="torchpass_fsdp"`` under ``torchpass launch``.

    Its other arguments are ``TorchPassDDPStrategy``'s.

    Args:
        auto_wrap_policy: module classes to shard as units, or a parameter count from which a module is
            its own unit; ``None`` makes each direct child of the LightningModule one unit. Ignored when the
            module shards itself in ``configure_model``.
        replicate_every_n_steps: refresh the ring replica every N optimizer steps (0: off; a loss then stops
            the job). Between rounds the successor logs each step's gradient: a larger N costs the spare a
            longer replay and the successor more memory, never a rollback.
        state_filter: model-aware mode: ``(name, param) -> bool`` selects the parameters whose shard state
            is replicated and handed over; the others are assumed unchanged since the spare built them.
        reshard_after_forward: passed to ``fully_shard`` when given; left out, FSDP2's default holds, as
            under Lightning's ``ModelParallelStrategy``.
        mp_policy: FSDP2's mixed precision policy, passed to ``fully_shard`` when given.
        offload_policy: FSDP2's offload policy, passed to ``fully_shard`` when given.
        process_group_backend: the backend of the CUDA tensors' group (``nccl`` unless given), as Lightning.
    """

    strategy_name = "torchpass_fsdp"

    def __init__(
        self,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        timeout: Union[timedelta, float, None] = None,
        auto_wrap_policy: WrapPolicy = None,
        replicate_every_n_steps: int = 1,
        state_filter: Optional[StateFilter] = None,
        reshard_after_forward: Union[bool, int, None] = None,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        offload_policy: Optional[OffloadPolicy] = None,
        process_group_backend: Optional[str] = None,
    ) -> None:
        if replicate_every_n_steps < 0:
            raise ConfigError(f"torchpass: replicate_every_n_steps must be >= 0, got {replicate_every_n_steps}")
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, timeout,
                         process_group_backend=process_group_backend)
        self._policy = auto_wrap_policy
        self.state_filter = state_filter
        self._shard_kwargs: dict[str, Any] = {}
        if reshard_after_forward is not None:
            self._shard_kwargs["reshard_after_forward"] = reshard_after_forward
        if mp_policy is not None:
            self._shard_kwargs["mp_policy"] = mp_policy
        if offload_policy is not None:
            self._shard_kwargs["offload_policy"] = offload_policy
        side = ReconfigurableGroup(self.runtime.member, self.runtime.transport.timeout, "repl")
        self.replicator = RingReplicator(side, replicate_every_n_steps)
        self.runtime.side_transports.append(self.replicator.side)
        self.runtime.rank_state = None  # this strategy's copies carry each step's gradient too
        self.ring_copies = RankStateRing(keep_votes=False)  # the predecessor's own state and gradient log
        self.committing = False  # in the commit of a step, its gradient reduced and not applied
        self.logged_names: tuple[dict[int, str], frozenset[str]] | None = None  # parameter names, skipped ones
        self._committed = True  # this step's commit is done (the optimizer stepped, or it was skipped)
        self._precision_before: dict | None = None  # the precision plugin's state before the step's update
        self.sharded = ShardedState(self)
        self.relay: PoisoningGroup | None = None
        self.fetcher: ReplayFetcher | None = None
        self._rewound = False  # this batch's step was discarded by a recovery: it has no end
        self._fenced = True  # this step's replication round is complete (or none was started)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be sharded before a (handed-over) state is loaded into it

    # -- connection and setup ---------------------------------------------------------------------------
    @override
    def _connect(self) -> None:
        if self.world_size < 2 and self.replicator.every:
            raise ConfigError("torchpass_fsdp replicates each shard on another rank: it needs devices >= 2")
        rt = self.runtime
        self.relay = default_group.install(
            PoisoningGroup(rt.transport, rt.rank, rt.world_size, self._before_reduce), rt.transport.timeout)
        if rt.is_spare:
            rt.enter_as_spare(ShardedPlan(self))
            return
        try:
            self.replicator.side.configure(rt.transport.gen, rt.rank, rt.transport.path)
        except PeerFailure as exc:
            self.relay.poisoned = str(exc)

    @override
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.model = apply_layer_sync(self, self.model)
        self.model_to_device()
        if not self.runtime.is_spare and self._incoming is None:
            self._broadcast_parameters()
        mesh = DeviceMesh.from_group(dist.group.WORLD, self.root_device.type)
        shard_children(self.lightning_module, self._policy, {"mesh": mesh, **self._shard_kwargs})
        if trainer.state.fn == TrainerFn.FITTING:
            ParallelStrategy.setup_optimizers(self, trainer)
            for optimizer in self.optimizers:
                closure_first(optimizer)
                optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._commit(optimizer, True))
        self.setup_precision_plugin()
        refuse_unsupported(trainer)
        scaled = getattr(self.precision_plugin, "scaler", None) is not None
        for optimizer in self.optimizers if self.replicator.every else ():
            if (why := replay_refusal(optimizer, scaled)) is not None:
                raise ConfigError(f"torchpass: {why} (or set replicate_every_n_steps=0: a loss then stops the job)")

    @override
    def _broadcast_parameters(self) -> None:
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                if isinstance(tensor, Tensor):
                    dist.broadcast(tensor, 0)

    # -- the training state ------------------------------------------------------------------------------
    @override
    def training_state(self, complete: bool = True, step: Optional[int] = None) -> dict[str, Stateful]:
        return self.sharded.parts(complete, self.runtime.last_boundary if step is None else step)

    @override
    def adopt(self, incoming: Incoming) -> None:
        """Also this rank's own state, adopted at the first boundary (none from a snapshot of a job that did
        not have this rank: its buffers are then rank 0's and its logged values start over)."""
        super().adopt(incoming)
        self.sharded.entering_own = incoming.own

    # -- the training step ------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        run, advance, advance_end = (getattr(type(loop), n).__get__(loop) for n in ("run", "advance", "on_advance_end"))

        def run_epoch(data_fetcher) -> None:
            self.fetcher = ReplayFetcher(data_fetcher, trainer.global_step)
            run(self.fetcher)

        def advance_batch(data_fetcher) -> None:
            self._rewound = False
            try:
                if self.adapter.step_starts(data_fetcher):
                    self._boundary(trainer.global_step)
                faults.point("data")
                advance(data_fetcher)
            except StepDiscarded:  # recovered in its commit
                self._rewound = True
            except StepFailed as exc:
                self._recover(str(exc))
                self._rewound = True

        def end_of_batch(data_fetcher) -> None:
            if not self._rewound:  # a discarded step has no end
                advance_end(data_fetcher)

        loop.run, loop.advance, loop.on_advance_end = run_epoch, advance_batch, end_of_batch

    def _boundary(self, step: int) -> None:
        self.relay.after_step = None
        self.runtime.boundary(step)
        self.sharded.adopt_entering_own()
        self._copy_own_state(step)
        self._raise_if_failed()
        if self.runtime.drain_due(step) is not None:
            self._carry_out_drain(step)
            return self._boundary(step)  # again, with the spare: its first boundary makes the same collectives
        self.fetcher.tag = step
        self._fenced = False
        self._replicate(step, wait=False)
        oldest = min(self.replicator.own, default=step)
        self.fetcher.forget_before(oldest)
        self.sharded.forget_before(oldest)
        self.ring_copies.forget_votes_before(min(self.replicator.replicas, default=step))  # none replayable

    def _carry_out_drain(self, step: int) -> None:
        """A planned migration at this boundary: first every shard of this boundary is on its ring
        successor (a forced round), so the spare starts from this very step: nothing is rolled back."""
        self._replicate(step, wait=True, force=True)
        try:  # every rank's round is complete (its successor holds the shard) before the moving rank leaves
            self.runtime.transport.sync()
        except PeerFailure as exc:
            self.relay.poisoned = str(exc)
        if self.relay.poisoned is not None:  # a real failure meanwhile (a newer roster alone is the move)
            raise StepFailed(self.relay.poisoned)
        self._recover(f"planned migration of rank {self.runtime.end_drain(step)}")

    def _replicate(self, step: int, wait: bool, force: bool = False) -> None:
        """Start the replication round of boundary ``step`` if one is due or ``force``d (and wait for
        it); a failure poisons the relay like any failed collective."""
        if not (force or self.replicator.due(step)):
            return
        try:
            shard = local_parts(capture(self.training_state(complete=False), leave_out=(TRAINER, OWN)))
            self.replicator.start_round(step, shard, self.sharded.host_now())
            if wait:
                self.replicator.fence()
        except PeerFailure as exc:
            self.relay.poisoned = str(exc)

    def _before_reduce(self) -> None:
        """Before the step's first gradient reduction: its replication round must be complete."""
        if self._fenced:
            return
        self._fenced = True
        try:
            self.replicator.fence()
        except PeerFailure as exc:
            self.relay.poisoned = str(exc)
        faults.point("reduce")

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        def closure_then_check() -> Any:
            result = closure()
            self._before_reduce()  # a step without gradients still fences its round
            self._raise_if_failed()
            self._precision_before = self.precision_plugin.state_dict()
            self._committed = False
            return result

        result = ParallelStrategy.optimizer_step(self, optimizer, closure_then_check, model, **kwargs)
        if not self._committed:  # the optimizer did not step (a loss scaler skipped it): commit that
            self._commit(optimizer, stepped=False)
        self.relay.after_step = self.runtime.last_boundary  # applied: nothing until the next boundary is retried
        faults.point("optimizer")
        return result

    @override
    def on_train_end(self) -> None:
        step = self.lightning_module.trainer.global_step
        self.relay.after_step = None  # the final boundary: a failure from here on is recovered
        while True:
            if self._failure() is None:
                self.runtime.boundary(step)
                self._copy_own_state(step)
                self._replicate(step, wait=True)
                self.barrier("torchpass.fit_end")
            failure = self._failure()
            if failure is None:
                self.runtime.training_complete(step)
                replicator = self.replicator
                self.runtime.events.emit("replica_memory", rank=self.global_rank, bytes=replicator.host_bytes(),
                                         rounds_kept=len(replicator.own) + len(replicator.replicas),
                                         abandoned_bytes=replicator.abandoned_bytes,
                                         log_bytes=self.ring_copies.peak_bytes)
                return
            if self._recover(failure) != step:
                raise Unrecoverable(
                    f"torchpass: a failure after the last step left no copy of step {step}'s shards; "
                    "resume the job from its newest snapshot"
                )

    def _failure(self) -> str | None:
        self.relay.settle()
        if self.relay.poisoned is not None:
            return self.relay.poisoned
        return "a newer roster" if self.runtime.roster_changed() else None

    def _raise_if_failed(self) -> None:
        failure = self._failure()
        if failure is not None:
            raise StepFailed(failure)

    # -- snapshots -----------------------------------------------------------------------------------------
    @override
    def snapshot_writers(self) -> list[int]:
        return list(range(self.world_size))  # each shard lives on one rank only

    @override
    def snapshot_state(self) -> tuple[dict[str, Any], set[int]]:
        """Every rank writes its shards and its own state as of the boundary (nothing filtered)."""
        return self.sharded.snapshot(self.lightning_module.trainer.global_step)

    # -- recovery -----------------------------------------------------------------------------------------
    def _recover(self, cause: str) -> int:
        """Rebuild the groups of the newest roster and restore the agreed step everywhere; returns it."""
        return self.runtime.recover(ShardedPlan(self), cause)
