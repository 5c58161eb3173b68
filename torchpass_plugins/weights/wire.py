"""What a publication is on the wire and in memory, and how both sides of a connection prove the token.

A publication is one contiguous byte buffer holding every tensor, sent after a header (JSON, one line)
with the version, each tensor's name, dtype, shape and offset and the byte count, and followed by a line
with the CRC-32 of the bytes (computed as they are sent, so checking costs no pass of its own). The
subscriber checks the CRC after the last byte arrives, so a version it hands out is never torn, whatever
happened to the connection or the publisher meanwhile.

A connection starts with the publisher's challenge (a random nonce); the subscriber answers with the
HMAC-SHA256 of the nonce under the shared token, so the token never crosses the network and an answer
cannot be replayed on another connection.
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
        dtype = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * dtype.itemsize
        entries.append(Entry(name, str(dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // 64) * 64
    return entries, offset


def view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The tensor ``entry`` inside ``buffer`` (a flat uint8 tensor), without a copy."""
    return buffer[entry.offset:entry.offset + entry.nbytes].view(_DTYPES[entry.dtype]).view(entry.shape)


def header(version: int, entries: list[Entry], nbytes: int) -> bytes:
    return json.dumps({"version": version, "nbytes": nbytes,
                       "tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]}).encode()


def parse_header(record: dict[str, Any]) -> tuple[int, list[Entry], int]:
    entries = [Entry(name, dtype, tuple(shape), offset, nbytes)
               for name, dtype, shape, offset, nbytes in record["tensors"]]
    return record["version"], entries, record["nbytes"]


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
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the connection closed")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

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
