"""``torchpass_fsdp``: fully sharded training (torch FSDP2) whose shards survive the loss of a rank.

FSDP2 is built on a :class:`PoisoningGroup` (the default process group), so the group it holds survives
failures while the real gloo group is rebuilt per generation. Each rank's shard is replicated to its ring
successor every ``replicate_every_n_steps`` steps (:class:`RingReplicator`). A failed collective poisons the
relay: the step runs to its end locally, is discarded before the optimizer applies it, every member of the
new roster agrees on the newest step whose shards all exist (:class:`ShardAgreement`), the spare receives
the lost shard from the successor and the rest of the state from a survivor, everyone restores that step in
memory and the fit loop re-runs from it (:mod:`step_replay`).
"""

from __future__ import annotations

import copy
import io
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.optim import Optimizer
from typing_extensions import override

from torchpass_plugins._compat.lightning import apply_layer_sync, dump_checkpoint, refuse_unsupported, rewind_loops
from torchpass_plugins.control.membership import Unrecoverable
from torchpass_plugins.core import default_group, shard_state
from torchpass_plugins.core.default_group import PoisoningGroup
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.core.ring_replication import RingReplicator
from torchpass_plugins.core.sharded_recovery import ShardAgreement, ShardRow
from torchpass_plugins.core.state_transfer import recv_state, send_packed, send_state, unpack
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.ddp import _REDUCE_OPS, TorchPassDDPStrategy
from torchpass_plugins.integrations.lightning.step_replay import ReplayFetcher, StepFailed
from torchpass_plugins.testing import faults

WrapPolicy = Union[set[type[nn.Module]], int, None]
_CHECKPOINT_META = "lightning.pt"  # beside the DCP shards: everything but model and optimizer tensors
_RANK_BUFFERS = "buffers_rank{rank}.pt"  # beside them too: each rank's own module buffers
StateFilter = Callable[[str, nn.Parameter], bool]


def trainable_only(name: str, param: nn.Parameter) -> bool:
    """A model-aware ``state_filter``: frozen parameters never change, so their shards need not move."""
    return param.requires_grad


def _hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Per parameter group: lr, betas... (schedulers change them), without the parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _set_hyperparameters(optimizer: Optimizer, groups: list[dict[str, Any]]) -> None:
    for group, values in zip(optimizer.param_groups, groups, strict=True):
        group.update(values)


