"""Job-wide snapshots on any fsspec URL: per-rank files, a manifest written last, checksums verified on load.

Layout under the root URL: ``step-{step:09d}/rank{r}.pt`` (a ``torch.save`` stream, loaded with
``weights_only=True``: no arbitrary pickle runs on load), ``rank{r}.json`` (that file's size and SHA-256,
written once the file has landed) and ``manifest.json``, written by rank 0 only after every writing rank's
``rank{r}.json`` exists. A snapshot is *committed* iff its manifest parses; readers never look at anything
else, so a write torn by a crash, a full disk or a lost rank is simply not there (and is reported).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

log = logging.getLogger(__name__)

FORMAT = 1
_STEP_DIR = re.compile(r"step-(\d{9})$")


def model_fingerprint(module: torch.nn.Module) -> str:
    """What identifies a job's model across restarts: the names, shapes and dtypes of its state (not values)."""
    layout = [(name, list(t.shape), str(t.dtype)) for name, t in sorted(module.state_dict().items())]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


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


class _HashingWriter:
    """File-like wrapper that hashes and counts what ``torch.save`` streams through it."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.sha, self.nbytes = raw, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.nbytes += len(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


class SnapshotStore:
    """Reads and writes the snapshots under one fsspec URL (local path, ``memory://``, ``s3://``, ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))

    def step_dir(self, step: int) -> str:
        return f"{self.root}/step-{step:09d}"

    # -- writing ------------------------------------------------------------------------------------------
    def write_rank(self, step: int, rank: int, state: Any) -> dict[str, Any]:
        """Stream ``state`` to ``rank{rank}.pt``, then record its size and checksum beside it."""
        directory = self.step_dir(step)
        self.fs.makedirs(directory, exist_ok=True)
        with self.fs.open(f"{directory}/rank{rank}.pt", "wb") as raw:
            out = _HashingWriter(raw)
            torch.save(state, out)
        entry = {"bytes": out.nbytes, "sha256": out.sha.hexdigest()}
        self.fs.pipe_file(f"{directory}/rank{rank}.json", json.dumps(entry).encode())
        return entry

    def commit(self, step: int, writers: list[int], world_size: int, seed: int, timeout: float,
               model: str = "") -> Manifest:
        """Rank 0: wait until every writing rank's file has landed, then write the manifest (the commit)."""
        directory = self.step_dir(step)
        deadline = time.monotonic() + timeout
        files: dict[str, dict[str, Any]] = {}
        for rank in writers:
            record = f"{directory}/rank{rank}.json"
            while not self.fs.exists(record):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"snapshot of step {step}: rank {rank}'s file did not land in {timeout:.0f} s")
                time.sleep(0.05)
                self.fs.invalidate_cache(directory)
            files[f"rank{rank}.pt"] = json.loads(self.fs.cat_file(record))
        manifest = Manifest(step, world_size, seed, files, time.time(), model)
        self.fs.pipe_file(f"{directory}/manifest.json", manifest.to_json().encode())
        return manifest

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

    def load_rank(self, manifest: Manifest, rank: int) -> Any:
        """Read and verify ``rank{rank}.pt`` of a committed snapshot; raises :class:`SnapshotCorrupted`."""
        name = f"rank{rank}.pt"
        where = f"{self.url.rstrip('/')}/step-{manifest.step:09d}/{name}"
        expected = manifest.files.get(name)
        if expected is None:
            raise SnapshotCorrupted(f"{where}: not listed in its manifest")
        try:
            data = self.fs.cat_file(f"{self.step_dir(manifest.step)}/{name}")
        except FileNotFoundError as exc:
            raise SnapshotCorrupted(f"{where}: missing") from exc
        if len(data) != expected["bytes"]:
            raise SnapshotCorrupted(f"{where}: {len(data)} bytes, the manifest says {expected['bytes']} (truncated?)")
        if hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise SnapshotCorrupted(f"{where}: checksum mismatch (the file was altered or damaged)")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def load_newest(
        self, rank: int, steps: list[int] | None = None, agree: Callable[[bool], bool] = bool
    ) -> tuple[Manifest, Any, list[str]] | None:
        """The newest committed snapshot whose ``rank{rank}.pt`` verifies, with that state and the reasons
        newer ones were refused (each also logged); None when there is none.

        A job searches together: every rank walks the same ``steps`` (the committed steps one rank listed)
        and ``agree`` turns this rank's verdict on a step into the job's (all ranks' files verify), so
        that all ranks resume from the same step even when only one rank's file is damaged.
        """
        refused: list[str] = []
        for step in reversed(steps if steps is not None else [m.step for m in self.committed()]):
            state, error = None, None
            manifest = self.manifest(step)
            try:
                if manifest is None:
                    raise SnapshotCorrupted(f"{self.url.rstrip('/')}/step-{step:09d}: its manifest is gone")
                state = self.load_rank(manifest, rank)
            except SnapshotCorrupted as exc:
                log.error("torchpass: %s; falling back to the previous snapshot", exc)
                error = str(exc)
            if agree(error is None):
                return manifest, state, refused
            refused.append(error or f"step {step}: another rank's file failed verification")
        return None
