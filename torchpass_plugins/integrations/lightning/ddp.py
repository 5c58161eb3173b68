"""``torchpass_ddp``: data-parallel training whose failed workers are replaced by spares, live.

Unlike Lightning's ``DDPStrategy`` the module is not wrapped in ``DistributedDataParallel``: gradients
are averaged in fixed buckets (:class:`GradientBuckets`) issued while the last micro-batch's backward
runs, through the runtime, so that (a) a failed reduction leaves every local gradient intact for the
retry, (b) the summation order never depends on a layout that a fresh process would build differently,
and (c) the step is committed only once every rank holds the reduced gradient. Every other collective
Lightning makes (barrier, broadcast, ``sync_dist`` reductions, ``all_gather``) goes through the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from torchpass_plugins._compat.lightning import (
    apply_layer_sync,
    optimizers_to_device,
    refuse_unsupported,
    wait_in_prepare_data,
)
from torchpass_plugins._compat.lightning_trainer import keep_logger_versions
from torchpass_plugins.core import default_group
from torchpass_plugins.core.backends import communicate_on, slot_gpu
from torchpass_plugins.core.buffer_sync import BufferSync
from torchpass_plugins.core.default_group import RetryingGroup
from torchpass_plugins.core.grad_buckets import GradientBuckets
from torchpass_plugins.core.process_group import ReconfigurableGroup
from torchpass_plugins.core.training_state import (
    MODEL,
    OPTIMIZER,
    OWN,
    TRAINER,
    ModelState,
    OptimizerState,
    Stateful,
    stable_pointers,
)
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.adapter import LightningAdapter
from torchpass_plugins.integrations.lightning.callback import TorchPassCallback
from torchpass_plugins.integrations.lightning.ddp_collectives import RecoverableCollectives
from torchpass_plugins.integrations.lightning.environment import TorchPassEnvironment
from torchpass_plugins.integrations.lightning.state_parts import Incoming, LoggedState, TrainerState
from torchpass_plugins.storage.snapshot_parts import snapshot_values
from torchpass_plugins.testing import faults


class TorchPassDDPStrategy(RecoverableCollectives, ParallelStrategy):
    """Data parallel with hot spares. Use ``strategy="torchpass_ddp"`` under ``torchpass launch``.

    Args:
        accelerator: the Trainer's accelerator, which fills it in.
        parallel_devices: this node's devices of the active ranks; the Trainer fills them in from ``devices``
            (under ``torchpass launch``, ``devices="auto"`` is the job's active ranks per node).
        checkpoint_io: how checkpoints are written, as in Lightning's ``DDPStrategy``.
        precision_plugin: the Trainer's precision plugin, which fills it in.
        cluster_environment: the job's ranks; ``TorchPassEnvironment`` unless given.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks before the ranks
            treat it as a failure; the job's ``timeouts.collective_s`` unless given.
        bucket_cap_mb: the size of the gradient buckets reduced while backward still runs.
        process_group_backend: the backend of the CUDA tensors' group (``nccl`` unless given), as Lightning.
    """

    strategy_name = "torchpass_ddp"

    def __init__(
        self,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[TorchPassEnvironment] = None,
        checkpoint_io=None,
        precision_plugin=None,
        timeout: Union[timedelta, float, None] = None,
        bucket_cap_mb: float = 4.0,
        process_group_backend: Optional[str] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or TorchPassEnvironment(timeout),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._bucket_cap_mb = bucket_cap_mb
        self._process_group_backend = process_group_backend
        self._buckets: GradientBuckets | None = None
        self.runtime = self.cluster_environment.runtime
        self.adapter = LightningAdapter(self)
        self._incoming: Incoming | None = None  # a state to adopt: its model and optimizers as Lightning restores
        self._trainer_part_only = False  # Lightning's checkpoint is dumped for its trainer part: no model, no optimizer

    # -- layout ---------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def root_device(self) -> torch.device:
        if self.parallel_devices and self.parallel_devices[0].type == "cuda":
            return slot_gpu(self.local_rank)
        return torch.device("cpu")

    @property
    def process_group_backend(self) -> Optional[str]:
        """The backend of the default group's device tensors (``nccl`` on CUDA unless given, as Lightning)."""
        return self._process_group_backend

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning to shard data with a ``DistributedSampler``."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- setup ----------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        asked = len(self.parallel_devices or []) * self.num_nodes
        if asked != self.world_size:
            raise ConfigError(
                f"torchpass: Trainer(devices={len(self.parallel_devices or [])}, num_nodes={self.num_nodes}) "
                f"asks for {asked} ranks but the job has {self.world_size} active ranks "
                "(processes minus spares). Make devices x num_nodes equal the active ranks."
            )
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        super().setup_environment()
        rt = self.runtime
        communicate_on(rt.transport, self.root_device, self._process_group_backend)
        rt.adapter = self.adapter
        rt.events.source = f"rank{rt.rank}"
        for callback in self.lightning_module.trainer.callbacks:
            if isinstance(callback, TorchPassCallback):
                callback.attach(rt)
        rt.events.emit("worker_ready", worker=rt.env.worker_id, rank=rt.rank, spare=rt.is_spare)
        keep_logger_versions(self.lightning_module.trainer, rt.member.store, starting=not rt.is_spare)
        self._end_even_if_skipped()
        self._connect()
        wait_in_prepare_data(self.lightning_module.trainer, self._wait_for_all)

    def _end_even_if_skipped(self) -> None:
        """Lightning skips a fit loop with nothing left to train, its ``on_train_end`` hooks included. A
        spare that took over a rank lost in the barrier ending ``fit`` holds exactly such a state; it must
        still join that barrier, which the others are retrying, so the loop's end runs here then."""
        loop = self.lightning_module.trainer.fit_loop
        run = loop.run

        def run_to_the_end() -> None:
            run()
            self.adapter.fit_ended()
            if loop.done and self.runtime.last_boundary < loop.epoch_loop.global_step:
                self.on_train_end()

        loop.run = run_to_the_end

    def _connect(self) -> None:
        """Start communicating: a spare receives its predecessor's state here. The default
        ``torch.distributed`` group becomes the recoverable one, so that what the user's code and libraries
        reduce themselves (torchmetrics' states) spans every rank and survives a failure."""
        default_group.install(RetryingGroup(self.runtime), self.runtime.transport.timeout)
        if self.runtime.is_spare:
            self.runtime.enter_as_spare()

    @override
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.model = apply_layer_sync(self, self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_parameters()
        self.runtime.buffer_sync = BufferSync(list(self.lightning_module.named_buffers()))
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        refuse_unsupported(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _broadcast_parameters(self) -> None:
        """Start every rank from rank 0's weights, as DDP does (a spare takes the donor's instead)."""
        tensors = [t for t in self.model.state_dict().values() if isinstance(t, Tensor)]

        def run(t: ReconfigurableGroup) -> None:
            for tensor in tensors:
                t.broadcast_from(tensor, 0)

        with torch.no_grad():
            self.runtime.collective(run, None)

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def on_train_start(self) -> None:
        self.runtime.buffer_sync.mark_boundary()  # a spare's restored state is in place by now
        self.adapter.install_step_boundary()

    @override
    def on_train_end(self) -> None:
        step = self.lightning_module.trainer.global_step
        self.runtime.boundary(step)
        self.barrier("torchpass.fit_end")
        self.runtime.training_complete(step)

    # -- gradients ------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        faults.point("forward")
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        faults.point("backward")
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        params = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]
        self._buckets = GradientBuckets(params, self.world_size, int(self._bucket_cap_mb * 2**20))

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            self._buckets.overlap_with(self.runtime.transport)
            result = closure()
            self.runtime.reduce_gradients(self._buckets)
            self._buckets.write_back()
            return result

        result = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        faults.point("optimizer")
        return result

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        self.adapter.resume_data_from(checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._incoming is None:
            return super().load_model_state_dict(checkpoint, strict)
        self._incoming.load_model(self.training_state(complete=self._incoming.complete))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        incoming, self._incoming = self._incoming, None
        if incoming is None:
            return super().load_optimizer_state_dict(checkpoint)
        incoming.load_optimizers(self.training_state(complete=incoming.complete))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._trainer_part_only else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {} if self._trainer_part_only else super().optimizer_state(optimizer)

    @contextmanager
    def without_model_and_optimizers(self) -> Iterator[None]:
        """Lightning's checkpoint dumped meanwhile leaves out the model and the optimizers (parts of their own)."""
        self._trainer_part_only = True
        try:
            yield
        finally:
            self._trainer_part_only = False

    # -- the training state (handed to spares, written to snapshots) -----------------------------------
    def training_state(self, complete: bool = True) -> dict[str, Stateful]:
        """The state as of the last step boundary, as named parts (:mod:`torchpass_plugins.core.training_state`):
        every rank holds the same but its ``own`` part, so every part is complete (``complete`` matters to
        sharded strategies only)."""
        module, sync = self.lightning_module, self.runtime.buffer_sync
        return {
            MODEL: ModelState(module, at_boundary=sync.boundary_values if sync is not None else None),
            OPTIMIZER: OptimizerState(module, self.optimizers),
            TRAINER: TrainerState(self, lambda: {"loops": self.runtime.boundary_record}),
            OWN: LoggedState(module.trainer),
        }

    def adopt(self, incoming: Incoming) -> None:
        """Before ``setup``: take ``incoming`` (a peer's state or a snapshot) as Lightning restores: the trainer
        part as a checkpoint ``fit`` restores, the model and the optimizers as Lightning loads them."""
        self._incoming = incoming
        self.adapter.restore_trainer(incoming.trainer)

    # -- snapshots (taken and resumed by TorchPassCallback) ---------------------------------------------
    def snapshot_writers(self) -> list[int]:
        """The ranks that write a part of each snapshot: every rank holds the whole state, so rank 0 alone."""
        return [0]

    def snapshot_state(self) -> tuple[dict[str, Any], set[int]]:
        """At a step boundary: the snapshot's values (:func:`.state_parts.snapshot_values`; under DDP without
        the own part: rank 0 writes alone), and the ``data_ptr`` of the tensors that stay unchanged until
        the optimizer step (copied in the background meanwhile)."""
        parts = self.training_state()
        del parts[OWN]
        return snapshot_values(parts, self.global_rank), stable_pointers(self.lightning_module, self.optimizers)

    # -- data -----------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage == RunningStage.TRAINING:
            return self.adapter.prepare_train_loader(dataloader)
        return dataloader
