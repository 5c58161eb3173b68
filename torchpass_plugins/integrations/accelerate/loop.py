"""Hot spares for a hand-written Hugging Face Accelerate training loop.

The user keeps ``Accelerator``, ``prepare`` and their loop, and adds four lines::

    tp = TorchPass()                      # before Accelerator(): joins the job; a spare waits here
    accelerator = Accelerator(gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    tp.track(accelerator, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    for epoch in tp.epochs(3):
        for batch in tp.batches(loader):
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
                optimizer.step(); scheduler.step(); optimizer.zero_grad()

The recovery protocol is the core's (:class:`Runtime`), as for ``torchpass_ddp``: ``tp.batches`` marks
step boundaries; ``accelerator.backward`` of a step's last micro-batch reduces the gradients in fixed
buckets through the runtime and votes to commit the step, so a failure is retried from intact local
gradients; the default ``torch.distributed`` group is a :class:`RetryingGroup`, so Accelerate's
own collectives survive too; DDP's wrapper stays (``unwrap_model`` and ``no_sync`` work) but passes
``forward`` straight to the module. A spare receives the tracked state (``state_dict`` of every tracked
object, optimizer steps applied, Accelerate's accumulation counter, the data position) from a peer and
enters at the boundary of the step in flight.

Without a torchpass supervisor (plain ``accelerate launch train.py``, or ``python train.py``) the same
script runs unprotected, after one warning that the loss of a worker will end the job.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from torchpass_plugins.config import in_torchpass_worker
from torchpass_plugins.core import default_group
from torchpass_plugins.core.backends import communicate_on, slot_gpu
from torchpass_plugins.core.buffer_sync import BufferSync
from torchpass_plugins.core.default_group import RetryingGroup
from torchpass_plugins.core.grad_buckets import GradientBuckets
from torchpass_plugins.core.runtime import Runtime
from torchpass_plugins.core.training_state import TRAINER, Held, ModelState, Stateful
from torchpass_plugins.core.tree import tensors_in
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.accelerate.prepared import check_layout, check_loader, seed_loader, sort_tracked
from torchpass_plugins.integrations.accelerate.snapshots import LoopSnapshots
from torchpass_plugins.testing import faults
from torchpass_plugins.weights.rank_zero import RankZeroPublishing

log = logging.getLogger(__name__)

UNPROTECTED = (
    "torchpass: this process was not started by a torchpass supervisor, so the loss of any worker will end "
    "the job (accelerate launch's agent stops every process when one dies). To survive it, launch with "
    "`accelerate launch --multi_gpu --num_processes N -m torchpass_plugins.run --spares S train.py` "
    "or `torchpass launch --nproc-per-node N --spares S train.py`."
)


_SHARDING = ("FSDP", "DEEPSPEED", "MEGATRON_LM")  # Accelerate's distributed types whose ranks hold shards


class UnprotectedRunWarning(UserWarning):
    """The script runs without torchpass: a worker's loss ends the job."""


