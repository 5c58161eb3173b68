"""What a snapshot holds of a job's named parts (:mod:`torchpass_plugins.core.training_state`), and the resume
every integration shares: which snapshot a job resumes from, and how it says so.

``model`` and ``optim`` are written as tensors DCP shards and reshards; ``trainer`` (the rest of the loop's
state) as one serialized value, and ``own`` under ``rank{r}`` (what only rank ``r`` holds).
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from typing import Any

import torch

from torchpass_plugins.core.training_state import OWN, TRAINER, Stateful, capture
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.storage.snapshot_store import Manifest, SnapshotStore


def pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def snapshot_values(parts: dict[str, Stateful], rank: int) -> dict[str, Any]:
    """What a rank's snapshot holds of ``parts``: the model and optimizers as tensors DCP writes (sharded where
    they are), the trainer and own parts as one value each (the own one under this rank's name)."""
    values = capture(parts, leave_out=(TRAINER, OWN))
    values[TRAINER] = pack(parts[TRAINER].state_dict())
    if OWN in parts:
        values[f"rank{rank}"] = pack(parts[OWN].state_dict())
    return values


def refuse_another_jobs(manifest: Manifest, url: str, model: str) -> None:
    """Resuming from another job's snapshot would train the wrong state, and this job's retention would then
    delete that job's snapshots: stop with the reason instead. (Another number of ranks is no reason: the
    state is resharded as it loads.)"""
    if manifest.model and manifest.model != model:
        raise ConfigError(
            f"torchpass: the newest snapshot in {url} (step {manifest.step}) was written by another job "
            "(a model whose parameters have other names, shapes or dtypes). Give this job its own snapshot "
            "directory (snapshots.dir / snapshot_dir); nothing there was read or deleted"
        )


def newest_to_resume(store: SnapshotStore, rank: int, world_size: int, model: str, starting: bool,
                     broadcast: Callable[[Any], Any], agree: Callable[[bool], bool]
                     ) -> tuple[Manifest, list[str], list[int] | None] | None:
    """The snapshot every rank of the job resumes from (with the reasons newer ones were refused, and the
    half-written ones deleted), or None. ``starting``: the job's start, not a spare entering it; rank 0 then
    deletes what an earlier attempt left half-written (before any rank of this job writes).
    ``broadcast(value)``: rank 0's value on every rank; ``agree(ok)``: True where every rank's ``ok`` is."""
    torn = store.discard_torn() if starting and rank == 0 else None
    steps, torn = broadcast(([m.step for m in store.committed()], torn) if rank == 0 else None)
    newest = store.manifest(steps[-1]) if steps else None
    if newest is not None:
        refuse_another_jobs(newest, store.url, model)
    found = store.load_newest(rank, world_size, steps, agree)
    return None if found is None else (*found, torn)


def say_resumed(events: EventLog, store: SnapshotStore, manifest: Manifest, rank: int, world_size: int,
                refused: list[str], torn: list[int] | None, reached: int | None) -> None:
    """The ``snapshot_resumed`` event of each rank, and rank 0's line; ``reached``: the step the aborted
    attempt had reached, if known."""
    step = manifest.step
    lost = None if reached is None else max(0, reached - step)
    events.emit("snapshot_resumed", rank=rank, step=step, url=store.url, refused=refused, torn=torn,
                steps_lost=lost, written_by=manifest.world_size)
    if rank == 0:
        resharded = (f" (written by {manifest.world_size} ranks, loaded into {world_size})"
                     if manifest.world_size != world_size else "")
        print(f"torchpass: resuming from the snapshot of step {step} in {store.url}{resharded}"
              + (f"; the aborted attempt had reached step {reached}: {lost} step(s) lost" if lost is not None
                 else "")
              + (f" ({len(refused)} newer one(s) refused as corrupted)" if refused else ""),
              file=sys.stderr, flush=True)
