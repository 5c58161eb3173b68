"""Job-wide snapshots on any fsspec URL, written in torch Distributed Checkpoint (DCP) format.

Each ``step-{step:09d}/`` is a DCP checkpoint (``.metadata`` and the writing ranks' ``__{r}_*.distcp``),
so a job resumes from it at another world size (DCP reshards as it loads) and DCP's tools read it. The
writers save from background threads, where no collective of the training's process group may run, so
what DCP would gather through a process group (each rank's save plan and what it wrote) goes through the
snapshot's own storage instead (``.torchpass/`` beside the checkpoint, :class:`RankSave`).
``manifest.json``, written by rank 0 last, commits the snapshot: it lists every file with its size and
SHA-256. Readers look only at committed snapshots, so a write torn by a crash, a full disk or a lost rank
is simply not there (and is reported); files are verified against the manifest before anything is loaded.
DCP's metadata is a pickle, as in every DCP checkpoint: keep the snapshot storage as trusted as the code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pickle
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from torchpass_plugins._compat.torch_distributed import fsspec_reader, fsspec_writer

log = logging.getLogger(__name__)

FORMAT = 2
_STEP_DIR = re.compile(r"step-(\d{9})$")
_EXCHANGE = ".torchpass"


def model_fingerprint(module: torch.nn.Module) -> str:
    """What identifies a job's model across restarts: the names, shapes and dtypes of its state (not values)."""
    layout = [(name, list(t.shape), str(t.dtype)) for name, t in sorted(module.state_dict().items())]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


class SnapshotAbandoned(RuntimeError):
    """A snapshot that cannot complete any more (a rank taking part in it was lost): the previous one stands."""


class SnapshotCorrupted(RuntimeError):
    """A committed snapshot whose files do not match their manifest (flipped bytes, truncation, loss)."""


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    seed: int
    files: dict[str, dict[str, Any]]  # name -> {"bytes", "sha256"}
    created: float
    model: str = ""  # :func:`model_fingerprint` of the job that wrote it

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **self.__dict__}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown snapshot format {d.get('format')!r}")
        return cls(int(d["step"]), int(d["world_size"]), int(d["seed"]), dict(d["files"]), float(d["created"]),
                   str(d.get("model", "")))


class _StagedPlanner(dcp.DefaultSavePlanner):
    """Plans from the live state (its layout) and writes the host copies staged from it, looked up by name
    (:meth:`DefaultSavePlanner.lookup_object` is DCP's extension point for this): a rank holds one chunk of
    each sharded tensor, whose staged copy is that chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: dict[str, Any] = {}

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.staged[index.fqn]


class _WeightsOnly(dcp.DefaultLoadPlanner):
    """Reads the non-tensor values with ``weights_only=True`` (no arbitrary pickle from the snapshot's
    files); :meth:`SnapshotStore.read` puts them in place."""

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def stored_entries(metadata: Metadata, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype] | None]:
    """The entries of a DCP checkpoint (its ``metadata``) under ``prefix``, by the rest of their name: a
    tensor's size and dtype, None for another value."""
    return {name[len(prefix):]: (entry.size, entry.properties.dtype) if isinstance(entry, TensorStorageMetadata)
            else None for name, entry in metadata.state_dict_metadata.items() if name.startswith(prefix)}


def _put(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


class _Exchange:
    """What the writing ranks of one save tell rank 0, as files in the snapshot's ``.torchpass/``. Waiting
    for a post ends at the deadline, or as soon as ``abandoned()`` gives a reason (a rank it waits for was
    lost)."""

    def __init__(self, fs: Any, directory: str) -> None:
        self.fs, self.directory = fs, f"{directory}/{_EXCHANGE}"

    def post(self, name: str, value: Any) -> None:
        self.fs.makedirs(self.directory, exist_ok=True)
        self.fs.pipe_file(f"{self.directory}/{name}", pickle.dumps(value))

    def take(self, name: str, deadline: float, abandoned: Callable[[], str | None]) -> Any:
        """The value posted as ``name``, once it is there whole (a local file can be seen half-written)."""
        path = f"{self.directory}/{name}"
        while True:
            try:
                return pickle.loads(self.fs.cat_file(path))
            except (FileNotFoundError, EOFError, pickle.UnpicklingError):
                if (reason := abandoned()) is not None:
                    raise SnapshotAbandoned(reason) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"snapshot: rank {name} did not write its part in time") from None
                time.sleep(0.01)
                self.fs.invalidate_cache(self.directory)


def _own(rank: int, name: str) -> bool:
    return name == f"rank{rank}" or name.startswith(f"rank{rank}.")


