"""A Lightning job's training state as named parts (:mod:`torchpass_plugins.core.training_state`), and how a
rank adopts one, from a peer or from a snapshot.

Besides the model and the optimizers, the ``trainer`` part is the rest of Lightning's checkpoint (loop
progress, schedulers, callbacks, precision) and ``own`` the rank's logged values and metric states.

A rank adopts a state while Lightning restores it (:class:`Incoming`): the trainer part as a checkpoint
``fit`` restores at its start, the model and the optimizers when Lightning restores them (the optimizers
exist only after the strategy's setup).

A snapshot holds the parts as one torch Distributed Checkpoint (:mod:`torchpass_plugins.storage.snapshot_store`):
``model`` and ``optim`` sharded as the job holds them (so a job of another size loads them resharded),
``trainer`` as one value, and ``rank{r}`` for the state only rank ``r`` holds, where the strategy keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchpass_plugins._compat.lightning import (
    dump_checkpoint,
    load_rank_local_state,
    precision_checkpoint_key,
    rank_local_state,
)
from torchpass_plugins.core.training_state import MODEL, OPTIMIZER, OWN, TRAINER, Stateful, load_stored
from torchpass_plugins.storage.snapshot_parts import unpack
from torchpass_plugins.storage.snapshot_store import Manifest, SnapshotCorrupted, SnapshotStore

if TYPE_CHECKING:
    from torchpass_plugins.integrations.lightning.ddp import TorchPassDDPStrategy


class TrainerState:
    """Lightning's checkpoint without the model and the optimizers, as of a step boundary: ``at_boundary()``
    gives what has moved on since (the fit loop's progress; where a rollback needs them the schedulers and
    the precision plugin's state). Loaded, Lightning restores it as ``fit`` starts."""

    def __init__(self, strategy: TorchPassDDPStrategy, at_boundary: Callable[[], dict[str, Any]]) -> None:
        self.strategy, self.at_boundary = strategy, at_boundary

    def state_dict(self) -> dict[str, Any]:
        with self.strategy.without_model_and_optimizers():
            checkpoint = dump_checkpoint(self.strategy.lightning_module.trainer)
        for part in ("state_dict", "optimizer_states"):
            checkpoint.pop(part, None)
        boundary = self.at_boundary()
        if boundary.get("loops") is not None:
            checkpoint["loops"]["fit_loop"] = boundary["loops"]
        if "schedulers" in boundary:
            checkpoint["lr_schedulers"] = boundary["schedulers"]
        if boundary.get("precision"):
            checkpoint[precision_checkpoint_key(self.strategy.lightning_module.trainer)] = boundary["precision"]
        return checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.adapter.restore_trainer(state)


class LoggedState:
    """A rank's logged values, metric states and ``callback_metrics`` (its ``own`` part under DDP)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return rank_local_state(self.trainer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_rank_local_state(self.trainer, state)


class Incoming:
    """A state this rank adopts: ``trainer`` and ``own`` values now, the model and the optimizers loaded into
    ``parts`` as Lightning restores them. ``complete``: it holds every parameter and buffer (a snapshot),
    not only what a peer hands over."""

    complete = False
    trainer: dict[str, Any]
    own: Any = None

    def load_model(self, parts: dict[str, Stateful]) -> None:
        raise NotImplementedError

    def load_optimizers(self, parts: dict[str, Stateful]) -> None:
        raise NotImplementedError


class FromPeer(Incoming):
    """The values of the parts a peer sent (a donor, and under torchpass_fsdp the ring successor)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values, self.trainer, self.own = values, values[TRAINER], values.get(OWN)

    def load_model(self, parts: dict[str, Stateful]) -> None:
        parts[MODEL].load_state_dict(self.values[MODEL])

    def load_optimizers(self, parts: dict[str, Stateful]) -> None:
        if OPTIMIZER in self.values:
            parts[OPTIMIZER].load_state_dict(self.values[OPTIMIZER])


class ResumedSnapshot(Incoming):
    """A verified snapshot this rank resumes from, read into the layout this job has."""

    complete = True

    def __init__(self, store: SnapshotStore, manifest: Manifest, rank: int) -> None:
        self.store, self.manifest = store, manifest
        own = f"rank{rank}"
        parts: dict[str, Any] = {TRAINER: b"", own: b""}
        store.read(manifest, parts, missing_ok=True)  # no own state: a rank the writing job did not have
        if not parts[TRAINER]:
            raise SnapshotCorrupted(f"{store.url}: the snapshot of step {manifest.step} has no trainer state")
        self.trainer = unpack(parts[TRAINER])
        self.own = unpack(parts[own]) if parts[own] else None

    def load_model(self, parts: dict[str, Stateful]) -> None:
        self._load({MODEL: parts[MODEL]})

    def load_optimizers(self, parts: dict[str, Stateful]) -> None:
        if OPTIMIZER in parts:
            self._load({OPTIMIZER: parts[OPTIMIZER]})

    def _load(self, parts: dict[str, Stateful]) -> None:
        load_stored(parts, lambda prefix: self.store.stored(self.manifest, prefix),
                    lambda into: self.store.read(self.manifest, into))
