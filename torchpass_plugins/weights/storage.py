"""Versions in storage (a path or fsspec URL): the last resort of a subscriber that cannot reach the
publisher, because the job is restarting or no process serves logical rank 0 yet, or because the subscriber
only reaches the storage.

The publisher writes the newest version in the background, as often as the storage takes one (a version
published meanwhile is passed over for the next newest). A version is one file in the form it has on the
wire (the header line, the bytes, the CRC-32 line), written whole before ``LATEST`` names it; the version
this process wrote before it is kept (a subscriber may be reading it), every other one is deleted (also
newer numbers, which a job restarted from an older snapshot goes past again). A subscriber reads the
version ``LATEST`` names and checks its CRC, so a file cut off or changed is never handed out.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import fsspec
import torch

from torchpass_plugins.weights import wire

LATEST = "LATEST"


def version_file(version: int) -> str:
    return f"v{version:012d}.weights"


class VersionStore:
    """Versions under ``url`` (a local path or any fsspec URL, with ``storage_options``)."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs.makedirs(self.root, exist_ok=True)
        self._written: list[str] = []  # by this process, oldest first

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def write(self, version: int, entries: list[wire.Entry], buffer: torch.Tensor, crc: int) -> None:
        with self.fs.open(self._path(version_file(version)), "wb") as f:
            f.write(wire.header(version, entries, buffer.numel()) + b"\n")
            f.write(memoryview(buffer.numpy()))
            f.write(json.dumps({"crc32": crc}).encode() + b"\n")
        staged = self._path(f".{LATEST}.{version}")
        self.fs.pipe_file(staged, json.dumps({"version": version, "file": version_file(version)}).encode())
        self.fs.mv(staged, self._path(LATEST))  # (a rename where the storage has one: LATEST is never torn)
        self._written = [*self._written, version_file(version)][-2:]
        for path in self.fs.ls(self.root, detail=False):
            name = path.rsplit("/", 1)[-1]
            if name.startswith("v") and name.endswith(".weights") and name not in self._written:
                self.fs.rm(self._path(name))

    def read_newer(self, have: int) -> tuple[int, dict[str, torch.Tensor], int] | None:
        """The version ``LATEST`` names, if newer than ``have`` and whole: (version, state, bytes); else None
        (nothing there yet, or a version being replaced as it was read: the caller asks again later)."""
        try:
            latest = json.loads(self.fs.cat_file(self._path(LATEST)))
            if int(latest["version"]) <= have:
                return None
            data = self.fs.cat_file(self._path(str(latest["file"])))
            line, rest = data.split(b"\n", 1)
            version, entries, nbytes = wire.parse_header(json.loads(line), newer_than=have)
            payload, tail = rest[:nbytes], rest[nbytes:]
            if len(payload) != nbytes or json.loads(tail)["crc32"] != zlib.crc32(payload):
                return None
        except (OSError, ValueError, KeyError, TypeError):  # (storage unreachable too: asked again later)
            return None
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return version, {e.name: wire.view(buffer, e) for e in entries}, nbytes


def keep_storing(publisher: Any, store: VersionStore) -> None:
    """``publisher``'s thread: write its newest version to ``store`` whenever there is a newer one than the
    last written, until it closes. A failed write is logged; serving goes on, and the next version tries."""
    written = -1
    while (copy := publisher.hold_newest(written, wait=None)) is not None:
        try:
            if copy.crc is None:
                copy.crc = zlib.crc32(memoryview(copy.buffer.numpy()))
            store.write(copy.version, copy.entries, copy.buffer, copy.crc)
            publisher.events.emit("weights_stored", version=copy.version, url=store.url)
        except Exception as exc:
            publisher.events.emit("weights_store_failed", version=copy.version, error=str(exc)[:500])
        finally:
            written = copy.version
            publisher.stored(copy)