class TorchPass:
    """Declares what a loop's state is and where its steps begin; see the module docstring."""

    def __init__(self, seed: int | None = None, timeout: timedelta | float | None = None,
                 process_group_backend: str | None = None, publish_weights: str | None = None,
                 publish_every_n_steps: int = 1, publish_dtype: str | None = None,
                 publish_storage: str | None = None, snapshot_dir: str | None = None,
                 snapshot_every_n_steps: int = 0) -> None:
        """``seed``: the job seed of the per-step random streams (dropout, ...); pass the seed given to
        ``set_seed`` so that runs launched apart draw the same numbers (default: ``--seed`` of the launch,
        else one derived from the job's token). ``process_group_backend``: for CUDA tensors, where a GPU is
        visible (``nccl`` unless given; ``gloo`` for several ranks sharing one GPU). ``timeout``: a collective's,
        as a ``timedelta`` or seconds (default: ``torchpass.timeouts.collective_s``). ``publish_weights``
        (``tcp://HOST:PORT``), ``publish_every_n_steps``, ``publish_dtype``, ``publish_storage``: logical
        rank 0 serves versions of the tracked model's weights to subscribers, as ``TorchPassCallback``'s
        arguments of those names. ``snapshot_dir`` (a path or fsspec URL), ``snapshot_every_n_steps``:
        background snapshots of the tracked state, resumed from when the job starts again (default: the
        launch's ``--snapshot-dir`` and ``--snapshot-every``)."""
        self.active = in_torchpass_worker()
        self.publishing = (RankZeroPublishing(publish_weights, publish_every_n_steps, publish_dtype, publish_storage)
                           if publish_weights else None)
        self.runtime: Runtime | None = None
        self._pending: dict[str, Any] | None = None  # a spare's received state, applied by ``track``
        self.applied = 0
        self._tracked = False
        self._iteration, self._consumed = 0, 0  # the data position: loader pass, batches taken in it
        self._step_open = False
        self._reduced = False
        self.snapshots: LoopSnapshots | None = None
        if not self.active:
            warnings.warn(UNPROTECTED + (" Weights are published only under it." if publish_weights else ""),
                          UnprotectedRunWarning, stacklevel=2)
            return
        from torchpass_plugins.control.worker import current_runtime
        from torchpass_plugins.control.worker_env import WorkerEnv

        env = WorkerEnv.from_env()
        self._snapshot_to = ((snapshot_dir, snapshot_every_n_steps) if snapshot_dir else
                             (env.snapshot_dir, env.snapshot_every) if env.snapshot_dir else None)
        rt = self.runtime = current_runtime(timeout)
        if seed is not None:
            rt.seed_override = seed
        # Accelerate reads the layout from the environment: logical rank and world size, the slot's device.
        os.environ.update(RANK=str(rt.rank), WORLD_SIZE=str(rt.world_size), LOCAL_RANK=str(rt.env.local_slot))
        host, port = rt.env.store_host_port
        os.environ.setdefault("MASTER_ADDR", host)
        os.environ.setdefault("MASTER_PORT", str(port))
        if torch.cuda.is_available():  # Accelerate places each process on cuda:LOCAL_RANK (its slot's GPU)
            communicate_on(rt.transport, slot_gpu(rt.env.local_slot), process_group_backend)
        default_group.install(RetryingGroup(rt), rt.transport.timeout)
        rt.adapter = self
        rt.rank_state = None
        rt.events.source = f"rank{rt.rank}"
        rt.events.emit("worker_ready", worker=rt.env.worker_id, rank=rt.rank, spare=rt.is_spare)
        if rt.is_spare:
            rt.enter_as_spare()  # the state waits in ``_pending`` until ``track`` has the objects

    # -- what the user calls --------------------------------------------------------------------------
    def track(self, accelerator: Any, **objects: Any) -> None:
        """Declare the loop's state, after ``accelerator.prepare``: the model(s), optimizer(s), the train
        loader (one), and any object with ``state_dict``/``load_state_dict`` (schedulers, EMA, ...), each
        under a name of your choice."""
        if not self.active:
            return
        if self._tracked:
            raise ConfigError("torchpass: TorchPass.track was called twice; declare every object in one call")
        loader, optimizers, models = sort_tracked(objects)
        check_layout(accelerator, self.runtime)
        check_loader(loader)
        self.accelerator, self.loader = accelerator, loader
        self.objects = {name: accelerator.unwrap_model(o) if isinstance(o, nn.Module) else o
                         for name, o in objects.items() if o is not self.loader}
        for model in models:
            if isinstance(model, nn.parallel.DistributedDataParallel):
                model.forward = model.module.forward  # gradients are reduced by the buckets below, not DDP
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        self._buckets = GradientBuckets(params, self.runtime.world_size)
        self._wrap_backward(accelerator)
        inner = optimizers[0].optimizer if hasattr(optimizers[0], "optimizer") else optimizers[0]
        inner.register_step_pre_hook(self._before_optimizer_step)
        inner.register_step_post_hook(self._after_optimizer_step)
        # Every rank takes rank 0's buffers at each step's commit, as DDP's forward would have broadcast them.
        self.runtime.buffer_sync = BufferSync.of_state_dicts(
            {name: o for name, o in self.objects.items() if isinstance(o, nn.Module)})
        self._tracked = True
        if self._snapshot_to is not None:
            self.snapshots = LoopSnapshots(self, *self._snapshot_to)
        if self._pending is not None:  # a spare: the state it received
            self._adopt(self._pending)
            self._pending = None
        elif self.snapshots is not None:
            self.snapshots.resume()
        if self.snapshots is not None:
            self.snapshots.begin_writing()
        self.runtime.buffer_sync.mark_boundary()
        self._order = seed_loader(self.loader, self.runtime.seed)  # (the seed a snapshot was written with)
        if self.publishing is not None:
            self._start_publishing(models, optimizers)

    def _start_publishing(self, models: list[nn.Module], optimizers: list[Any]) -> None:
        if len(models) != 1:
            raise ConfigError(f"torchpass: publish_weights publishes the tracked model; {len(models)} are tracked")
        self._published = self.accelerator.unwrap_model(models[0])
        rt = self.runtime
        kind = str(getattr(self.accelerator.distributed_type, "value", self.accelerator.distributed_type))
        self.publishing.check(self._published, sharded_by=kind if kind in _SHARDING else None)
        for optimizer in optimizers:  # the version's copy is finished before any optimizer changes the weights
            inner = getattr(optimizer, "optimizer", optimizer)
            inner.register_step_pre_hook(lambda *_: self.publishing.before_optimizer_step())
        rt.leave_hooks.append(self.publishing.close)
        self.publishing.at_start(rt.rank, self.applied, self._published, rt.events)

    def epochs(self, count: int) -> Iterator[int]:
        """``range(count)`` from the pass over the data the job is in (a spare enters mid-run); then the
        end of training, once every rank has finished."""
        if not self.active:
            yield from range(count)
            return
        self._require_tracked()
        yield from range(self._iteration, count)
        self._end_training()

    def _end_training(self) -> None:
        """Every rank has finished training: the last weights published, the snapshot in flight landed."""
        step = self.applied
        if self.publishing is not None:
            self.publishing.at_end(self.runtime.rank, step, self._published, self.runtime.events)
        if self.snapshots is not None:
            self.snapshots.close()
        if self.runtime.last_boundary != step:
            self.runtime.boundary(step)
        self.runtime.collective(lambda t: t.barrier(), None)
        self.runtime.training_complete(step)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One pass over the tracked train loader, with the step boundaries marked."""
        if not self.active:
            yield from loader
            return
        self._require_tracked()
        if loader is not self.loader:
            raise ConfigError("torchpass: batches() takes the train loader that was passed to track()")
        self.loader.iteration = self._iteration
        self._order.set_epoch(self._iteration)  # a spare's skipping loader does not pass the epoch on
        source = self.loader
        if self._consumed:  # a spare resumes mid-pass: the sampler skips what its predecessor took
            from accelerate import skip_first_batches

            source = skip_first_batches(self.loader, self._consumed)
        batches = self._pass_of(source)
        while True:
            # Fetch, then mark the boundary: a pass's first fetch draws its base seed from the global
            # generator, which the boundary then reseeds, so no step's random stream depends on where a
            # pass began (a spare starts its pass mid-way).
            faults.point("data")
            try:
                batch = next(batches)
            except StopIteration:
                break
            if not self._step_open and self.runtime.last_boundary != self.applied:
                self._boundary()
            self._step_open = True
            self._consumed += 1
            yield batch
        self._iteration, self._consumed = self._iteration + 1, 0
        self.loader.iteration = self._iteration

    def _pass_of(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One pass of ``loader`` as the loop would take it."""
        return iter(loader)

    # -- hooks --------------------------------------------------------------------------------------------
    def _boundary(self) -> None:
        rt = self.runtime
        rt.boundary(self.applied)
        if rt.drain_due(self.applied) is not None:
            rt.carry_out_drain(self.applied)
        if self.publishing is not None:
            self.publishing.at_boundary(rt.rank, self.applied, self._published, rt.events)
        if self.snapshots is not None:
            self.snapshots.at_boundary(self.applied)

    def _wrap_backward(self, accelerator: Any) -> None:
        original = accelerator.backward
        rt, buckets = self.runtime, self._buckets

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            faults.point("backward")
            sync = accelerator.sync_gradients
            if sync:
                buckets.overlap_with(rt.transport)
            original(loss, **kwargs)
            if sync:  # the step's last micro-batch: reduce and commit, as DDP would have reduced by now
                rt.reduce_gradients(buckets)
                buckets.write_back()
                self._reduced = True

        accelerator.backward = backward

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._reduced:
            raise RuntimeError(
                "torchpass: the optimizer stepped before the gradients were reduced; compute them with "
                "accelerator.backward(loss) (inside accelerator.accumulate(model) when accumulating)"
            )

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._reduced = self._step_open = False
        self.applied += 1
        faults.point("optimizer")

    def _require_tracked(self) -> None:
        if not self._tracked:
            raise ConfigError("torchpass: call tp.track(accelerator, model=..., optimizer=..., loader=...) first")

    # -- the runtime's Adapter ----------------------------------------------------------------------------
    def applied_steps(self) -> int:
        return self.applied

    def boundary_snapshot(self) -> dict[str, int]:
        return {"iteration": self._iteration, "consumed": self._consumed, "accumulation": self.accelerator.step}

    def training_state(self) -> dict[str, Stateful]:
        """The tracked objects under their names, and the loop's position as the ``trainer`` part (a spare
        promoted before it tracks anything hands on what it received)."""
        if self._pending is not None:
            return {name: Held(values) for name, values in self._pending.items()}
        return {**{name: ModelState(obj, at_boundary=functools.partial(self.boundary_buffers, name))
                   if isinstance(obj, nn.Module) else obj for name, obj in self.objects.items()},
                TRAINER: self.loop_state()}

    def boundary_buffers(self, name: str) -> dict[str, torch.Tensor]:
        """The buffers of tracked model ``name`` as of the last step boundary (the live ones have moved on
        with the step's forward)."""
        prefix = f"{name}."
        return {key.removeprefix(prefix): value for key, value in self.runtime.buffer_sync.boundary_values().items()
                if key.startswith(prefix)}

    def loop_state(self) -> _LoopState:
        return _LoopState(self)

    def state_tensors(self) -> list[torch.Tensor]:
        return tensors_in([obj.state_dict() for obj in self.objects.values()]) if self._tracked else []

    def load_state(self, values: dict[str, Any]) -> None:
        self.applied = values[TRAINER]["applied"]
        if self._tracked:
            self._adopt(values)
        else:
            self._pending = values

    def _adopt(self, values: dict[str, Any]) -> None:
        missing = set(self.objects) - set(values)
        if missing:
            raise ConfigError(f"torchpass: the peers track no state for {sorted(missing)}; track the same names")
        for name, obj in self.objects.items():
            obj.load_state_dict(values[name])
        self.loop_state().load_state_dict(values[TRAINER])
        self.runtime.buffer_sync.mark_boundary()
        log.info("torchpass: entered at step %d (pass %d, batch %d)", self.applied, self._iteration, self._consumed)


class _LoopState:
    """Where the loop stands at the last step boundary: optimizer steps applied, the data position,
    Accelerate's accumulation counter, its gradient scaler, and the job seed the loop's random streams and
    sample order come from (a job started again by hand may have another)."""

    def __init__(self, tp: TorchPass) -> None:
        self.tp = tp

    def state_dict(self) -> dict[str, Any]:
        tp = self.tp
        state = {"applied": tp.applied, "position": tp.runtime.boundary_record or tp.boundary_snapshot(),
                 "seed": tp.runtime.seed}
        if tp.accelerator.scaler is not None:
            state["scaler"] = tp.accelerator.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tp = self.tp
        tp.applied = state["applied"]
        tp.runtime.seed_override = state["seed"]
        if "scaler" in state:
            tp.accelerator.scaler.load_state_dict(state["scaler"])
        position = state["position"]
        tp._iteration, tp._consumed = position["iteration"], position["consumed"]
        tp.accelerator.step = position["accumulation"]
