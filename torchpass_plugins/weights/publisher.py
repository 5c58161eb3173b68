"""``WeightPublisher``: versions of a model's weights, served to any number of subscribers over TCP.

The training thread pays for one thing only, the copy of the weights into host memory (``publish``). A
background thread checksums the copy and makes it the newest version; each subscriber's connection is
served by a thread of its own, from the copy that was newest when it asked. Copies are never written while
a subscriber reads them: there are a few of them, and a publication that finds every one either newest or
being read is skipped (logged), so a subscriber that reads slowly costs the trainer nothing and gets the
newest version when it asks again. A subscriber that disconnects at any point only frees its copy.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing import faults
from torchpass_plugins.weights import wire

log = logging.getLogger(__name__)


@dataclass
class _Copy:
    buffer: torch.Tensor
    entries: list[wire.Entry]
    version: int = -1
    crc: int = 0
    readers: int = 0  # subscribers being sent this copy
    busy: bool = True  # being staged or checksummed: not yet a version anyone may read
    stall_s: float = 0.0  # what staging it cost the caller of ``publish``


@dataclass
class Publication:
    """What one ``publish`` call did: the version, or ``skipped``; the seconds the training thread spent."""

    version: int
    nbytes: int
    stall_s: float
    skipped: bool = False


@dataclass
class _Served:
    connections: int = 0
    sent: dict[int, int] = field(default_factory=dict)  # version -> complete sends


class WeightPublisher:
    """Publishes versions of a state dict at ``endpoint`` (``tcp://HOST:PORT``; port 0: any free one, see
    :attr:`endpoint`). Subscribers prove ``token`` (or ``TORCHPASS_WEIGHTS_TOKEN``); ``dtype`` casts
    floating tensors as they are copied (``torch.bfloat16`` halves the bytes). ``copies`` bounds the host
    memory: one copy per version being staged, newest or being read."""

    def __init__(self, endpoint: str, token: str | None = None, dtype: torch.dtype | None = None, copies: int = 3,
                 events: EventLog | None = None) -> None:
        if copies < 2:
            raise ValueError("a publisher needs at least 2 copies: the newest and one to stage the next into")
        self._token = wire.token_or_env(token)
        self._dtype = dtype
        self._copies: list[_Copy] = []
        self._max_copies = copies
        self._newest: _Copy | None = None
        self._changed = threading.Condition()
        self._finishing: queue.Queue[_Copy | None] = queue.Queue()
        self._closed = False
        self._last_version = -1
        self.events = events or EventLog(None)
        self.served = _Served()
        self._address = wire.address(endpoint)
        self._listener: socket.socket | None = None
        try:
            self._listener = socket.create_server(self._address, backlog=64)
        except OSError:
            if self._address[1] == 0:
                raise
            # The port is still held, by the process this one takes over from (a planned migration): the
            # accept thread binds it as soon as that process lets go; publications are kept meanwhile.
        port = self._listener.getsockname()[1] if self._listener is not None else self._address[1]
        self.endpoint = f"tcp://{self._address[0]}:{port}"
        self._threads = [threading.Thread(target=self._finish_loop, name="weights-finish", daemon=True),
                         threading.Thread(target=self._accept_loop, name="weights-accept", daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- the training thread --------------------------------------------------------------------------
    def publish(self, state: dict[str, torch.Tensor] | torch.nn.Module, version: int,
                wait: bool = False) -> Publication:
        """Copy ``state`` (a state dict or a module's) into host memory as ``version``, which must be newer
        than the last one; it is served once its checksum is computed, in the background. When every copy
        is newest, being read or still being checksummed, the version is skipped, unless ``wait`` (for the
        last version of a run): then it waits for a copy to be free."""
        started = time.perf_counter()
        if version <= self._last_version:
            raise ValueError(f"weights version {version} is not newer than the last published, {self._last_version}")
        self._last_version = version
        if isinstance(state, torch.nn.Module):
            state = state.state_dict()
        target = self._free_copy(state, wait)
        if target is None:
            self.events.emit("weights_skipped", version=version, reason="every copy is newest or being read")
            return Publication(version, 0, time.perf_counter() - started, skipped=True)
        with torch.no_grad():
            for entry, tensor in zip(target.entries, state.values(), strict=True):
                wire.view(target.buffer, entry).copy_(tensor.detach())
        target.version, target.stall_s = version, time.perf_counter() - started
        self._finishing.put(target)
        return Publication(version, target.buffer.numel(), target.stall_s)

    def _free_copy(self, state: dict[str, torch.Tensor], wait: bool) -> _Copy | None:
        """A copy no one reads or will read (a new one while there are fewer than ``copies``), marked busy."""
        entries, nbytes = wire.layout(state, self._dtype)
        with self._changed:
            while True:
                for copy in self._copies:
                    if copy is not self._newest and copy.readers == 0 and not copy.busy:
                        if copy.entries == entries:
                            copy.busy = True
                            return copy
                        self._copies.remove(copy)  # the model's layout changed: this copy is of no use
                        break
                if len(self._copies) < self._max_copies:
                    pinned = torch.cuda.is_available()
                    copy = _Copy(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), entries)
                    self._copies.append(copy)
                    return copy
                if not wait or self._closed:
                    return None
                self._changed.wait()

    # -- background ------------------------------------------------------------------------------------
    def _finish_loop(self) -> None:
        while (copy := self._finishing.get()) is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # (copies from the GPU are complete before they are read)
            copy.crc = wire.checksum(copy.buffer)
            with self._changed:
                copy.busy = False
                self._newest = copy
                self._changed.notify_all()
            self.events.emit("weights_published", version=copy.version, bytes=copy.buffer.numel(),
                             stall_s=copy.stall_s)

    def _accept_loop(self) -> None:
        while self._listener is None and not self._closed:
            try:
                self._listener = socket.create_server(self._address, backlog=64)
            except OSError:
                time.sleep(0.2)
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), name="weights-serve", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """One subscriber: authenticate, then answer each request with the newest version newer than the one
        it has (waiting up to its ``wait`` seconds for one), or with none."""
        lines = wire.Lines(sock)
        with sock:
            try:
                nonce = wire.new_nonce()
                lines.send({"hello": wire.MAGIC, "nonce": nonce})
                if not wire.accepted(self._token, nonce, str(lines.receive().get("answer", ""))):
                    lines.send({"error": "the publisher refused the token"})
                    return
                lines.send({"ok": True})
                self.served.connections += 1
                while True:
                    request = lines.receive()
                    self._answer(lines, int(request["have"]), float(request["wait"]))
            except (OSError, ConnectionError, ValueError, KeyError):
                return  # the subscriber left, or spoke nonsense: its copy (if any) is freed below

    def _answer(self, lines: wire.Lines, have: int, wait: float) -> None:
        deadline = time.monotonic() + wait
        with self._changed:
            while (self._newest is None or self._newest.version <= have) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            copy = self._newest if self._newest is not None and self._newest.version > have else None
            if copy is None:
                lines.send({"version": None})
                return
            copy.readers += 1
        try:
            lines.send(wire.header(copy.version, copy.entries, copy.buffer.numel(), copy.crc))
            payload = memoryview(copy.buffer.numpy())
            half = len(payload) // 2
            lines.sock.sendall(payload[:half])
            faults.point("publish")  # (a test's fault: the publisher dies in the middle of a version)
            lines.sock.sendall(payload[half:])
            self.served.sent[copy.version] = self.served.sent.get(copy.version, 0) + 1
        finally:
            with self._changed:
                copy.readers -= 1
                self._changed.notify_all()

    def close(self) -> None:
        """Stop serving; versions being sent are cut off (their subscribers discard them)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._finishing.put(None)
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5.0)

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