class RankSave:
    """One writing rank's part of one snapshot. Made at the step boundary from the live state (its layout
    only: nothing is copied); :meth:`run` writes the staged copies of :attr:`values`, in the background.

    The first writer (rank 0) writes every value the ranks hold alike; every other writer only its chunks of
    the sharded tensors and the values under its own ``rank{r}`` key. Each writes on its own and posts what
    it wrote; rank 0 then builds DCP's metadata from every writer's plan and commits. So no rank but rank 0
    ever waits for another, as in DCP's saves without collectives, but into one checkpoint.
    """

    def __init__(self, store: SnapshotStore, step: int, rank: int, world_size: int, writers: list[int],
                 state: dict[str, Any]) -> None:
        self.store, self.step, self.rank, self.world_size, self.writers = store, step, rank, world_size, writers
        self.directory = store.step_dir(step)
        self.url = f"{store.url.rstrip('/')}/step-{step:09d}"
        self.writer = fsspec_writer(self.url, store.storage_options)
        self.planner = _StagedPlanner()
        self.planner.set_up_planner(state_dict=state, storage_meta=self.writer.storage_meta(),
                                    is_coordinator=rank == writers[0])
        plan = self.planner.create_local_plan()
        if rank != writers[0]:
            plan = dataclasses.replace(plan, items=[
                item for item in plan.items
                if isinstance(self.planner.state_dict[item.index.fqn], DTensor) or _own(rank, item.index.fqn)])
        self.local_plan = plan

    @property
    def values(self) -> dict[str, Any]:
        """What this rank writes, by checkpoint name (DCP's flattened keys)."""
        names = {item.index.fqn for item in self.local_plan.items}
        return {name: value for name, value in self.planner.state_dict.items() if name in names}

    def run(self, staged: dict[str, Any], seed: int, model: str, timeout: float,
            abandoned: Callable[[], str | None] = lambda: None) -> tuple[int, Manifest | None]:
        """Write this rank's part from ``staged`` (:attr:`values` copied); the first writer then commits.
        Returns the bytes this rank wrote and, on the first writer, the manifest. The first writer raises
        :class:`SnapshotAbandoned` once ``abandoned()`` gives a reason while it waits for another writer."""
        self.planner.staged = staged
        # Without collectives, DCP's writer names this rank's files apart from the others' (``__{rank}_*``).
        self.writer.set_up_storage_writer(self.rank == self.writers[0], rank=self.rank, use_collectives=False)
        plan = self.writer.prepare_local_plan(self.local_plan)
        results = self.writer.write_data(self.planner.finish_plan(plan), self.planner).value()
        files = {name: self.store.record(f"{self.directory}/{name}")
                 for name in sorted({r.storage_data.relative_path for r in results})}
        nbytes = sum(f["bytes"] for f in files.values())
        exchange = _Exchange(self.store.fs, self.directory)
        if self.rank != self.writers[0]:
            exchange.post(f"{self.rank}", (plan, results, files))
            return nbytes, None
        deadline = time.monotonic() + timeout
        parts = [(plan, results, files)] + [exchange.take(f"{r}", deadline, abandoned) for r in self.writers[1:]]
        _, metadata = self.planner.create_global_plan([theirs for theirs, _, _ in parts])
        finisher = fsspec_writer(self.url, self.store.storage_options)
        finisher.set_up_storage_writer(True, rank=self.rank, use_collectives=True)  # one .metadata for all
        finisher.finish(metadata, [theirs for _, theirs, _ in parts])
        files = {name: record for _, _, theirs in parts for name, record in theirs.items()}
        files[".metadata"] = self.store.record(f"{self.directory}/.metadata")
        manifest = Manifest(self.step, self.world_size, seed, files, time.time(), model)
        self.store.fs.pipe_file(f"{self.directory}/manifest.json", manifest.to_json().encode())
        return nbytes, manifest


