"""``WeightPublisher``: versions of a model's weights, served to any number of subscribers over TCP.

The training loop pays almost nothing. ``publish(..., fence_later=True)`` only starts copying the weights
into a host buffer: host tensors are copied by a thread of the idle scheduling class (it runs where a core
would otherwise wait, as in a collective), device tensors on a side stream. :meth:`fence`, called before
the optimizer step changes the weights, copies what is left and makes the copy the newest version. Each
subscriber's connection is served by a thread of its own (:mod:`~torchpass_plugins.weights.serving`: bytes
with their CRC-32, or, on the same host, where to map the copy, a ``memfd``), from the copy that was newest
when it asked.

Copies are never written while a subscriber reads them: there are a few of them, and a publication that
finds every one newest, being read or being staged is skipped (logged), so a subscriber that reads slowly
costs the trainer nothing and gets the newest version when it asks again. A subscriber that disconnects
at any point only frees its copy. The copies after the first are made ahead, in the background (see
:meth:`WeightPublisher._make_ahead`); a publication that finds none free waits for one being made.
"""

from __future__ import annotations

import ctypes
import errno
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from torchpass_plugins.core.peer_memory import Segment
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.weights import serving, wire
from torchpass_plugins.weights.serving import Connection, Peer
from torchpass_plugins.weights.staging import Staging
from torchpass_plugins.weights.storage import VersionStore, keep_storing

_GRACE_S = 0.05  # how long the fence waits for a piece the idle thread holds before it gives the version up
_WAIT_FOR_A_COPY_S = 60.0  # the longest a publication waits for a copy to be free (wait=True) or made


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
        self._making = 0  # copies being made in the background, of this layout:
        self._making_layout: list[wire.Entry] = []
        self._staging: Staging | None = None
        self._changed = threading.Condition()
        self._closed = False
        self._last_version = -1
        self.events = events or EventLog(None)
        self._address = wire.address(endpoint)
        self._listener: socket.socket | None = None
        self._served: dict[socket.socket, Peer] = {}
        self._sent_to: dict[str, int] = {}  # the newest version sent whole to each subscriber, by name
        try:
            self._listener = socket.create_server(self._address, backlog=64)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or self._address[1] == 0:
                raise
            # The port is still held, by the process this one takes over from (a planned migration): the
            # accept thread binds it as soon as that process lets go; publications are kept meanwhile.
        serving.publishers.add(self)
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
        free. It waits, too, for a copy being made in the background."""
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
                self._last_version = self.newest_version
                self._make_ahead(copy)
            self.events.emit("weights_skipped", version=copy.version, reason="the copy was not done in time")
            return time.perf_counter() - started
        copy.stall_s += time.perf_counter() - started
        with self._changed:
            copy.busy = False
            self._newest = copy
            self._changed.notify_all()
            self._make_ahead(copy)
        self.events.emit("weights_published", version=copy.version, bytes=copy.buffer.numel(), stall_s=copy.stall_s)
        return time.perf_counter() - started

    def _free_copy(self, entries: list[wire.Entry], nbytes: int, wait: bool) -> _Copy | None:
        """A copy no one reads or will read (a new one while there are fewer than ``copies``), marked busy."""
        deadline = time.monotonic() + _WAIT_FOR_A_COPY_S
        with self._changed:
            while True:
                self._forget_other_layouts(entries)
                for copy in self._copies:
                    if copy is not self._newest and copy.readers == 0 and not copy.busy:
                        copy.busy = True
                        return copy
                coming = self._making > 0 and self._making_layout == entries  # cheaper to wait for than to make
                if not coming and len(self._copies) + self._making < self._max_copies:
                    copy = _Copy(Segment(nbytes, pinned=torch.cuda.is_available()), entries)
                    self._copies.append(copy)
                    return copy
                left = deadline - time.monotonic()
                if (not wait and not coming) or self._closed or left <= 0:
                    return None
                self._changed.wait(left)

    def _make_ahead(self, like: _Copy) -> None:
        """(Under the lock.) The copies the next publications may need (the newest, one to stage into, one per
        subscriber that proved the token, one for storage; up to ``copies``; kept until :meth:`close`), made
        in the background with their pages faulted in: made by the publication that needed it, a large
        model's copy cost that step its page faults (page-locking too, with CUDA)."""
        self._forget_other_layouts(like.entries)
        readers = sum(peer.authenticated for peer in self._served.values()) + (self._stored is not None)
        wanted = min(self._max_copies, 2 + readers) - len(self._copies) - self._making
        if wanted <= 0 or self._closed:
            return
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        thread = threading.Thread(target=self._make, args=(like.entries, like.buffer.numel(), wanted, device),
                                  name="weights-copies", daemon=True)
        try:
            thread.start()  # (its first count of the copies it made waits for this lock)
        except RuntimeError:
            return  # no thread to be had: the publications make the copies they need
        self._making, self._making_layout = self._making + wanted, like.entries

    def _make(self, entries: list[wire.Entry], nbytes: int, count: int, device: int | None) -> None:
        """(The copies' thread.) ``count`` copies of ``entries``. One that cannot be made now (no memory,
        say) is left to the publication that needs it, which makes it and raises the error."""
        try:
            if device is not None:
                torch.cuda.set_device(device)  # (a new thread's is device 0: pinning there would open a context)
            for _ in range(count):
                copy = _Copy(Segment(nbytes, pinned=device is not None), entries, busy=False)
                ctypes.memset(copy.buffer.data_ptr(), 0, nbytes)
                with self._changed:
                    count, self._making = count - 1, self._making - 1
                    if self._closed:
                        copy.segment.close()
                    else:
                        self._copies.append(copy)
                    self._changed.notify_all()
        except Exception:  # (see the docstring)
            pass
        finally:
            with self._changed:
                self._making -= count
                self._changed.notify_all()

    def _forget_other_layouts(self, entries: list[wire.Entry]) -> None:
        """(Under the lock.) Free copies of another layout than ``entries`` (the model's changed) are of no use."""
        for copy in [c for c in self._copies if c.entries != entries and c is not self._newest
                     and c.readers == 0 and not c.busy]:
            self._forget(copy)

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
            subscriber = Peer("{}:{}".format(*peer[:2]))
            with self._changed:
                self._served[sock] = subscriber
            connection = Connection(self, sock, subscriber, self._token)
            threading.Thread(target=connection.serve, name="weights-serve", daemon=True).start()

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

    def sent_whole(self, peer: Peer, version: int) -> None:
        """(A connection's thread.) ``peer`` holds ``version`` whole (its release notifies deliver_newest)."""
        peer.sent = self._sent_to[peer.name] = version

    def disconnected(self, sock: socket.socket) -> None:
        with self._changed:
            self._served.pop(sock, None)
            self._changed.notify_all()

    @property
    def newest_version(self) -> int:
        """The version served now; -1 before any."""
        return -1 if (newest := self._newest) is None else newest.version

    @property
    def closed(self) -> bool:
        return self._closed

    def abandon(self) -> None:
        """(In a process forked from this one's.) This copy of the publisher serves nothing."""
        self._closed = True

    def deliver_newest(self, timeout: float, expected: tuple[str, ...] = ()) -> list[str]:
        """Wait until every subscriber connected now, and every one named in ``expected`` (connected or not
        yet), has been sent the newest version whole (or, connected, has left), and the storage has it, at
        most ``timeout`` seconds; the names of those that have not (``storage``). At the end of training:
        the process that publishes may exit right after its last publication, which would cut that version
        off."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                newest = self.newest_version
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