class TorchPassFSDPStrategy(TorchPassDDPStrategy):
    """Fully sharded data parallel with hot spares. Use ``strategy="torchpass_fsdp"`` under ``torchpass launch``.

    Args:
        auto_wrap_policy: module classes to shard as units, or a parameter count from which a module is
            its own unit; ``None`` makes each direct child of the LightningModule one unit. Ignored when the
            module shards itself in ``configure_model``.
        replicate_every_n_steps: refresh the ring replica every N optimizer steps (0: off; a loss then stops
            the job). A failure can cost up to N steps, rolled back in memory.
        state_filter: model-aware mode: ``(name, param) -> bool`` selects the parameters whose shard state
            is replicated and handed over; the others are assumed unchanged since the spare built them.
        reshard_after_forward, mp_policy, offload_policy: passed to ``fully_shard``.
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
        timeout: Union[timedelta, float] = timedelta(minutes=5),
        auto_wrap_policy: WrapPolicy = None,
        replicate_every_n_steps: int = 1,
        state_filter: Optional[StateFilter] = None,
        reshard_after_forward: bool = True,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        offload_policy: Optional[OffloadPolicy] = None,
        process_group_backend: Optional[str] = None,
    ) -> None:
        if replicate_every_n_steps < 0:
            raise ConfigError(f"torchpass: replicate_every_n_steps must be >= 0, got {replicate_every_n_steps}")
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, timeout,
                         process_group_backend=process_group_backend)
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._policy = auto_wrap_policy
        self._state_filter = state_filter
        self._shard_kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
        if mp_policy is not None:
            self._shard_kwargs["mp_policy"] = mp_policy
        if offload_policy is not None:
            self._shard_kwargs["offload_policy"] = offload_policy
        self.replicator = RingReplicator(ReconfigurableGroup(self.runtime.member, self._timeout, "repl"),
                                         replicate_every_n_steps)
        self.runtime.side_transports.append(self.replicator.side)
        self.runtime.rank_state = None  # carried by the replication round instead (with the shard)
        self._own: dict[int, dict] = {}  # this rank's own state at recent boundaries (:meth:`_own_state`)
        self._entering_own: dict | None = None  # a spare's: the lost rank's, adopted at its first boundary
        self.relay: PoisoningGroup | None = None
        self._fetcher: ReplayFetcher | None = None
        self._incoming: dict | None = None  # a spare's shard, applied when Lightning restores the model
        self._handing_over = False
        self._rewound = False
        self._fenced = True
        self._entering = False  # a spare until its first step: the survivors make no collective meanwhile
        self._loaded_sharded = False  # a DCP checkpoint was loaded into the shards

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
            PoisoningGroup(rt.transport, rt.rank, rt.world_size, self._before_reduce), self._timeout)
        if rt.is_spare:
            rt.events.emit("spare_promoted", rank=rt.rank, gen=rt.member.latest_gen)
            self._recover("spare promoted")
            return
        try:
            self.replicator.side.configure(rt.transport.gen, rt.rank)
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
        self._shard(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            ParallelStrategy.setup_optimizers(self, trainer)
        self.setup_precision_plugin()
        refuse_unsupported(trainer)

    @override
    def _broadcast_parameters(self) -> None:
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                if isinstance(tensor, Tensor):
                    dist.broadcast(tensor, 0)

    def _shard(self, module: nn.Module) -> None:
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # the LightningModule sharded itself in configure_model
        if any(True for _ in module.parameters(recurse=False)):
            raise ConfigError(
                "torchpass_fsdp shards the LightningModule's child modules; move the parameters registered "
                "directly on it into a submodule, or shard the model yourself in configure_model()"
            )
        kwargs = {"mesh": DeviceMesh.from_group(dist.group.WORLD, self.root_device.type), **self._shard_kwargs}
        managed: set[int] = set()
        for sub in reversed(list(module.modules())):
            if sub is module or not self._wraps(sub, managed):
                continue
            fully_shard(sub, **kwargs)
            managed.update(id(p) for p in sub.parameters())
        for child in module.children():
            if not isinstance(child, FSDPModule) and any(id(p) not in managed for p in child.parameters()):
                fully_shard(child, **kwargs)

    def _wraps(self, module: nn.Module, managed: set[int]) -> bool:
        if isinstance(self._policy, int):
            return sum(p.numel() for p in module.parameters() if id(p) not in managed) >= self._policy
        return bool(self._policy) and isinstance(module, tuple(self._policy))

    # -- what Lightning saves and restores ----------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._handing_over else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {} if self._handing_over else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A directory: every rank writes its shards through torch DCP, rank 0 the rest of the checkpoint."""
        if storage_options is not None:
            raise TypeError("torchpass_fsdp writes sharded checkpoints with torch DCP: storage_options are unused")
        path = Path(filepath)
        model, optimizers = get_state_dict(self.lightning_module, self.optimizers)
        dcp.save({"model": model, "optimizers": optimizers}, checkpoint_id=path)
        # DCP keeps one copy of a tensor that is not sharded, and buffers differ between ranks (BatchNorm
        # statistics): each rank writes its own beside the shards.
        torch.save(self._buffers(), path / _RANK_BUFFERS.format(rank=self.global_rank))
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            torch.save(rest, path / _CHECKPOINT_META)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not (path / _CHECKPOINT_META).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only)  # a single file, as Lightning writes
        model, optimizers = get_state_dict(self.lightning_module, self.optimizers)
        dcp.load({"model": model, "optimizers": optimizers}, checkpoint_id=path)
        set_state_dict(self.lightning_module, self.optimizers, model_state_dict=model, optim_state_dict=optimizers)
        own = path / _RANK_BUFFERS.format(rank=self.global_rank)
        if own.is_file():
            self._load_buffers(torch.load(own, weights_only=True))
        self._loaded_sharded = True
        checkpoint = torch.load(path / _CHECKPOINT_META, weights_only=False)
        checkpoint.update(state_dict={}, optimizer_states=[])
        self.adapter.resume_data_from(checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self._loaded_sharded:
            return  # load_checkpoint has put the shards in place
        if self._incoming is None:
            return super().load_model_state_dict(checkpoint, strict)
        shard_state.restore(self.lightning_module, None, {"params": self._incoming["params"], "optim": {}})

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self._loaded_sharded:
            return
        if self._incoming is None:
            return super().load_optimizer_state_dict(checkpoint)
        incoming, self._incoming = self._incoming, None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            _set_hyperparameters(optimizer, state["param_groups"])
        shard_state.restore(self.lightning_module, self.optimizers[0], {"params": {}, "optim": incoming["optim"]})

    # -- the training step ------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        run, advance, advance_end = (getattr(type(loop), n).__get__(loop) for n in ("run", "advance", "on_advance_end"))

        def run_epoch(data_fetcher) -> None:
            self._fetcher = ReplayFetcher(data_fetcher, trainer.global_step)
            run(self._fetcher)

        def advance_batch(data_fetcher) -> None:
            self._rewound = False
            try:
                if loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0:
                    self._boundary(trainer.global_step)
                faults.point("data")
                advance(data_fetcher)
            except StepFailed as exc:
                self._recover(str(exc))
                self._rewound = True

        def end_of_batch(data_fetcher) -> None:
            if not self._rewound:  # a discarded step has no end
                advance_end(data_fetcher)

        loop.run, loop.advance, loop.on_advance_end = run_epoch, advance_batch, end_of_batch

    def _boundary(self, step: int) -> None:
        self._entering = False
        self.relay.after_step = None
        self.runtime.boundary(step)
        if self._entering_own is not None:
            self._load_own(self._entering_own)
            self._entering_own = None
        self._own[step] = self._own_state()
        self._raise_if_failed()
        self._exchange_signals(step)
        if self.runtime.drain_due(step) is not None:
            self._carry_out_drain(step)
            return self._boundary(step)  # again, with the spare: its first boundary makes the same collectives
        self._fetcher.tag = step
        self._fenced = False
        self._replicate(step, wait=False)
        oldest = min(self.replicator.own, default=step)
        self._fetcher.forget_before(oldest)
        for old in [s for s in self._own if s < oldest]:
            del self._own[old]

    def _exchange_signals(self, step: int) -> None:
        """Planned migrations and step times (:meth:`Runtime.signals`): one small all-reduce per step, the
        only collective of the boundary (DDP carries them on its commit vote instead)."""
        signals = self.runtime.signals()
        try:
            self.runtime.transport.all_reduce(signals, what="step signals")
        except PeerFailure as exc:
            self.relay.poisoned = str(exc)
            self._raise_if_failed()
        self.runtime.take_signals(signals, step, drain_at=step)

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
            self.replicator.start_round(step, {**self._capture(), "own": self._own[step]}, self._host_now())
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
            faults.point("commit")
            self._raise_if_failed()
            return result

        result = ParallelStrategy.optimizer_step(self, optimizer, closure_then_check, model, **kwargs)
        self.relay.after_step = self.runtime.last_boundary  # applied: nothing until the next boundary is retried
        faults.point("optimizer")
        return result

    @override
    def on_train_end(self) -> None:
        step = self.lightning_module.trainer.global_step
        self._entering = False
        self.relay.after_step = None  # the final boundary: a failure from here on is recovered
        while True:
            if self._failure() is None:
                self.runtime.boundary(step)
                self._own[step] = self._own_state()
                self._replicate(step, wait=True)
                self.barrier("torchpass.fit_end")
            failure = self._failure()
            if failure is None:
                self.runtime.training_complete(step)
                self.runtime.events.emit("replica_memory", rank=self.global_rank, bytes=self.replicator.host_bytes(),
                                         rounds_kept=len(self.replicator.own) + len(self.replicator.replicas))
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
        return "a newer roster" if self.runtime.transport.stale() else None

    def _raise_if_failed(self) -> None:
        failure = self._failure()
        if failure is not None:
            raise StepFailed(failure)

    # -- state --------------------------------------------------------------------------------------------
    def _skip(self) -> frozenset[str]:
        if self._state_filter is None:
            return frozenset()
        return frozenset(n for n, p in self.lightning_module.named_parameters() if not self._state_filter(n, p))

    def _own_state(self) -> dict:
        """What differs between ranks besides the shard: module buffers (FSDP keeps each rank's own, e.g.
        BatchNorm statistics) and the logged values and metric states. Copied, because the step's forward
        changes them in place: a retried or rolled-back step starts again from this copy, and a spare from
        its predecessor's, which the ring replica carries."""
        return {"buffers": self._buffers(), "rank": copy.deepcopy(self.adapter.rank_state())}

    def _buffers(self) -> dict[str, Tensor]:
        return {name: b.detach().clone() for name, b in self.lightning_module.named_buffers()}

    def _load_own(self, own: dict) -> None:
        self._load_buffers(own["buffers"])
        self.adapter.load_rank_state(copy.deepcopy(own["rank"]))  # the kept copy may be needed again

    def _load_buffers(self, buffers: dict[str, Tensor]) -> None:
        named = dict(self.lightning_module.named_buffers())
        with torch.no_grad():
            for name, value in buffers.items():
                named[name].copy_(value)

    def _capture(self) -> dict:
        optimizer = self.optimizers[0] if self.optimizers else None
        return shard_state.capture(self.lightning_module, optimizer, self._skip())

    def _host_now(self) -> dict:
        """Loop progress (this boundary's snapshot) and scheduler state: restored with the shards."""
        schedulers = [c.scheduler.state_dict() for c in self.lightning_module.trainer.lr_scheduler_configs]
        groups = [_hyperparameters(optimizer) for optimizer in self.optimizers]
        return copy.deepcopy({"loops": self.runtime.boundary_record, "schedulers": schedulers, "param_groups": groups})

    def _host_at(self, step: int) -> dict:
        if step in self.replicator.own:
            return self.replicator.own[step].host
        return self._host_now()  # the live boundary (no rank was lost, so no replica was needed)

    def _host_checkpoint(self, step: int) -> dict:
        """Everything a spare needs besides the shards: Lightning's checkpoint without model and optimizer."""
        self._handing_over = True
        try:
            checkpoint = dump_checkpoint(self.lightning_module.trainer)
        finally:
            self._handing_over = False
        host = self._host_at(step)
        checkpoint["loops"]["fit_loop"] = host["loops"]
        checkpoint["lr_schedulers"] = host["schedulers"]
        checkpoint["optimizer_states"] = [{"param_groups": groups} for groups in host["param_groups"]]
        return checkpoint

    # -- snapshots -----------------------------------------------------------------------------------------
    @override
    def snapshot_writers(self) -> list[int]:
        return list(range(self.world_size))  # each shard lives on one rank only

    @override
    def snapshot_state(self) -> tuple[Any, set[int]]:
        """This rank's whole shard (model-aware filtering does not apply: a snapshot is the last resort) and
        the rest of the boundary state; the shard stays unchanged until the optimizer step."""
        optimizer = self.optimizers[0] if self.optimizers else None
        shard = shard_state.capture(self.lightning_module, optimizer)
        stable = {t.data_ptr() for t in shard["params"].values()}
        stable |= {t.data_ptr() for values in shard["optim"].values() for t in values.values()}
        step = self.lightning_module.trainer.global_step
        return {"host": self._host_checkpoint(step), "shard": shard, "own": self._own[step]}, stable

    @override
    def load_snapshot(self, state: Any) -> None:
        self._incoming = state["shard"]  # loaded into the shards once they exist (after setup)
        self._entering_own = state["own"]
        self.adapter.load_state(state["host"])

    # -- recovery -----------------------------------------------------------------------------------------
    def _recover(self, cause: str) -> int:
        """Rebuild the groups of the newest roster and restore the agreed step everywhere; returns it."""
        return self.runtime.recover(_ShardedPlan(self), cause)

    def _exchange(self, a: ShardAgreement) -> None:
        """The lost shards from their ring successors, then the rest of the state from the donor."""
        rt, step = self.runtime, a.restore_step
        for lost, source in sorted(a.sources.items()):
            if rt.rank == source:
                packed = self.replicator.replicas[step]
                faults.point("donor")
                t0 = time.perf_counter()
                nbytes = send_packed(rt.transport, packed.meta, packed.payload, lost)
                rt.events.emit("state_sent", rank=rt.rank, to=lost, kind="shard", bytes=nbytes,
                               seconds=time.perf_counter() - t0)
            elif rt.rank == lost:
                faults.point("promoted")
                t0 = time.perf_counter()
                self._incoming, nbytes = recv_state(rt.transport, source)
                self._entering_own = self._incoming.pop("own")
                rt.events.emit("state_received", rank=rt.rank, src=source, kind="shard", bytes=nbytes,
                               seconds=time.perf_counter() - t0)
        for lost in sorted(a.sources):
            if rt.rank == a.donor:
                faults.point("donor")
                nbytes = send_state(rt.transport, self._host_checkpoint(step), lost)
                rt.events.emit("state_sent", rank=rt.rank, to=lost, kind="host", bytes=nbytes)
            elif rt.rank == lost:
                host, nbytes = recv_state(rt.transport, a.donor)
                rt.events.emit("state_received", rank=rt.rank, src=a.donor, kind="host", bytes=nbytes)
                self.adapter.load_state(host)

    def _restore(self, step: int) -> None:
        """A survivor: put shards, schedulers, loop progress and data position back to boundary ``step``."""
        trainer = self.lightning_module.trainer
        live = self.runtime.last_boundary == step == trainer.global_step
        host = self._host_at(step)
        if not live:
            for hook in self.runtime.rollback_hooks:
                hook()
            packed = self.replicator.own[step]
            shard_state.restore(self.lightning_module, self.optimizers[0], unpack(packed.meta, packed.payload))
            for config, state in zip(trainer.lr_scheduler_configs, host["schedulers"], strict=True):
                config.scheduler.load_state_dict(state)
            for optimizer, groups in zip(self.optimizers, host["param_groups"], strict=True):
                _set_hyperparameters(optimizer, groups)
        rewind_loops(trainer.fit_loop, host["loops"])
        self._load_own(self._own[step])  # also undoes what a retried step's forward did to them
        if self._fetcher is not None:
            self._fetcher.rewind(step)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    # -- collectives (a poisoned relay leaves each rank with its local value within a step; after its
    # optimizer step, see :meth:`PoisoningGroup.refuse_made_up`) ------------------------------------------
    def _local_only(self) -> bool:
        self.relay.refuse_made_up()
        return self._entering or self.relay.poisoned is not None

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


class _ShardedPlan:
    """``torchpass_fsdp``'s recovery plan: rows are :class:`ShardRow`, the decision a :class:`ShardAgreement`
    (the newest step every shard has a copy of); the exchange moves the lost shards from their ring
    successors and the rest of the state from the donor; survivors then restore that step."""

    def __init__(self, strategy: TorchPassFSDPStrategy) -> None:
        self.strategy = strategy

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
        self.strategy._exchange(a)

    def finish(self, a: ShardAgreement) -> tuple[int, dict[str, Any]]:
        s, rt = self.strategy, self.strategy.runtime
        if rt.is_spare:
            s._entering = True
        else:
            s._restore(a.restore_step)
        rt.is_spare = False
        s.replicator.reset()
        s.relay.heal()
        return a.restore_step, {**self.describe(a), "steps_rolled_back": a.lost_steps}
