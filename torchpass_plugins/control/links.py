"""The paths between nodes: which one the job's collectives take, and when to leave it for another.

A node may reach the others over several network interfaces (``--interfaces eth1,eth0``: two rails, or a
rail and the front-end network), each on a subnet of its own. Path ``p`` is every node's ``p``-th interface;
each generation's groups are built on one path, the roster's, so that a link that fails is left by
rebuilding the same members' groups on another path: no process is replaced, no state moves.

Every agent answers probes on each of its node's paths and probes every other node's agent on each path,
several times a second (:class:`LinkWatch`: UDP datagrams between the interfaces' addresses). That tells a
dead link from a dead process or node: a worker that dies is its agent's report, and a node whose agent
still answers on another path has lost a *path*, not its life. A path down is first waited for, as long as
the grace (a flap: TCP's own retransmissions carry a collective stuck on it on once it is back), and then
reported to the coordinator (:class:`~torchpass_plugins.control.protocol.LinkDown`), whose policy moves the
job to another path. A node that answers on no path is left to the heartbeats: that is the node's loss.
The probes' round trips also show a link that works but slowly (a bad optic, a shaped or congested port):
one whose round trip to a node is far above the other paths' to that node is logged as degraded.
"""

from __future__ import annotations

import fcntl
import json
import re
import select
import socket
import statistics
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from torchpass_plugins.control.membership import prefixed, under
from torchpass_plugins.control.protocol import PREFIX, LinkDown, links_key, send
from torchpass_plugins.observe.events import EventLog

PROBE_INTERVAL_S = 0.2
DOWN_AFTER_S = 1.0  # no answer for this long: the path to that node is down
_PEERS_REREAD_S = 2.0  # a node's agent started again answers on new ports
_ROUND_TRIPS_KEPT = 25  # per (node, path): the last 5 s of probes
SLOW_FACTOR, SLOW_FLOOR_S = 4.0, 0.02  # degraded: a round trip over 4x the other paths' to that node, plus 20 ms
_SLOW_REVIEW_S = 5.0
FLAPS = 3  # a path that failed and came back this often is left all the same
_SIOCGIFADDR = 0x8915
_PING, _PONG = 0, 1
_DATAGRAM = struct.Struct("!BIq")  # kind, node, sequence


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``; ``ValueError`` naming it if it has none here."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise ValueError(f"--interfaces: this node has no interface {name!r} with an IPv4 address ({exc}); "
                             "`ip -4 addr` lists them") from None
    return socket.inet_ntoa(packed[20:24])


def all_interfaces() -> tuple[str, ...]:
    """``--interfaces all``: every interface of this node that is up with an IPv4 address, loopback aside,
    by name, numbers in names counted as numbers (eth2 before eth10): nodes named alike list their rails in
    the same order."""
    found = []
    for _, name in sorted(socket.if_nameindex(), key=lambda entry: [int(part) if part.isdigit() else part
                                                                      for part in re.split(r"(\d+)", entry[1])]):
        try:
            with open(f"/sys/class/net/{name}/operstate") as state:
                down = state.read().strip() == "down"
            up = not down and not interface_address(name).startswith("127.")
        except (OSError, ValueError):  # no IPv4 address, or gone meanwhile
            continue
        if up:
            found.append(name)
    return tuple(found)