class SnapshotStore:
    """Reads and writes the snapshots under one fsspec URL (local path, ``memory://``, ``s3://``, ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = storage_options or {}
        self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_options)

    def step_dir(self, step: int) -> str:
        return f"{self.root}/step-{step:09d}"

    def record(self, path: str) -> dict[str, Any]:
        """A written file's size and SHA-256, read back from the storage."""
        data = self.fs.cat_file(path)
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    # -- writing ------------------------------------------------------------------------------------------
    def save(self, step: int, rank: int, world_size: int, writers: list[int], state: dict[str, Any]) -> RankSave:
        """Begin this writing rank's part of the snapshot of ``step`` of a job of ``world_size`` ranks."""
        return RankSave(self, step, rank, world_size, writers, state)

    def discard_torn(self) -> list[int]:
        """Before a job takes its first snapshot: delete every snapshot that was never committed (left by an
        earlier attempt or job, whose parts would otherwise be taken for this one's); returns their steps."""
        torn = self.torn()
        for step in torn:
            self.fs.rm(self.step_dir(step), recursive=True)
        return torn

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed snapshots, and any torn one older than the newest
        committed; returns the steps deleted."""
        manifests, torn = self.scan()
        committed = [m.step for m in manifests]
        newest = committed[-1] if committed else None
        doomed = committed[:-keep] if keep > 0 else []
        doomed += [s for s in torn if newest is not None and s < newest]
        for step in doomed:
            self.fs.rm(self.step_dir(step), recursive=True)
        return sorted(doomed)

    # -- reading ------------------------------------------------------------------------------------------
    def _steps(self) -> list[int]:
        if not self.fs.exists(self.root):
            return []
        self.fs.invalidate_cache(self.root)
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, names) if m)

    def manifest(self, step: int) -> Manifest | None:
        path = f"{self.step_dir(step)}/manifest.json"
        try:
            return Manifest.from_json(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("torchpass: snapshot of step %d has an unreadable manifest (%s): ignored", step, exc)
            return None

    def scan(self) -> tuple[list[Manifest], list[int]]:
        """One listing: the committed snapshots (oldest first), and the steps with files but no manifest
        (writes that never completed, or are in flight now)."""
        committed: list[Manifest] = []
        torn: list[int] = []
        for step in self._steps():
            manifest = self.manifest(step)
            if manifest is None:
                torn.append(step)
            else:
                committed.append(manifest)
        return committed, torn

    def committed(self) -> list[Manifest]:
        return self.scan()[0]

    def torn(self) -> list[int]:
        return self.scan()[1]

    def verify(self, manifest: Manifest, rank: int = 0, world_size: int = 1) -> None:
        """Check this rank's share of a committed snapshot's files (every ``world_size``-th, so that the
        ranks of a job read each file once between them) against the manifest; raises
        :class:`SnapshotCorrupted`."""
        where = f"{self.url.rstrip('/')}/step-{manifest.step:09d}"
        for i, (name, expected) in enumerate(sorted(manifest.files.items())):
            if i % world_size != rank:
                continue
            try:
                found = self.record(f"{self.step_dir(manifest.step)}/{name}")
            except FileNotFoundError as exc:
                raise SnapshotCorrupted(f"{where}/{name}: missing") from exc
            if found["bytes"] != expected["bytes"]:
                raise SnapshotCorrupted(
                    f"{where}/{name}: {found['bytes']} bytes, the manifest says {expected['bytes']} (truncated?)")
            if found["sha256"] != expected["sha256"]:
                raise SnapshotCorrupted(f"{where}/{name}: checksum mismatch (the file was altered or damaged)")

    def read(self, manifest: Manifest, state: dict[str, Any], missing_ok: bool = False) -> None:
        """Load the values named in ``state`` (DCP loads in place: tensors are copied into, in the layout
        they have here, resharded if the writing job had another; other values are replaced). A name the
        snapshot does not have is an error, unless ``missing_ok`` (its value is then left as it is)."""
        planner = _WeightsOnly(allow_partial_load=missing_ok)
        where = f"{self.url.rstrip('/')}/step-{manifest.step:09d}"
        try:
            dcp.load(state, storage_reader=fsspec_reader(where, self.storage_options), planner=planner, no_dist=True)
        except CheckpointException as exc:  # a BaseException: say what failed, as an error
            cause = next(iter(exc.failures.values()))[0]
            raise SnapshotCorrupted(f"{where} cannot be loaded: {type(cause).__name__}: {cause}") from cause
        for name, value in planner.state_dict.items():
            if not isinstance(value, torch.Tensor):
                _put(state, planner.mappings[name], value)

    def stored(self, manifest: Manifest, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype] | None]:
        """The entries a snapshot holds under ``prefix`` (a part's path, e.g. ``"optim.state."``), by the rest
        of their name: a tensor's size and dtype, None for another value (what to prepare to load them into)."""
        where = f"{self.url.rstrip('/')}/step-{manifest.step:09d}"
        try:
            metadata = fsspec_reader(where, self.storage_options).read_metadata()
        except Exception as exc:  # whatever unpickling a damaged file raises
            raise SnapshotCorrupted(f"{where}/.metadata cannot be read: {type(exc).__name__}: {exc}") from exc
        return stored_entries(metadata, prefix)

    def load_newest(self, rank: int = 0, world_size: int = 1, steps: list[int] | None = None,
                    agree: Callable[[bool], bool] = bool) -> tuple[Manifest, list[str]] | None:
        """The newest committed snapshot whose files verify, with the reasons newer ones were refused (each
        also logged); None when there is none.

        A job searches together: every rank walks the same ``steps`` (the committed steps one rank listed),
        verifies its share of each snapshot's files, and ``agree`` turns this rank's verdict into the job's
        (every share verifies), so that all ranks resume from the same step.
        """
        refused: list[str] = []
        for step in reversed(steps if steps is not None else [m.step for m in self.committed()]):
            error = None
            manifest = self.manifest(step)
            try:
                if manifest is None:
                    raise SnapshotCorrupted(f"{self.url.rstrip('/')}/step-{step:09d}: its manifest is gone")
                self.verify(manifest, rank, world_size)
            except SnapshotCorrupted as exc:
                log.error("torchpass: %s; falling back to the previous snapshot", exc)
                error = str(exc)
            if agree(error is None):
                return manifest, refused
            refused.append(error or f"step {step}: another rank's share of the files failed verification")
        return None
