"""One subscriber's connection to a :class:`~torchpass_plugins.weights.publisher.WeightPublisher`, served by
a thread of its own: the token handshake, then each request answered with the newest version newer than
the one the subscriber has.

A subscriber on another host is sent the bytes, the version's CRC-32 computed as they go (once per
version) and sent after them. One on the same host (same kernel, same PID namespace) is told where to map
the publisher's copy instead, which stays held for it until it says it has copied the version out: a copy
released earlier could be rewritten under it, and nothing on that path would tell.

A process forked from a publisher's lets go of its copies of the connections and the port (see
:func:`_forget_sockets_in_child`).
"""

from __future__ import annotations

import os
import socket
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchpass_plugins.core.peer_memory import host_identity
from torchpass_plugins.testing import faults
from torchpass_plugins.weights import wire

if TYPE_CHECKING:
    from torchpass_plugins.weights.publisher import WeightPublisher, _Copy

CHUNK = 4 << 20  # bytes sent (and checksummed) at a time
_SEND_TIMEOUT_S = 30.0  # a subscriber that takes no bytes for this long is dropped, and its copy freed
_HANDSHAKE_TIMEOUT_S = 10.0


@dataclass
class Peer:
    """A subscriber's connection: its name once it said it, the newest version it was sent whole."""

    name: str
    sent: int = -1
    authenticated: bool = False  # it proved the token: a subscriber, which may hold a copy


class Connection:
    """``sock``, accepted by ``publisher``, served until the subscriber leaves or the publisher closes."""

    def __init__(self, publisher: WeightPublisher, sock: socket.socket, peer: Peer, token: str) -> None:
        self.publisher, self.sock, self.peer, self._token = publisher, sock, peer, token

    def serve(self) -> None:
        """Authenticate, then answer each request with the newest version newer than the one the subscriber
        has (waiting up to its ``wait`` seconds for one), or with none."""
        lines = wire.Lines(self.sock)
        try:
            self.sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            nonce = wire.new_nonce()
            lines.send({"hello": wire.MAGIC, "nonce": nonce, "host": host_identity()})
            hello = lines.receive()
            if not wire.accepted(self._token, nonce, str(hello.get("answer", ""))):
                lines.send({"error": "the publisher refused the token"})
                return
            self.peer.authenticated = True
            lines.send({"ok": True, "proof": wire.answer(self._token, wire.PUBLISHER + str(hello.get("nonce", "")))})
            self.sock.settimeout(_SEND_TIMEOUT_S)  # (a receive waits no longer either: requests come at once)
            self.peer.name = str(hello.get("name", ""))[:200] or self.peer.name
            while not self.publisher.closed:
                request = lines.receive()
                self._answer(lines, int(request["have"]), float(request["wait"]), bool(request.get("map")))
        except (OSError, ConnectionError, ValueError, KeyError, TypeError):
            return  # the subscriber left, stalled or spoke nonsense: its copy (if any) was freed by _answer
        finally:
            self.publisher.disconnected(self.sock)
            self.sock.close()

    def _answer(self, lines: wire.Lines, have: int, wait: float, mapped: bool) -> None:
        copy = self.publisher.hold_newest(have, wait)
        if copy is None:
            lines.send({"version": None})  # (not under the lock: a subscriber that does not read would hold it)
            return
        started = time.perf_counter()
        try:
            if mapped and not self._lend(lines, copy):
                return
            if not mapped:
                self._send(lines, copy)
            self.publisher.events.emit("weights_sent", subscriber=self.peer.name, version=copy.version,
                                       bytes=copy.buffer.numel(), seconds=time.perf_counter() - started,
                                       newest=self.publisher.newest_version,  # (the lag)
                                       path="shared_memory" if mapped else "tcp")
        finally:
            self.publisher.release(copy)

    def _lend(self, lines: wire.Lines, copy: _Copy) -> bool:
        """A subscriber on this host: where to map the version; the copy stays held until the subscriber says
        it has copied the version out (True) or could not map it (False: it asks for bytes from then on), or
        leaves."""
        lines.send(wire.header(copy.version, copy.entries, copy.buffer.numel(), copy.segment.id.to_list()))
        faults.point("publish")  # (a test's fault: the publisher dies in the middle of a version)
        lines.sock.settimeout(None)  # held however slow its copy out is
        try:
            mapped = lines.receive().get("mapped")
        finally:
            lines.sock.settimeout(_SEND_TIMEOUT_S)
        if not mapped:
            return False
        self.publisher.sent_whole(self.peer, copy.version)
        return True

    def _send(self, lines: wire.Lines, copy: _Copy) -> None:
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
        self.publisher.sent_whole(self.peer, copy.version)


publishers: weakref.WeakSet[WeightPublisher] = weakref.WeakSet()  # of this process


def _forget_sockets_in_child() -> None:
    """A process forked from a publisher's (a DataLoader worker) closes its copies of the publisher's
    sockets. Else, when the publisher's process dies, its orphaned workers keep the port (a successor
    cannot bind it) and the connections (a subscriber is not told its version was cut off) until they
    notice, seconds later. Every socket on a publisher's port is closed, not only those it registered: a
    connection accepted just before the fork may not be registered yet. Closed, not shut down: the
    publisher's own copies are untouched."""
    ports = set()
    for publisher in list(publishers):
        publisher.abandon()
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