@dataclass
class PathTable:
    """What the probes found, per (node, path): pure, fed with answer times, read with :meth:`review`.

    A path to a node is *failed* once it has not answered for ``down_after_s`` while another path to the same
    node answers (else the node itself is silent, which is not a link's matter). A failed path that answers
    again has *recovered* (a flap); one failed for ``grace_s`` is to be *reported*, once per failure, and so is
    one that flapped ``flaps`` times (once: a path that keeps failing is left even if each flap is short)."""

    paths: int
    down_after_s: float
    grace_s: float
    flaps: int = FLAPS
    last: dict[tuple[int, int], float] = field(default_factory=dict)  # (node, path) -> its last answer
    failed: dict[tuple[int, int], float] = field(default_factory=dict)  # (node, path) -> silent since
    reported: set[tuple[int, int]] = field(default_factory=set)
    flapped: dict[tuple[int, int], int] = field(default_factory=dict)  # (node, path) -> flaps so far

    def answered(self, node: int, path: int, now: float) -> None:
        self.last[(node, path)] = now

    def expect(self, node: int, now: float) -> None:
        """``node``'s addresses are known from ``now`` on: a path of it that never answers is judged as one
        that stopped (a blocked port, a wrong subnet), not left out."""
        for path in range(self.paths):
            self.last.setdefault((node, path), now)

    def up(self, node: int, path: int, now: float) -> bool:
        """Whether ``path`` to ``node`` answered within ``down_after_s``."""
        return now - self.last.get((node, path), float("-inf")) <= self.down_after_s

    def review(self, now: float) -> list[tuple[str, int, int, float]]:
        """What changed: ``("failed", node, path, 0)``, ``("recovered", node, path, seconds_failed)``,
        ``("report", node, path, seconds_failed)``. A node not heard from yet is not judged."""
        changes = []
        for node, path in sorted(self.last):
            key = (node, path)
            if self.up(node, path, now):
                if key in self.failed:
                    seconds = now - self.failed.pop(key)
                    changes.append(("recovered", node, path, seconds))
                    self.reported.discard(key)
                    self.flapped[key] = self.flapped.get(key, 0) + (seconds < self.grace_s)
                    if seconds < self.grace_s and self.flapped[key] == self.flaps:
                        changes.append(("report", node, path, seconds))
                continue
            others_up = any(self.up(node, q, now) for q in range(self.paths) if q != path)
            if key not in self.failed:
                if others_up:
                    self.failed[key] = self.last[key]
                    changes.append(("failed", node, path, 0.0))
                continue
            if others_up and key not in self.reported and now - self.failed[key] >= self.grace_s:
                self.reported.add(key)
                changes.append(("report", node, path, now - self.failed[key]))
        return changes


def slow_paths(round_trips: dict[tuple[int, int], float], factor: float = SLOW_FACTOR,
               floor_s: float = SLOW_FLOOR_S) -> dict[tuple[int, int], float]:
    """The (node, path) whose median round trip is over ``factor`` times the other paths' to the same node, plus
    ``floor_s``; each with that other paths' median. Comparing paths to one node leaves out what delays every
    path alike (a busy node answering late)."""
    slow = {}
    for (node, path), seconds in round_trips.items():
        others = [s for (n, q), s in round_trips.items() if n == node and q != path]
        if others and seconds > factor * statistics.median(others) + floor_s:
            slow[(node, path)] = statistics.median(others)
    return slow


