"""Background snapshots: the training loop pays for a host copy of what changes soon, nothing more.

A snapshot of step ``k`` is taken at the boundary of step ``k``. Parameters and optimizer state do not
change until step ``k``'s optimizer step, so they are copied to host memory by a background thread while
forward and backward run; the loop waits for that copy only at :meth:`AsyncSnapshotWriter.fence`, just
before the optimizer step. Everything else (buffers such as batch-norm statistics, which the forward
updates, and small values) is copied at once. Serialization, the write and the commit also run in the
background. At most one snapshot is in flight; what happens when the next one is due before the last one
landed is a policy (``skip`` or ``wait``), logged either way.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchpass_plugins.core.host_copy import to_host
from torchpass_plugins.core.training_state import local_part
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.storage.snapshot_store import RankSave, SnapshotStore
from torchpass_plugins.testing import faults

log = logging.getLogger(__name__)

WhenBusy = Literal["skip", "wait"]


@dataclass
class SnapshotPlan:
    """One job's snapshots: ``writers`` write (rank 0 what every rank holds alike, each its own shards);
    rank 0 commits."""

    store: SnapshotStore
    rank: int
    world_size: int
    writers: list[int]
    seed: int
    keep: int = 3
    when_busy: WhenBusy = "skip"
    commit_timeout: float = 600.0
    model: str = ""  # the job's model fingerprint, recorded in each manifest
    roster: Callable[[], int] = lambda: 0  # the newest roster's generation: a newer one abandons a snapshot

    @property
    def writes(self) -> bool:
        return self.rank in self.writers


class AsyncSnapshotWriter:
    def __init__(self, plan: SnapshotPlan, events: EventLog) -> None:
        self.plan = plan
        self.events = events
        self._thread: threading.Thread | None = None
        self._staged = threading.Event()
        self._staged.set()
        # Host copies of the stable tensors, reused from one snapshot to the next (at most one is in
        # flight), so that only the first snapshot pays for allocating and faulting in that memory.
        self._staging: list[torch.Tensor] = []

    def start(self, step: int, state: dict[str, Any], stable: set[int]) -> bool:
        """Begin the snapshot of ``step``. Tensors whose local ``data_ptr`` is in ``stable`` must stay
        unchanged until :meth:`fence`; the rest is copied now. Returns False if skipped (one still in flight).
        A rank that writes nothing runs the snapshot's thread all the same (it copies nothing)."""
        if self._thread is not None and self._thread.is_alive():
            if self.plan.when_busy == "skip":
                self.events.emit("snapshot_skipped", rank=self.plan.rank, step=step,
                                 reason="the previous snapshot is still being written")
                return False
            t0 = time.perf_counter()
            self._thread.join()
            self.events.emit("snapshot_waited", rank=self.plan.rank, step=step, seconds=time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan = self.plan
        save = plan.store.save(step, plan.rank, plan.world_size, plan.writers, state) if plan.writes else None
        values = save.values if save is not None else {}
        with torch.no_grad():
            tensors = {name: local_part(v) for name, v in values.items() if isinstance(v, torch.Tensor)}
        now = [name for name, t in tensors.items() if t.data_ptr() not in stable]
        deferred = [name for name in tensors if name not in set(now)]
        staged = {name: copy.deepcopy(v) for name, v in values.items() if name not in tensors}
        staged.update(zip(now, to_host([tensors[name] for name in now], copy=True), strict=True))
        self._staged = threading.Event()
        if not deferred:
            self._staged.set()
        self._thread = threading.Thread(
            target=self._run, args=(step, save, staged, {name: tensors[name] for name in deferred}, plan.roster(), t0),
            name=f"torchpass-snapshot-{step}", daemon=True)
        self._thread.start()
        self.events.emit("snapshot_started", rank=self.plan.rank, step=step, seconds=time.perf_counter() - t0)
        return True

    def fence(self) -> float:
        """Before the optimizer step: wait until the deferred tensors are copied; returns the wait."""
        if self._staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._staged.wait()
        return time.perf_counter() - t0

    def _run(self, step: int, save: RankSave | None, staged: dict[str, Any], deferred: dict[str, torch.Tensor],
             roster: int, t0: float) -> None:
        plan = self.plan

        def abandoned() -> str | None:
            """Once the roster changes, a rank this snapshot waits for may be gone for good."""
            return None if plan.roster() == roster else "the job's roster changed while it was being saved"

        try:
            copies = self._staging = to_host(list(deferred.values()), self._staging, copy=True)
            staged.update(zip(deferred, copies, strict=True))
            self._staged.set()
            faults.point("snapshot")
            if save is None:
                return
            nbytes, manifest = save.run(staged, plan.seed, plan.model, plan.commit_timeout, abandoned)
            self.events.emit("snapshot_written", rank=plan.rank, step=step, bytes=nbytes,
                             seconds=time.perf_counter() - t0)
            if manifest is not None:
                deleted = plan.store.retain(plan.keep)
                self.events.emit("snapshot_committed", rank=0, step=step, url=plan.store.url,
                                 bytes=sum(f["bytes"] for f in manifest.files.values()),
                                 seconds=time.perf_counter() - t0, deleted=deleted)
        except Exception as exc:  # the job goes on: a snapshot is a fallback, and the previous one stands
            log.error("torchpass: snapshot of step %d failed: %s", step, exc)
            self.events.emit("snapshot_failed", rank=plan.rank, step=step, error=f"{type(exc).__name__}: {exc}")
        finally:
            self._staged.set()

    def close(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s) for the snapshot in flight to land: at the end of training, or when
        leaving an aborted job. Returns whether nothing is in flight any more."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()
