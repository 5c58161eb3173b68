"""``WeightSubscriber``: the newest weights a ``WeightPublisher`` serves, each version whole or not at all.

Every version arrives in a buffer of its own and is handed out only after its checksum matches, so a
connection cut in the middle (the publisher's process lost, a link down) leaves nothing half-written: the
subscriber reconnects and asks again for a version newer than the one it has. Given several addresses of the
publisher (one per network path: ``tcp://10.1.0.5:29600,tcp://10.2.0.5:29600``), it reconnects over the next
one, so a link that failed is routed around, and stays there while it works.

On the publisher's host the bytes are not sent: the subscriber maps the publisher's copy of the version
and copies it out while the publisher holds it for it. The publisher never writes into a copy that is
held, nor offers one it has not finished, so what is copied out is whole without a checksum pass (which
would cost more than the copy); should the publisher die meanwhile, the mapping keeps the copy alive.
"""

from __future__ import annotations

import mmap
import os
import socket
import time

import torch

from torchpass_plugins.core.peer_memory import SegmentId, host_identity, map_peer
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.weights import wire
from torchpass_plugins.weights.storage import VersionStore

_MAPPINGS_KEPT = 4  # a publisher rotates a few copies (3 by default)


class TokenRefused(PermissionError):
    """The publisher refused this subscriber's token (retrying would not help)."""