class LinkWatch:
    """An agent's probes: answers the other nodes' on each of this node's interfaces, sends its own, and
    reports a path down past the grace to the coordinator of the current attempt (``attempt()``; a job restarted
    has a new coordinator, which is told again). ``client``: a store connection of the probes' own."""

    def __init__(self, node: int, nnodes: int, interfaces: list[str], grace_s: float, client, attempt: Callable,
                 events: EventLog) -> None:
        self.node, self.nnodes, self.interfaces = node, nnodes, interfaces
        self.client, self.attempt, self.events = client, attempt, events
        self._told = -1  # the attempt whose coordinator the reports so far went to
        self.table = PathTable(len(interfaces), DOWN_AFTER_S, grace_s)
        self.sockets = []
        for name in interfaces:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((interface_address(name), 0))
            s.setblocking(False)
            self.sockets.append(s)
        self.peers: dict[int, list[tuple[str, int]]] = {}
        self._sent: dict[int, float] = {}  # probe round -> when it was sent
        self.round_trips: dict[tuple[int, int], deque] = {}
        self.degraded: set[tuple[int, int]] = set()  # (node, path) logged as degraded

    def start(self, done: threading.Event) -> None:
        addresses = [s.getsockname() for s in self.sockets]
        under(self.client, PREFIX).set(links_key(self.node), json.dumps(addresses))
        threading.Thread(target=self._run, args=(done,), name="torchpass-links", daemon=True).start()

    def _read_peers(self, now: float) -> None:
        """The other agents' probe addresses: those not known yet, and those of a node silent on every path
        (its agent may have started again, on new ports); not every node's every time (a store read each)."""
        store = under(self.client, PREFIX)
        for node in range(self.nnodes):
            silent = not any(self.table.up(node, path, now) for path in range(len(self.sockets)))
            if node == self.node or (node in self.peers and not silent):
                continue
            try:
                if not store.check([links_key(node)]):
                    continue
                addresses = [(a, int(p)) for a, p in json.loads(store.get(links_key(node)))]
            except Exception as exc:  # a store error, a bad value: this node is skipped, the others probed
                print(f"torchpass: link probes: node {node}'s addresses: {exc!r}", file=sys.stderr, flush=True)
                continue
            if len(addresses) != len(self.sockets) and self.peers.get(node) != addresses:
                print(f"torchpass: node {node} has {len(addresses)} network path(s) (--interfaces), this node "
                      f"{len(self.sockets)}: give every node the same interfaces, in the same order", file=sys.stderr,
                      flush=True)
            self.peers[node] = addresses
            self.table.expect(node, now)

    def _run(self, done: threading.Event) -> None:
        seq, timers, failures = 0, (0.0, time.monotonic() + _SLOW_REVIEW_S), set()
        try:
            while not done.is_set():
                seq += 1
                try:
                    timers = self._round(seq, *timers)
                except Exception as exc:  # a store error, a bug: said once, and the probes go on
                    if repr(exc) not in failures:
                        failures.add(repr(exc))
                        print(f"torchpass: link probes of node {self.node}: {exc!r}", file=sys.stderr, flush=True)
                    time.sleep(PROBE_INTERVAL_S)
        finally:
            for s in self.sockets:
                s.close()

    def _round(self, seq: int, reread: float, slow_review: float) -> tuple[float, float]:
        """One probe of every path to every node, the answers until the next, and what they changed."""
        now = time.monotonic()
        if now >= reread:
            self._read_peers(now)
            reread = now + _PEERS_REREAD_S
        self._sent[seq] = now
        self._sent.pop(seq - _ROUND_TRIPS_KEPT, None)
        for path, s in enumerate(self.sockets):
            for addresses in self.peers.values():
                if path < len(addresses):
                    try:
                        s.sendto(_DATAGRAM.pack(_PING, self.node, seq), addresses[path])
                    except OSError:  # no route over this path now: it stays unanswered
                        pass
        self._answer_until(now + PROBE_INTERVAL_S)
        if self.attempt() != self._told:  # a new coordinator: what it should know, it is told again
            self._told = self.attempt()
            self.table.reported.clear()
        for change in self.table.review(time.monotonic()):
            try:
                self._on_change(*change)
            except Exception as exc:  # not sent: reported again at the next review
                self.table.reported.discard(change[1:3])
                print(f"torchpass: link probes: {change[0]} of path {change[2]} to node {change[1]}: {exc!r}",
                      file=sys.stderr, flush=True)
        if time.monotonic() >= slow_review:
            self._review_slow()
            slow_review = time.monotonic() + _SLOW_REVIEW_S
        return reread, slow_review

    def _answer_until(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select(self.sockets, [], [], left)
            for s in readable:
                path = self.sockets.index(s)
                try:
                    data, sender = s.recvfrom(64)
                    kind, node, seq = _DATAGRAM.unpack(data)
                    if kind == _PING:
                        s.sendto(_DATAGRAM.pack(_PONG, self.node, seq), sender)
                    elif seq in self._sent:
                        now = time.monotonic()
                        self.table.answered(node, path, now)
                        trips = self.round_trips.setdefault((node, path), deque(maxlen=_ROUND_TRIPS_KEPT))
                        trips.append(now - self._sent[seq])
                except (OSError, struct.error):
                    continue

    def _review_slow(self) -> None:
        medians = {key: statistics.median(trips) for key, trips in self.round_trips.items() if trips}
        for (node, path), others_s in slow_paths(medians).items():
            if (node, path) not in self.degraded:  # once per link and job: its round trips come and go with load
                self.degraded.add((node, path))
                self.events.emit("link_degraded", node=self.node, peer=node, path=path,
                                 interface=self.interfaces[path], round_trip_ms=round(medians[(node, path)] * 1e3, 2),
                                 other_paths_ms=round(others_s * 1e3, 2))

    def _on_change(self, what: str, node: int, path: int, seconds: float) -> None:
        where = {"node": self.node, "peer": node, "path": path, "interface": self.interfaces[path]}
        if what == "failed":
            self.events.emit("link_failure", **where)
        elif what == "recovered":
            self.events.emit("link_recovered", **where, seconds=round(seconds, 3))
        else:
            send(prefixed(self.client, self.attempt()), LinkDown(self.node, node, path, seconds))
