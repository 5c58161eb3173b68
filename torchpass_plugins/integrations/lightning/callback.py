"""``TorchPassCallback``: background snapshots as the fallback of last resort, and where the log goes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from torchpass_plugins._compat.lightning import restoring_a_checkpoint
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.lightning.state_parts import ResumedSnapshot
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.storage.snapshot_parts import newest_to_resume, say_resumed
from torchpass_plugins.storage.snapshot_store import SnapshotStore, model_fingerprint
from torchpass_plugins.storage.snapshot_writer import AsyncSnapshotWriter, SnapshotPlan, WhenBusy
from torchpass_plugins.weights.rank_zero import RankZeroPublishing
from torchpass_plugins.weights.sharded import ShardedPublishing

_LAND_ON_LEAVE_S = 60.0  # how long a worker leaving the job (aborted, migrated) waits for its snapshot in flight


class TorchPassCallback(Callback):
    """Job-wide snapshots, and optionally another place for the workers' event log.

    The strategies work without it and log every phase of a recovery to ``RUN_DIR/events.jsonl`` (the
    launcher's ``--run-dir``). With ``snapshot_dir``, ``fit`` resumes from the newest committed snapshot
    automatically (unless ``ckpt_path`` is given).

    Args:
        run_dir: where the workers' event log goes instead of the launcher's ``--run-dir``.
        snapshot_dir: a path or fsspec URL; a snapshot of the full training state is written there in the
            background, the fallback of last resort when more workers are lost than spares can replace.
        snapshot_every_n_steps: write a snapshot every N optimizer steps (0: never).
        snapshot_keep: how many of the newest snapshots are kept.
        snapshot_when_busy: when a snapshot is due while the previous one is still being written, ``skip``
            it or ``wait`` for the previous one.
        snapshot_storage_options: fsspec options for ``snapshot_dir`` (credentials, endpoint).
        snapshot_timeout: seconds a snapshot may take to land (every rank's file written and the manifest
            committed). At the end of training, one still in flight after it is abandoned and logged, so
            storage that hangs cannot hang the job; the previous snapshot stands.
        publish_weights: ``tcp://HOST:PORT`` where logical rank 0 serves versions of the weights to
            ``WeightSubscriber`` processes outside the job (rollout replicas), with the token in
            ``TORCHPASS_WEIGHTS_TOKEN``; the copy into host memory runs in the background during the step.
        publish_every_n_steps: a version every N optimizer steps, numbered by the step, and the last one.
        publish_dtype: ``bfloat16`` or ``float16`` casts floating tensors as they are published.
        publish_storage: a path or fsspec URL (credentials from fsspec's environment) where the newest version
            is also written, in the background, for subscribers that cannot reach ``publish_weights``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike | None = None,
        snapshot_dir: str | None = None,
        snapshot_every_n_steps: int = 0,
        snapshot_keep: int = 3,
        snapshot_when_busy: WhenBusy = "skip",
        snapshot_storage_options: dict[str, Any] | None = None,
        snapshot_timeout: float = 600.0,
        publish_weights: str | None = None,
        publish_every_n_steps: int = 1,
        publish_dtype: str | None = None,
        publish_storage: str | None = None,
    ) -> None:
        if snapshot_every_n_steps < 0 or snapshot_keep < 1 or snapshot_timeout <= 0:
            raise ConfigError(
                f"torchpass: snapshot_every_n_steps={snapshot_every_n_steps} must be >= 0, "
                f"snapshot_keep={snapshot_keep} >= 1 and snapshot_timeout={snapshot_timeout} > 0"
            )
        if snapshot_every_n_steps and not snapshot_dir:
            raise ConfigError("torchpass: snapshot_every_n_steps needs snapshot_dir (a path or fsspec URL)")
        if snapshot_when_busy not in ("skip", "wait"):
            raise ConfigError(f"torchpass: snapshot_when_busy must be 'skip' or 'wait', not {snapshot_when_busy!r}")
        self.run_dir = run_dir
        self.snapshot_dir = snapshot_dir
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.snapshot_keep = snapshot_keep
        self.snapshot_when_busy = snapshot_when_busy
        self.snapshot_storage_options = snapshot_storage_options
        self.snapshot_timeout = snapshot_timeout
        self.publishing = (RankZeroPublishing(publish_weights, publish_every_n_steps, publish_dtype, publish_storage)
                           if publish_weights else None)
        self.runtime = None
        self.writer: AsyncSnapshotWriter | None = None
        self._last_snapshot = 0  # step of the newest snapshot started or resumed from
        self._stall: float | None = None  # loop time the snapshot being staged cost so far

    def attach(self, runtime) -> None:
        """Called by the torchpass strategy as it sets up, before any recovery can happen."""
        if self.run_dir is not None:
            runtime.events = EventLog(Path(self.run_dir) / "events.jsonl", source=runtime.events.source)
        self.runtime = runtime

    # -- resume ---------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self.publishing is not None:
            if self.runtime is None:
                raise ConfigError("torchpass: publish_weights needs strategy='torchpass_ddp' or 'torchpass_fsdp' "
                                  f"under `torchpass launch` (got {type(trainer.strategy).__name__})")
            if getattr(trainer.strategy, "strategy_name", None) == "torchpass_fsdp":
                self.publishing = ShardedPublishing(self.publishing, self.runtime)
            self.publishing.check(pl_module)
            self.runtime.leave_hooks.append(self.publishing.close)
        if stage != "fit" or not self.snapshot_dir:
            return
        strategy = trainer.strategy
        if self.runtime is None:
            raise ConfigError(
                "torchpass: snapshots need strategy='torchpass_ddp' or 'torchpass_fsdp' under `torchpass launch` "
                f"(got {type(strategy).__name__})"
            )
        store = SnapshotStore(self.snapshot_dir, self.snapshot_storage_options)
        model = model_fingerprint(pl_module)
        starting = self.runtime.phase is Phase.ACTIVE  # a job's start, not a spare entering it
        if not restoring_a_checkpoint(trainer):  # neither the user's checkpoint nor a spare's handed state
            self._resume(trainer, store, model, starting)
        elif starting and strategy.global_rank == 0:
            store.discard_torn()
        plan = SnapshotPlan(store, strategy.global_rank, strategy.world_size, strategy.snapshot_writers(),
                            seed=self.runtime.seed,
                            keep=self.snapshot_keep, when_busy=self.snapshot_when_busy,
                            commit_timeout=self.snapshot_timeout, model=model,
                            roster=lambda: self.runtime.member.latest_gen)
        self.writer = AsyncSnapshotWriter(plan, self.runtime.events)
        self.runtime.leave_hooks.append(lambda: self.writer.close(timeout=_LAND_ON_LEAVE_S))
        self.runtime.rollback_hooks.append(self.writer.fence)

    def _resume(self, trainer, store: SnapshotStore, model: str, starting: bool) -> None:
        """All ranks resume from the newest snapshot whose files all verify (each rank verifies a share of
        them), in this job's layout whatever the layout of the job that wrote it."""
        strategy = trainer.strategy
        rank = strategy.global_rank
        found = newest_to_resume(
            store, rank, strategy.world_size, model, starting, lambda value: strategy.broadcast(value, 0),
            lambda ok: bool(strategy.reduce(torch.tensor(int(ok)), reduce_op="min").item()))
        if found is None:
            return
        manifest, refused, torn = found
        strategy.adopt(ResumedSnapshot(store, manifest, rank))
        self.runtime.seed_override = manifest.seed
        self._last_snapshot = manifest.step
        say_resumed(self.runtime.events, store, manifest, rank, strategy.world_size, refused, torn,
                    self.runtime.member.reached_before_restart())

    # -- at step boundaries: snapshots, published weights ------------------------------------------------------
    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if self.publishing is not None:
            self.publishing.at_start(trainer.global_rank, trainer.global_step, pl_module, self.runtime.events)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if (trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1) % trainer.accumulate_grad_batches:
            return  # not the step's first micro-batch
        if self.publishing is not None:
            self.publishing.at_boundary(trainer.global_rank, trainer.global_step, pl_module, self.runtime.events)
        every, step = self.snapshot_every_n_steps, trainer.global_step
        if self.writer is None or not every or step % every or step <= self._last_snapshot:
            return
        self._last_snapshot = step
        t0 = time.perf_counter()
        state, stable = trainer.strategy.snapshot_state()  # on every rank: Lightning's save hooks run on all
        if self.writer.start(step, state, stable):
            self._stall = time.perf_counter() - t0

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.publishing is not None:
            self.publishing.before_optimizer_step()
        if self.writer is None or self._stall is None:
            return
        stall, self._stall = self._stall + self.writer.fence(), None
        self.runtime.events.emit("snapshot_staged", rank=trainer.global_rank, step=trainer.global_step,
                                 stall_s=stall)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.publishing is not None:
            self.publishing.at_end(trainer.global_rank, trainer.global_step, pl_module, self.runtime.events)
        if self.writer is not None and not self.writer.close(timeout=self.snapshot_timeout):
            self.runtime.events.emit("snapshot_failed", rank=trainer.global_rank, step=self._last_snapshot,
                                     error=f"still in flight {self.snapshot_timeout:g} s after training ended: "
                                     "abandoned (the previous snapshot stands)")

