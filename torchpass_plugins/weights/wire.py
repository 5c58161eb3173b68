"""What a publication is on the wire and in memory, and how both sides of a connection prove the token.

A publication is one contiguous byte buffer holding every tensor, sent after a header (JSON, one line)
with the version, each tensor's name, dtype, shape and offset and the byte count, and followed by a line
with the CRC-32 of the bytes (computed as they are sent, so checking costs no pass of its own). The
subscriber checks the CRC after the last byte arrives, so a version it hands out is never torn, whatever
happened to the connection or the publisher meanwhile.

A subscriber on the publisher's host gets, in the header, where to map the bytes (a memory file of the
publisher's, see :mod:`~torchpass_plugins.core.peer_memory`) instead of the bytes, and answers whether it
copied the version out, which frees the copy.

A connection starts with the publisher's challenge (a random nonce); the subscriber answers with the
HMAC-SHA256 of the nonce under the shared token and a challenge of its own, which the publisher answers
likewise. So the token never crosses the network, an answer cannot be replayed on another connection,
and a subscriber takes weights only from a publisher that holds the token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

MAGIC = "torchpass-weights/1"
TOKEN_VARIABLE = "TORCHPASS_WEIGHTS_TOKEN"
PUBLISHER = "publisher:"  # prefixes the subscriber's challenge: the publisher's answer is never a subscriber's
MAX_LINE = 1 << 20  # a request or an answer longer than this is nonsense
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(state: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> tuple[list[Entry], int]:
    """Where each tensor goes in the publication's buffer (floating ones as ``cast`` when given), and the
    buffer's size. Offsets are 64-byte aligned, so each tensor can be viewed in place at either end."""
    entries, offset = [], 0
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weights: {name!r} is not a tensor ({type(tensor).__name__}); publish tensors only")
        dtype = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
        if str(dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"weights: {name!r} is {dtype}, which cannot be published; supported: "
                             f"{', '.join(_DTYPES)}")
        nbytes = tensor.numel() * dtype.itemsize
        entries.append(Entry(name, str(dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // 64) * 64
    return entries, offset


def view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The tensor ``entry`` inside ``buffer`` (a flat uint8 tensor), without a copy."""
    return buffer[entry.offset:entry.offset + entry.nbytes].view(_DTYPES[entry.dtype]).view(entry.shape)


def header(version: int, entries: list[Entry], nbytes: int, segment: list[int] | None = None) -> bytes:
    """A version's header; with ``segment`` (a same-host subscriber), where to map the bytes instead of
    receiving them."""
    record = {"version": version, "nbytes": nbytes,
              "tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]}
    return json.dumps(record if segment is None else {**record, "segment": segment}).encode()


def parse_header(record: dict[str, Any], newer_than: int) -> tuple[int, list[Entry], int]:
    """The version, layout and size a header announces; ``ValueError`` unless it is a consistent one,
    newer than ``newer_than``."""
    try:
        version, nbytes = int(record["version"]), int(record["nbytes"])
        entries = [Entry(str(name), str(dtype), tuple(int(d) for d in shape), int(offset), int(size))
                   for name, dtype, shape, offset, size in record["tensors"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a malformed weights header: {exc}") from None
    for e in entries:
        count = 1
        for d in e.shape:
            count *= d
        if (e.dtype not in _DTYPES or e.offset < 0 or e.offset + e.nbytes > nbytes
                or e.nbytes != count * _DTYPES[e.dtype].itemsize):
            raise ValueError(f"a weights header with an inconsistent entry: {e}")
    if version <= newer_than:
        raise ValueError(f"the publisher answered version {version}, not one newer than {newer_than}")
    return version, entries, nbytes


def address(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` as a socket address."""
    parsed = urlparse(endpoint)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"a weights endpoint is tcp://HOST:PORT, not {endpoint!r}")
    return parsed.hostname, parsed.port


def token_or_env(token: str | None) -> bytes:
    token = token if token is not None else os.environ.get(TOKEN_VARIABLE)
    if not token:
        raise ValueError(f"publishing weights needs a shared token: pass token= or set {TOKEN_VARIABLE}")
    return token.encode()


def new_nonce() -> str:
    return os.urandom(16).hex()


def answer(token: bytes, nonce: str) -> str:
    return hmac.new(token, nonce.encode(), hashlib.sha256).hexdigest()


def accepted(token: bytes, nonce: str, reply: str) -> bool:
    return hmac.compare_digest(answer(token, nonce), reply)


class Lines:
    """JSON lines and raw bytes over one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = b""

    def send(self, record: dict[str, Any] | bytes) -> None:
        data = record if isinstance(record, bytes) else json.dumps(record).encode()
        self.sock.sendall(data + b"\n")

    def receive(self) -> dict[str, Any]:
        while b"\n" not in self.pending:
            if len(self.pending) > MAX_LINE:
                raise ValueError("a line longer than any the protocol has")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the connection closed")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ValueError(f"not a protocol message: {line[:100]!r}")
        return record

    def receive_into(self, buffer: memoryview) -> int:
        """Fill ``buffer`` with the next bytes (after any already read with the last line); their CRC-32,
        computed as they arrive (zlib releases the GIL over large pieces)."""
        done = min(len(self.pending), len(buffer))
        buffer[:done] = self.pending[:done]
        self.pending = self.pending[done:]
        crc = zlib.crc32(buffer[:done])
        while done < len(buffer):
            n = self.sock.recv_into(buffer[done:])
            if not n:
                raise ConnectionError(f"the connection closed after {done} of {len(buffer)} bytes")
            crc = zlib.crc32(buffer[done:done + n], crc)
            done += n
        return crc
