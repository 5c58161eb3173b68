"""``WeightPublisher``: versions of a model's weights, served to any number of subscribers over TCP.

The training loop pays almost nothing. ``publish(..., fence_later=True)`` only starts copying the weights
into a host buffer: host tensors are copied by a thread of the idle scheduling class (it runs where the core
would otherwise wait, as in a collective), device tensors on a side stream. :meth:`fence`, called before
the optimizer step changes the weights, copies what is left and makes the copy the newest version. Each
subscriber's connection is served by a thread of its own, from the copy that was newest when it asked, and
the CRC-32 that protects the version is computed as it is sent (once per version) and sent after it.

A subscriber on the same host (same kernel, same PID namespace) is not sent the bytes: the copies are
memory files (``memfd``, :mod:`~torchpass_plugins.core.peer_memory`) that it maps, and it copies the
version out while the publisher holds it for it (no checksum: no byte crosses a link).

Copies are never written while a subscriber reads them: there are a few of them, and a publication that
finds every one newest, being read or being staged is skipped (logged), so a subscriber that reads slowly
costs the trainer nothing and gets the newest version when it asks again. A subscriber that disconnects
at any point only frees its copy.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from torchpass_plugins.core.peer_memory import Segment, host_identity
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing import faults
from torchpass_plugins.weights import wire
from torchpass_plugins.weights.staging import Staging
from torchpass_plugins.weights.storage import VersionStore, keep_storing

CHUNK = 4 << 20  # bytes sent (and checksummed) at a time
_GRACE_S = 0.05  # how long the fence waits for a piece the idle thread holds before it gives the version up
_SEND_TIMEOUT_S = 30.0  # a subscriber that takes no bytes for this long is dropped, and its copy freed
_HANDSHAKE_TIMEOUT_S = 10.0
_WAIT_FOR_A_COPY_S = 60.0  # publish(wait=True): the longest it waits for a copy to be free


@dataclass
class _Copy:
    segment: Segment  # its memory, which subscribers on this host map
    entries: list[wire.Entry]
    version: int = -1
    crc: int | None = None  # computed by the first complete send
    readers: int = 0  # subscribers being sent this copy
    busy: bool = True  # being staged: not yet a version anyone may read
    stall_s: float = 0.0  # what staging it cost the training loop
    plan: Any = None  # the pieces the idle thread copies into it, while the sources are the same tensors

    @property
    def buffer(self) -> torch.Tensor:
        return self.segment.tensor


@dataclass
class _Peer:
    """A subscriber's connection: its name once it said it, the newest version it was sent whole."""

    name: str
    sent: int = -1


@dataclass
class Publication:
    """What one ``publish`` call did: the version, or ``skipped``; the seconds the caller spent in it."""

    version: int
    nbytes: int
    stall_s: float
    skipped: bool = False


