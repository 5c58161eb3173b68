"""Background snapshots of an Accelerate loop's tracked state, and the resume from the newest one when the
job starts again (more workers lost than spares could replace, or a job started again by hand).

The parts are the engine's (:mod:`torchpass_plugins.core.training_state`): ``model`` and ``optim`` by
parameter name, so a job of another size loads them; ``trainer`` holds every other tracked object's state
and the loop's position (optimizer steps applied, pass and batch, Accelerate's accumulation counter and
gradient scaler). A snapshot of step ``k`` is taken at the boundary of step ``k`` (before its first batch
is computed); parameters and optimizer state are copied in the background until the optimizer step.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchpass_plugins.config import SnapshotConfig
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.core.training_state import (
    MODEL,
    OPTIMIZER,
    TRAINER,
    ModelState,
    OptimizerState,
    load_stored,
    stable_pointers,
)
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.storage.snapshot_parts import newest_to_resume, say_resumed, snapshot_values, unpack
from torchpass_plugins.storage.snapshot_store import Manifest, SnapshotStore, model_fingerprint
from torchpass_plugins.storage.snapshot_writer import AsyncSnapshotWriter, SnapshotPlan

if TYPE_CHECKING:
    from torchpass_plugins.integrations.accelerate.loop import TorchPass

_LAND_ON_LEAVE_S = 60.0  # how long a worker leaving the job waits for its snapshot in flight


class _Rest:
    """The ``trainer`` part: every tracked object but the model and the optimizers, and the loop's state."""

    def __init__(self, tp: TorchPass, objects: dict[str, Any]) -> None:
        self.tp, self.objects = tp, objects

    def state_dict(self) -> dict[str, Any]:
        return {**{name: obj.state_dict() for name, obj in self.objects.items()},
                TRAINER: self.tp.loop_state().state_dict()}


class LoopSnapshots:
    """The snapshots of one ``TorchPass`` loop in ``url``, every ``every`` optimizer steps."""

    def __init__(self, tp: TorchPass, url: str, every: int) -> None:
        models = [(name, o) for name, o in tp.objects.items() if isinstance(o, nn.Module)]
        if len(models) != 1:
            raise ConfigError(f"torchpass: snapshots of an Accelerate loop hold one model; {len(models)} are "
                              "tracked (prepared). Snapshot a loop of several models with its own checkpoints")
        self.tp, self.every, self.last = tp, every, 0
        self.model = models[0][1]
        self.optimizers = [getattr(o, "optimizer", o) for o in tp.objects.values()
                           if isinstance(o, torch.optim.Optimizer)]
        self.others = {name: o for name, o in tp.objects.items()
                       if o is not self.model and not isinstance(o, torch.optim.Optimizer)}
        at_boundary = functools.partial(tp.boundary_buffers, models[0][0])
        self.parts = {MODEL: ModelState(self.model, at_boundary=at_boundary),
                      OPTIMIZER: OptimizerState(self.model, self.optimizers),
                      TRAINER: _Rest(tp, self.others)}
        self.store = SnapshotStore(url)
        self.writer: AsyncSnapshotWriter | None = None  # once the loop's state (its seed among it) is in place
        self.resumed: Manifest | None = None  # the snapshot this job resumed from
        self._stall: float | None = None

    def begin_writing(self) -> None:
        """After the resume or a spare's entry, with the job seed the loop now has: write snapshots from the
        next step boundary on, each one's copy complete before any optimizer changes what it copies."""
        rt, defaults = self.tp.runtime, SnapshotConfig()
        plan = SnapshotPlan(self.store, rt.rank, rt.world_size, writers=[0], seed=rt.seed, keep=defaults.keep,
                            when_busy=defaults.when_busy, commit_timeout=defaults.timeout_s,
                            model=model_fingerprint(self.model), roster=lambda: rt.member.latest_gen)
        writer = self.writer = AsyncSnapshotWriter(plan, rt.events)
        rt.leave_hooks.append(lambda: writer.close(timeout=_LAND_ON_LEAVE_S))
        rt.rollback_hooks.append(writer.fence)
        for optimizer in self.optimizers:
            optimizer.register_step_pre_hook(lambda *_: self.before_optimizer_step())

    def resume(self) -> bool:
        """At the job's start (not a spare's entry): every rank loads the newest snapshot whose files verify.
        Returns whether there was one."""
        rt = self.tp.runtime
        starting = rt.phase is Phase.ACTIVE

        def broadcast(value: Any) -> Any:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        def agree(ok: bool) -> bool:
            verdict = torch.tensor(int(ok))
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
            return bool(verdict.item())

        found = newest_to_resume(self.store, rt.rank, rt.world_size, model_fingerprint(self.model), starting,
                                 broadcast, agree)
        if found is None:
            return False
        manifest, refused, torn = found
        self.load(manifest)  # (the seed with the loop's state)
        self.resumed = manifest
        self.last = manifest.step
        say_resumed(rt.events, self.store, manifest, rt.rank, rt.world_size, refused, torn,
                    rt.member.reached_before_restart())
        return True

    def load(self, manifest: Manifest) -> None:
        """Load the snapshot ``manifest`` into the tracked objects (a rank's own read: no collective)."""
        values: dict[str, Any] = {TRAINER: b""}
        self.store.read(manifest, values)
        rest = unpack(values[TRAINER])
        consumed, world_size = rest[TRAINER]["position"]["consumed"], self.tp.runtime.world_size
        if consumed and manifest.world_size != world_size:
            raise ConfigError(f"torchpass: the snapshot of step {manifest.step} in {self.store.url} was taken "
                              f"{consumed} batches into a pass over {manifest.world_size} ranks; this job has "
                              f"{world_size}, which would split the rest of that pass otherwise: resume it with "
                              f"{manifest.world_size} ranks")
        load_stored({MODEL: self.parts[MODEL], OPTIMIZER: self.parts[OPTIMIZER]},
                    lambda prefix: self.store.stored(manifest, prefix), lambda into: self.store.read(manifest, into))
        for name, obj in self.others.items():
            obj.load_state_dict(rest[name])
        self.tp.loop_state().load_state_dict(rest[TRAINER])
        self.tp.runtime.buffer_sync.mark_boundary()

    def at_boundary(self, step: int) -> None:
        """The boundary of ``step``: begin its snapshot when one is due."""
        if not self.every or step % self.every or step <= self.last:
            return
        self.last = step
        t0 = time.perf_counter()
        values = snapshot_values(self.parts, self.tp.runtime.rank)
        if self.writer.start(step, values, stable_pointers(self.model, self.optimizers)):
            self._stall = time.perf_counter() - t0

    def before_optimizer_step(self) -> None:
        """The parameters are about to change: the snapshot's copy of them must be complete."""
        if self._stall is None:
            return
        stall, self._stall = self._stall + self.writer.fence(), None
        self.tp.runtime.events.emit("snapshot_staged", rank=self.tp.runtime.rank, step=self.last, stall_s=stall)

    def close(self) -> None:
        """At the end of training: the snapshot in flight lands (or is abandoned, said in the log)."""
        timeout = SnapshotConfig().timeout_s
        if self.writer is not None and not self.writer.close(timeout=timeout):
            self.tp.runtime.events.emit("snapshot_failed", rank=self.tp.runtime.rank, step=self.last,
                                        error=f"still in flight {timeout:g} s after training ended: abandoned "
                                              "(the previous snapshot stands)")