class WeightSubscriber:
    """Receives versions from ``endpoint`` (``tcp://HOST:PORT``, or the publisher's addresses on several
    paths, comma-separated, tried in turn after a lost connection), proving ``token`` (or
    ``TORCHPASS_WEIGHTS_TOKEN``). ``name`` tells the publisher who this is, in its events and gauges
    (default: host and process id). ``retry_s``: the pause between attempts to reach a publisher that is
    not there (yet, or any more: a trainer rank being replaced). ``stall_s``: a version of which no byte
    arrives for this long (a link down) is given up, and asked for again on a new connection. ``storage``
    (with ``storage_options``): where the publisher also writes versions (its ``storage``); after
    ``fallback_s`` seconds without reaching the publisher, a newer version found there is taken.
    ``shared_memory``: on the publisher's host, map its copies instead of receiving the bytes over TCP."""

    def __init__(self, endpoint: str, token: str | None = None, name: str | None = None, retry_s: float = 0.2,
                 stall_s: float = 10.0, events: EventLog | None = None, storage: str | None = None,
                 storage_options: dict | None = None, fallback_s: float = 30.0, shared_memory: bool = True) -> None:
        self._addresses = [wire.address(e.strip()) for e in endpoint.split(",")]
        self._address = self._addresses[0]
        self._served = False  # whether the current address has served a connection
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._token = wire.token_or_env(token)
        self._retry_s, self._stall_s = retry_s, stall_s
        self._lines: wire.Lines | None = None
        self.events = events or EventLog(None)
        self.version: int | None = None  # the newest version received
        self.discarded = 0  # versions whose checksum did not match, dropped and asked for again
        self._storage = VersionStore(storage, storage_options) if storage is not None else None
        self._fallback_s = fallback_s
        self._unreached_since: float | None = None  # since when the publisher has not been reached
        self._shared_memory = shared_memory
        self._maps = False  # the connection's publisher is on this host, and its copies are mapped
        self._mapped: dict[tuple[int, ...], torch.Tensor] = {}  # its copies mapped so far, newest last
        self._nbytes = 0  # the size of the last version received
        self._ready: torch.Tensor | None = None  # a buffer of that size, its pages already in memory

    def latest(self, timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version the publisher has (waiting up to ``timeout`` seconds for a first one)."""
        return self._receive_newer(-1, timeout)

    def wait_newer(self, version: int, timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version newer than ``version``, as soon as there is one; ``TimeoutError`` after
        ``timeout`` seconds without one."""
        return self._receive_newer(version, timeout)

    def load_into(self, model: torch.nn.Module, timeout: float | None = None, prefix: str = "") -> int:
        """Copy a version newer than the last one received (the first: the newest) into ``model``'s
        parameters and buffers, in place; returns its number. ``prefix``: load only the tensors whose names
        start with it, without it (``"policy."`` when the trainer's LightningModule holds the model as
        ``self.policy``)."""
        before = self.version
        version, state = self._receive_newer(-1 if before is None else before, timeout)
        try:
            model.load_state_dict({name.removeprefix(prefix): tensor for name, tensor in state.items()
                                   if name.startswith(prefix)})
        except BaseException:
            self.version = before  # not loaded: the next call takes the newest again
            raise
        return version

    def _receive_newer(self, have: int, timeout: float | None) -> tuple[int, dict[str, torch.Tensor]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no weights version newer than {have} within {timeout} s")
            try:
                lines = self._connected(min(left, 10.0))
                wait = min(left, 5.0)  # short waits: a lost publisher shows soon
                lines.sock.settimeout(wait + self._stall_s)
                asked = time.monotonic()
                lines.send({"have": have, "wait": wait, "map": self._maps})
                self._prepare_buffer()
                record = lines.receive()
                self._unreached_since = None
                if record.get("version") is None:
                    if time.monotonic() - asked < wait / 2:
                        time.sleep(self._retry_s)  # answered at once: a publisher closing down
                    continue
                started = time.perf_counter()
                version, entries, nbytes = wire.parse_header(record, newer_than=have)
                lines.sock.settimeout(self._stall_s)
                path = "shared_memory" if "segment" in record else "tcp"
                buffer = (self._copy_mapped(lines, record["segment"], nbytes) if "segment" in record
                          else self._receive_checked(lines, nbytes))
                if buffer is None:
                    continue
            except TokenRefused:
                raise
            except (OSError, ConnectionError, ValueError) as exc:
                lost = self._lines is not None  # a connection that was up (a version cut off is dropped)
                if lost:
                    self.events.emit("weights_connection_lost", error=str(exc) or type(exc).__name__)
                self._disconnect()
                self._next_address()
                if (stored := self._from_storage(have)) is not None:
                    return stored
                time.sleep(self._retry_s)
                continue
            self.version = version
            self.events.emit("weights_received", version=version, bytes=nbytes,
                             seconds=time.perf_counter() - started, path=path)
            return version, {e.name: wire.view(buffer, e) for e in entries}

    def _next_address(self) -> None:
        """After a lost connection or a failed attempt: the publisher's next address, if it has several; the
        move is logged when it leaves an address that had served a connection (not while one first comes up)."""
        if len(self._addresses) > 1:
            before = self._address
            self._address = self._addresses[(self._addresses.index(before) + 1) % len(self._addresses)]
            if self._served:
                self._served = False
                self.events.emit("weights_rerouted", **{"from": f"{before[0]}:{before[1]}",
                                                        "to": f"{self._address[0]}:{self._address[1]}"})

    def _prepare_buffer(self) -> None:
        """While the publisher is asked: the next version's buffer (the size of the last), its pages faulted
        in now rather than as the version is copied into it (for hundreds of MB, a good part of the copy)."""
        if self._ready is None and self._nbytes:
            self._ready = torch.empty(self._nbytes, dtype=torch.uint8)
            self._ready[::mmap.PAGESIZE].zero_()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer for a version of ``nbytes``, handed out with it."""
        self._nbytes = nbytes
        ready, self._ready = self._ready, None
        return ready if ready is not None and ready.numel() == nbytes else torch.empty(nbytes, dtype=torch.uint8)

    def _receive_checked(self, lines: wire.Lines, nbytes: int) -> torch.Tensor | None:
        """The version's bytes from the connection; None (and a new connection) if the checksum differs."""
        buffer = self._buffer(nbytes)
        crc = lines.receive_into(memoryview(buffer.numpy()))
        if lines.receive().get("crc32") != crc:
            self.discarded += 1
            self._disconnect()
            return None
        return buffer

    def _copy_mapped(self, lines: wire.Lines, segment: list[int], nbytes: int) -> torch.Tensor | None:
        """The version copied out of the publisher's copy, which it holds until told so; None where this
        process may not map it (another user namespace, say): it asks for bytes from then on. Any other
        failure to map (the publisher gone) is a lost connection."""
        key = (*segment, nbytes)
        mapped = self._mapped.pop(key, None)
        if mapped is None:
            try:
                mapped = map_peer(SegmentId(*segment), nbytes)
            except PermissionError as exc:  # (another user namespace, say: for good)
                lines.send({"mapped": False, "error": str(exc)})
                self._maps = self._shared_memory = False
                self.events.emit("weights_unmapped", error=str(exc))
                return None
        self._mapped[key] = mapped  # kept while connected: the copies rotate (a fresh mapping costs page faults)
        while len(self._mapped) > _MAPPINGS_KEPT:
            del self._mapped[next(iter(self._mapped))]
        buffer = self._buffer(nbytes)
        buffer.copy_(mapped)
        try:
            lines.send({"mapped": True})  # the publisher may reuse its copy
        except OSError:
            self._disconnect()  # (the copy is whole: the publisher died after lending it)
        return buffer

    def _from_storage(self, have: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Once the publisher has been out of reach for ``fallback_s``: a version newer than ``have`` from
        the storage, if it holds one."""
        now = time.monotonic()
        self._unreached_since = self._unreached_since or now
        if self._storage is None or now - self._unreached_since < self._fallback_s:
            return None
        found = self._storage.read_newer(have)
        if found is None:
            return None
        version, state, nbytes = found
        self.version = version
        self.events.emit("weights_received", version=version, bytes=nbytes, seconds=time.monotonic() - now,
                         source=self._storage.url)
        return version, state

    def _connected(self, timeout: float) -> wire.Lines:
        """The connection, made and authenticated if there is none; ``timeout`` bounds both (something else
        listening at the port, which never says hello, is given up on in time)."""
        if self._lines is None:
            sock = socket.create_connection(self._address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            lines = wire.Lines(sock)
            try:
                hello = lines.receive()
                self._maps = self._shared_memory and hello.get("host") == host_identity()
                if hello.get("hello") != wire.MAGIC:
                    raise ConnectionError(f"not a torchpass weights publisher: {str(hello)[:200]}")
                nonce = wire.new_nonce()
                lines.send({"answer": wire.answer(self._token, str(hello.get("nonce"))), "nonce": nonce,
                            "name": self.name})
                reply = lines.receive()
            except BaseException:
                sock.close()
                raise
            if "error" in reply or not wire.accepted(self._token, wire.PUBLISHER + nonce, str(reply.get("proof"))):
                sock.close()
                who = "the publisher refused the token" if "error" in reply else "the publisher did not prove the token"
                raise TokenRefused(f"{who} at tcp://{self._address[0]}:{self._address[1]}: both sides need the "
                                   f"same token (token= or {wire.TOKEN_VARIABLE})")
            self._lines, self._served = lines, True
        return self._lines

    def _disconnect(self) -> None:
        self._mapped.clear()  # (mappings keep a lost publisher's copies alive)
        if self._lines is not None:
            self._lines.sock.close()
            self._lines = None

    def close(self) -> None:
        self._disconnect()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