class WeightPublisher:
    """Publishes versions of a state dict at ``endpoint`` (``tcp://HOST:PORT``; port 0: any free one, see
    :attr:`endpoint`). Subscribers prove ``token`` (or ``TORCHPASS_WEIGHTS_TOKEN``); ``dtype`` casts
    floating tensors as they are copied (``torch.bfloat16`` halves the bytes). ``copies`` bounds the host
    memory: one copy per version being staged, newest or being read. ``storage`` (a path or fsspec URL,
    with ``storage_options``): the newest version is also written there, in the background, for subscribers
    that cannot reach this endpoint (:mod:`~torchpass_plugins.weights.storage`)."""

    def __init__(self, endpoint: str, token: str | None = None, dtype: torch.dtype | None = None, copies: int = 3,
                 events: EventLog | None = None, storage: str | None = None,
                 storage_options: dict | None = None) -> None:
        if copies < 2:
            raise ValueError("a publisher needs at least 2 copies: the newest and one to stage the next into")
        self._token = wire.token_or_env(token)
        self._dtype = dtype
        self._copies: list[_Copy] = []
        self._max_copies = copies
        self._newest: _Copy | None = None
        self._staging: Staging | None = None
        self._changed = threading.Condition()
        self._closed = False
        self._last_version = -1
        self.events = events or EventLog(None)
        self._address = wire.address(endpoint)
        self._listener: socket.socket | None = None
        self._served: dict[socket.socket, _Peer] = {}
        self._sent_to: dict[str, int] = {}  # the newest version sent whole to each subscriber, by name
        try:
            self._listener = socket.create_server(self._address, backlog=64)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or self._address[1] == 0:
                raise
            # The port is still held, by the process this one takes over from (a planned migration): the
            # accept thread binds it as soon as that process lets go; publications are kept meanwhile.
        _publishers.add(self)
        port = self._listener.getsockname()[1] if self._listener is not None else self._address[1]
        self.endpoint = f"tcp://{self._address[0]}:{port}"
        self._accepting = threading.Thread(target=self._accept_loop, name="weights-accept", daemon=True)
        self._accepting.start()
        self._stored: int | None = None if storage is None else -1  # the newest version written to storage
        if storage is not None:
            threading.Thread(target=keep_storing, args=(self, VersionStore(storage, storage_options)),
                             name="weights-storage", daemon=True).start()

    # -- the training thread --------------------------------------------------------------------------
    def publish(self, state: dict[str, torch.Tensor] | torch.nn.Module, version: int, wait: bool = False,
                fence_later: bool = False) -> Publication:
        """Copy ``state`` (a state dict or a module's) into host memory as ``version``, which must be newer
        than the last one. With ``fence_later`` (``state`` a module) the parameters' copy is only started,
        and :meth:`fence` must be called before the optimizer changes them (buffers, which a forward pass may
        change, are copied at once); otherwise the copy is complete, and the version served, when this
        returns. When every copy is newest, being read or being staged, the version is skipped (it may be
        published again), unless ``wait`` (for the last version of a run): then it waits for a copy to be
        free."""
        started = time.perf_counter()
        if version <= self._last_version:
            raise ValueError(f"weights version {version} is not newer than the last published, {self._last_version}")
        if fence_later and not isinstance(state, torch.nn.Module):
            raise ValueError("publish(fence_later=True) takes the module, whose parameters wait for the fence")
        self.fence()  # one version staged at a time
        later = {p.data_ptr() for p in state.parameters()} if fence_later else set()
        if isinstance(state, torch.nn.Module):
            state = state.state_dict()
        entries, nbytes = wire.layout(state, self._dtype)  # refuses what cannot be published, before anything
        target = self._free_copy(entries, nbytes, wait)
        if target is None:
            self.events.emit("weights_skipped", version=version, reason="every copy is newest or being read")
            return Publication(version, 0, time.perf_counter() - started, skipped=True)
        self._last_version = version
        target.version, target.crc = version, None
        self._staging = Staging.start(target, target.buffer, target.entries, state, later)
        target.stall_s = time.perf_counter() - started
        if not fence_later:
            self.fence()
        return Publication(version, target.buffer.numel(), target.stall_s)

    @property
    def last_version(self) -> int:
        """The newest version served or being staged (one that was skipped does not count); -1 before any."""
        return self._last_version

    def fence(self) -> float:
        """Finish the version being staged (before its sources change) and serve it; the seconds it took."""
        if self._staging is None:
            return 0.0
        started = time.perf_counter()
        staging, self._staging = self._staging, None
        copy = staging.owner
        if not staging.finish(_GRACE_S):
            with self._changed:  # the idle thread may still write into it: never serve or reuse this copy
                self._forget(copy)
                self._last_version = self._newest.version if self._newest is not None else -1
            self.events.emit("weights_skipped", version=copy.version, reason="the copy was not done in time")
            return time.perf_counter() - started
        copy.stall_s += time.perf_counter() - started
        with self._changed:
            copy.busy = False
            self._newest = copy
            self._changed.notify_all()
        self.events.emit("weights_published", version=copy.version, bytes=copy.buffer.numel(), stall_s=copy.stall_s)
        return time.perf_counter() - started

    def _free_copy(self, entries: list[wire.Entry], nbytes: int, wait: bool) -> _Copy | None:
        """A copy no one reads or will read (a new one while there are fewer than ``copies``), marked busy."""
        deadline = time.monotonic() + _WAIT_FOR_A_COPY_S
        with self._changed:
            while True:
                for copy in self._copies:
                    if copy is not self._newest and copy.readers == 0 and not copy.busy:
                        if copy.entries == entries:
                            copy.busy = True
                            return copy
                        self._forget(copy)  # the model's layout changed: this copy is of no use
                        break
                if len(self._copies) < self._max_copies:
                    copy = _Copy(Segment(nbytes, pinned=torch.cuda.is_available()), entries)
                    self._copies.append(copy)
                    return copy
                left = deadline - time.monotonic()
                if not wait or self._closed or left <= 0:
                    return None
                self._changed.wait(left)

    def _forget(self, copy: _Copy) -> None:
        """(Under the lock.) ``copy`` is never served again; a subscriber that mapped it keeps its mapping."""
        self._copies.remove(copy)
        copy.segment.close()

    # -- background ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while self._listener is None and not self._closed:
            try:
                self._listener = socket.create_server(self._address, backlog=64)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    self.events.emit("weights_unserved", endpoint=self.endpoint, error=str(exc))
                    return
                time.sleep(0.2)
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            with self._changed:
                self._served[sock] = _Peer("{}:{}".format(*peer[:2]))
            threading.Thread(target=self._serve, args=(sock,), name="weights-serve", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """One subscriber: authenticate, then answer each request with the newest version newer than the one
        it has (waiting up to its ``wait`` seconds for one), or with none."""
        lines = wire.Lines(sock)
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            nonce = wire.new_nonce()
            lines.send({"hello": wire.MAGIC, "nonce": nonce, "host": host_identity()})
            hello = lines.receive()
            if not wire.accepted(self._token, nonce, str(hello.get("answer", ""))):
                lines.send({"error": "the publisher refused the token"})
                return
            lines.send({"ok": True, "proof": wire.answer(self._token, wire.PUBLISHER + str(hello.get("nonce", "")))})
            sock.settimeout(_SEND_TIMEOUT_S)  # (a receive waits no longer either: requests come at once)
            peer = self._served[sock]
            peer.name = str(hello.get("name", ""))[:200] or peer.name
            while not self._closed:
                request = lines.receive()
                self._answer(lines, int(request["have"]), float(request["wait"]), bool(request.get("map")), peer)
        except (OSError, ConnectionError, ValueError, KeyError, TypeError):
            return  # the subscriber left, stalled or spoke nonsense: its copy (if any) was freed by _answer
        finally:
            with self._changed:
                self._served.pop(sock, None)
                self._changed.notify_all()
            sock.close()

    def hold_newest(self, have: int, wait: float | None) -> _Copy | None:
        """The newest version, once there is one newer than ``have`` (None after ``wait`` seconds without,
        or once closed), held for reading: its copy is not reused until :meth:`release`."""
        deadline = None if wait is None else time.monotonic() + wait
        with self._changed:
            while (self._newest is None or self._newest.version <= have) and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            copy = self._newest if self._newest is not None and self._newest.version > have else None
            if copy is not None:
                copy.readers += 1
            return copy

    def release(self, copy: _Copy) -> None:
        with self._changed:
            copy.readers -= 1
            self._changed.notify_all()

    def stored(self, copy: _Copy) -> None:
        """The storage thread is done with ``copy`` (written, or failed and logged)."""
        self._stored = copy.version
        self.release(copy)

    def _answer(self, lines: wire.Lines, have: int, wait: float, mapped: bool, peer: _Peer) -> None:
        copy = self.hold_newest(have, wait)
        if copy is None:
            lines.send({"version": None})  # (not under the lock: a subscriber that does not read would hold it)
            return
        started = time.perf_counter()
        try:
            if mapped and not self._lend(lines, copy, peer):
                return
            if not mapped:
                self._send(lines, copy, peer)
            self.events.emit("weights_sent", subscriber=peer.name, version=copy.version, bytes=copy.buffer.numel(),
                             seconds=time.perf_counter() - started, newest=self._newest.version,  # (the lag)
                             path="shared_memory" if mapped else "tcp")
        finally:
            self.release(copy)

    def _lend(self, lines: wire.Lines, copy: _Copy, peer: _Peer) -> bool:
        """A subscriber on this host: where to map the version; the copy stays held until the subscriber says
        it has copied the version out (True) or could not map it (False: it asks for bytes from then on), or
        leaves."""
        lines.send(wire.header(copy.version, copy.entries, copy.buffer.numel(), copy.segment.id.to_list()))
        faults.point("publish")  # (a test's fault: the publisher dies in the middle of a version)
        lines.sock.settimeout(None)  # held until the subscriber answers or leaves, however slow its copy: a
        try:  # copy released earlier could be rewritten under it, and nothing on this path would tell
            mapped = lines.receive().get("mapped")
        finally:
            lines.sock.settimeout(_SEND_TIMEOUT_S)
        if not mapped:
            return False
        peer.sent = self._sent_to[peer.name] = copy.version  # (release, in _answer, notifies deliver_newest)
        return True

    def _send(self, lines: wire.Lines, copy: _Copy, peer: _Peer) -> None:
        """The version's bytes over the connection, its CRC-32 computed as they go (the first time)."""
        lines.send(wire.header(copy.version, copy.entries, copy.buffer.numel()))
        payload, crc, half = memoryview(copy.buffer.numpy()), 0, copy.buffer.numel() // 2
        for low, high in ((0, half), (half, len(payload))):
            if low:
                faults.point("publish")  # (a test's fault: the publisher dies in the middle of a version)
            for start in range(low, high, CHUNK):
                piece = payload[start:min(start + CHUNK, high)]
                lines.sock.sendall(piece)
                if copy.crc is None:
                    crc = zlib.crc32(piece, crc)
        if copy.crc is None:
            copy.crc = crc
        lines.send({"crc32": copy.crc})
        peer.sent = self._sent_to[peer.name] = copy.version  # (release, in _answer, notifies deliver_newest)

    def deliver_newest(self, timeout: float, expected: tuple[str, ...] = ()) -> list[str]:
        """Wait until every subscriber connected now, and every one named in ``expected`` (connected or not
        yet), has been sent the newest version whole (or, connected, has left), and the storage has it, at
        most ``timeout`` seconds; the names of those that have not (``storage``). At the end of training:
        the process that publishes may exit right after its last publication, which would cut that version
        off."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                newest = self._newest.version if self._newest is not None else -1
                behind = [peer.name for peer in self._served.values() if peer.sent < newest]
                behind += [name for name in expected if self._sent_to.get(name, -1) < newest and name not in behind]
                behind += ["storage"] if self._stored is not None and self._stored < newest else []
                left = deadline - time.monotonic()
                if not behind or self._closed or left <= 0:
                    return behind
                self._changed.wait(left)

    def close(self) -> None:
        """Stop serving and let go of the port; versions being sent are cut off (their subscribers discard
        them and ask the endpoint again)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            served = list(self._served)
            for copy in list(self._copies):
                self._forget(copy)
        for sock in ([self._listener] if self._listener is not None else []) + served:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._accepting.join(timeout=5.0)

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_publishers: weakref.WeakSet[WeightPublisher] = weakref.WeakSet()


def _forget_sockets_in_child() -> None:
    """A process forked from a publisher's (a DataLoader worker) closes its copies of the publisher's
    sockets. Else, when the publisher's process dies, its orphaned workers keep the port (a successor
    cannot bind it) and the connections (a subscriber is not told its version was cut off) until they
    notice, seconds later. Every socket on a publisher's port is closed, not only those it registered: a
    connection accepted just before the fork may not be registered yet. Closed, not shut down: the
    publisher's own copies are untouched."""
    ports = set()
    for publisher in list(_publishers):
        publisher._closed = True
        ports.add(int(publisher.endpoint.rpartition(":")[2]))
    if not ports:
        return
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):  # not a socket (or already gone)
            continue
        try:
            mine = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getsockname()[1] in ports
        except OSError:
            mine = False
        if mine:
            sock.close()
        else:
            sock.detach()


os.register_at_fork(after_in_child=_forget_sockets_in_child)
