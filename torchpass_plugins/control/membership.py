"""Membership on torch's ``TCPStore``: a worker's side of the job (the keys and messages are in ``protocol``).

The coordinator (in the agent of node 0) writes rosters and assignments; workers register, beat, and
watch for the next roster.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from torchpass_plugins.control.etcd_gateway import SCHEME
from torchpass_plugins.control.etcd_store import EtcdStore, open_address
from torchpass_plugins.control.protocol import (
    ABORT_KEY,
    DONE_KEY,
    DRAIN_KEY,
    LEAVING,
    PREFIX,
    RESTART_KEY,
    Join,
    Roster,
    RosterChange,
    agent_beat_key,
    assign_key,
    heartbeat_key,
    incarnations_key,
    join_key,
    node_agent_key,
    node_lost_key,
    node_paths_key,
    reached_key,
    roster_change_key,
    roster_key,
    send,
    watch_key,
)
from torchpass_plugins.control.worker_env import WorkerEnv

if TYPE_CHECKING:
    from torchpass_plugins.control.launch_config import LaunchConfig

_POLL_S = 0.02
_ASSIGNMENT_LOOKS = (1.0, 8.0)  # a waiting worker's first look at its assignment, doubling up to the second
_CHANGES_READ = 8  # a roster more generations ahead than this is read whole, not as changes
_ROSTERS_HELD = 4
_WATCH_WAIT = timedelta(hours=1)  # a bound only: the coordinator or ``close`` ends the wait


class JobAborted(RuntimeError):
    """The coordinator gave up on the job (for example more failures than spares)."""


class Unrecoverable(JobAborted):
    """The members found that no spare can restore the lost state (e.g. a shard and its replica both lost):
    the worker hands the message to the coordinator, which stops the job with it."""


def lost_after_the_step(step: int) -> Unrecoverable:
    """A rank was lost after ``step``'s optimizer step, in a collective no other rank completed. A spare can
    enter only at a step boundary, so the collective cannot complete, and a result of fewer ranks would be
    made up (the code after it, early stopping or the best checkpoint, may act on it): the job stops (and
    restarts from its newest snapshot) instead."""
    return Unrecoverable(
        f"torchpass: a rank was lost after step {step}'s optimizer step, in a collective of what runs after it "
        "(validation, an epoch's end, evaluation) that no other rank had completed; a spare can only enter at a "
        "step boundary, so the job stops rather than go on with a result made of fewer ranks. Submit it again "
        "to resume from its newest snapshot."
    )


class JoinRejected(PermissionError):
    """The coordinator refused this worker (a wrong join token): its agent stops instead of refilling."""


def connect_store(endpoint: str, is_master: bool = False, timeout: float = 600.0) -> dist.Store:
    """Open a client (or the server, for the agent of node 0) of the job's store: ``etcd://HOST:PORT,.../ID``
    names an etcd cluster (nobody serves it), ``HOST:PORT`` node 0's TCPStore.

    The server listens on the endpoint's address only (torch's own would listen on every interface):
    ``127.0.0.1:0`` is reachable from this machine alone.
    """
    if endpoint.startswith(SCHEME):
        return open_address(endpoint, timedelta(seconds=timeout))
    host, port = endpoint.rsplit(":", 1)
    fd = None
    if is_master:
        family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)  # every worker of the job connects at its start
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store's server owns it from now on
    return dist.TCPStore(host, int(port), is_master=is_master, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=fd)


def prefixed(store: dist.Store, attempt: int = 0) -> dist.Store:
    """The keys of one attempt of the job: a restart after an abort starts over under fresh keys."""
    return under(store, f"{PREFIX}/a{attempt}")


def current_attempt(store: dist.Store) -> int:
    """The attempt the job is at: the first whose keys hold no restart."""
    attempt = 0
    while prefixed(store, attempt).check([RESTART_KEY]):
        attempt += 1
    return attempt


def serve_node(store: dist.Store, node: int, identity: str, paths: int) -> bool:
    """Make agent ``identity``, with ``paths`` network paths, the one serving ``node``; True if the job had
    written the node off and this agent brings it back (unwatched until it beats, as at the start)."""
    rejoined = store.check([node_lost_key(node)])
    if rejoined:
        store.delete_key(agent_beat_key(node))
        store.delete_key(node_lost_key(node))
    store.set(node_paths_key(node), str(paths))
    store.set(node_agent_key(node), identity)
    return rejoined


_AGENTS_DONE = "agents_done"  # /NODE: that node's agent has finished with the store


def finished_with_store(store: dist.Store, node: int) -> None:
    store.set(f"{_AGENTS_DONE}/{node}", "1")


def wait_for_agents(store: dist.Store, nnodes: int, timeout: float = 60.0) -> None:
    """Node 0 hosts the store: keep it up until every agent not written off as lost has finished with it."""
    deadline = time.monotonic() + timeout
    waiting = set(range(nnodes))
    while waiting and time.monotonic() < deadline:
        waiting = {n for n in waiting
                   if not store.check([f"{_AGENTS_DONE}/{n}"]) and not store.check([node_lost_key(n)])}
        time.sleep(0.05)


def next_incarnation(store: dist.Store, node: int, slot: int) -> int:
    """The next worker's incarnation in a slot, counted over the whole job: a name is never used twice."""
    return int(under(store, PREFIX).add(incarnations_key(node, slot), 1)) - 1


def under(store: dist.Store, prefix: str) -> dist.Store:
    """``store``'s keys under ``prefix``. An etcd store makes a store of its own: torch's ``PrefixStore``
    would hide its queue, which torch does not forward to a store written in Python."""
    return store.under(prefix) if isinstance(store, EtcdStore) else dist.PrefixStore(prefix, store)


class StoreUnusable(RuntimeError):
    """An agent cannot use the job's store; the message says what to change."""


def open_job_store(cfg: LaunchConfig) -> tuple[dist.Store, str]:
    """An agent's client of the job's store (node 0's agent serves a TCPStore), and the address its workers
    reach it at. An etcd store that already holds an ended run's keys under this name is refused: a new
    run would read them as its own."""
    try:
        store = connect_store(cfg.store_address or cfg.rdzv_endpoint, timeout=cfg.rdzv_timeout,
                              is_master=cfg.node_rank == 0 and not cfg.external_store)
    except (dist.DistError, OSError) as exc:
        raise StoreUnusable(
            f"no store at {cfg.rdzv_endpoint} within {cfg.rdzv_timeout:g} s ({str(exc).splitlines()[0]}): start "
            "node 0's agent first, and check --rdzv-endpoint and that this node can reach it (node 0: that HOST "
            "is one of its addresses and PORT is free)") from exc
    if cfg.store_address is None:
        return store, f"{cfg.rdzv_endpoint.rsplit(':', 1)[0]}:{store.port}"
    first = prefixed(store)
    if any(first.check([key]) for key in (DONE_KEY, ABORT_KEY, RESTART_KEY)):
        raise StoreUnusable(f"{cfg.store_address} holds an ended run's keys; use a new --rdzv-id")
    return store, cfg.store_address


def _die_with_agent(agent: int) -> None:
    """Ask Linux for SIGKILL when the agent (pid ``agent``) dies, so no worker outlives its supervisor."""
    if agent and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != agent:  # the agent died before we asked
            os._exit(1)


@dataclass
class Member:
    """A worker's view of the job: registration, heartbeat, assignment and the roster watch."""

    env: WorkerEnv
    store: dist.Store = field(init=False)
    gen: int = field(init=False, default=-1)
    latest_gen: int = field(init=False, default=-1)
    changed: threading.Event = field(init=False, default_factory=threading.Event)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    drain_notice: dict | None = field(init=False, default=None)  # the planned migration not yet carried out
    _drained_id: int = field(init=False, default=0)
    _threads: list[threading.Thread] = field(init=False, default_factory=list)
    _rosters: dict[int, Roster] = field(init=False, default_factory=dict)  # the last few read

    def __post_init__(self) -> None:
        self._client = connect_store(self.env.store)
        self.store = prefixed(self._client, self.env.attempt)

    def thread_store(self) -> dist.Store:
        """A connection of its own, for a thread: one client serves one blocking operation at a time."""
        return prefixed(self._client.clone(), self.env.attempt)

    def reached_before_restart(self) -> int | None:
        """The most optimizer steps any rank had applied when the previous attempt was aborted."""
        if self.env.attempt == 0:
            return None
        previous = prefixed(self._client, self.env.attempt - 1)
        keys = [reached_key(r) for r in range(self.env.world_size)]
        reached = [int(previous.get(k)) for k in keys if previous.check([k])]
        return max(reached) if reached else None

    def join(self) -> None:
        _die_with_agent(self.env.agent_pid)
        self.store.set(join_key(self.env.worker_id), self.env.token)
        send(self.store, Join(self.env.worker_id))
        self.store.add(heartbeat_key(self.env.worker_id), 1)  # from now on the agent's hang check applies
        self._start(self._beat, "torchpass-heartbeat")

    def wait_assignment(self, idle: Callable[[], None] = lambda: None) -> dict:
        """Block until the coordinator assigns this worker a logical rank (spares wait here), calling
        ``idle`` between looks. The wait is the store's own (the assignment's write wakes it, or the job's end:
        the coordinator then tells every waiting spare to exit), in looks of ``_ASSIGNMENT_LOOKS`` seconds,
        doubling: a spare that waits all job long costs the store a few requests per 8 s, not a poll, which at
        thousands of spares on etcd is the difference between a light and a saturated cluster. Between looks
        it checks the job's end itself, for a worker that registers after the end (a refill started just
        before it), which no one tells."""
        key = assign_key(self.env.worker_id)
        look, longest = _ASSIGNMENT_LOOKS
        while True:
            if self.store.check([DONE_KEY]):
                return {"exit": self.store.get(DONE_KEY).decode()}
            try:
                self.store.wait([key], timedelta(seconds=look))
                return json.loads(self.store.get(key))
            except dist.DistStoreError:  # not yet
                pass
            idle()
            if self._stop.is_set():
                raise InterruptedError(key)
            look = min(2 * look, longest)

    def change(self, gen: int) -> RosterChange:
        """What roster ``gen`` changed (what a worker needs once a roster is published)."""
        return RosterChange.from_json(self.store.get(roster_change_key(gen)))

    def roster(self, gen: int) -> Roster:
        """Roster ``gen``: from the newest one held before it and the changes since where there is one, else
        read whole (a world's worth of names, read once)."""
        held = dict(self._rosters)  # read from the training thread and the step signals' thread
        if gen in held:
            return held[gen]
        before = [g for g in held if gen - _CHANGES_READ <= g < gen]
        if before:
            roster = held[max(before)]
            while roster.gen < gen:
                roster = roster.changed_by(self.change(roster.gen + 1))
        else:
            roster = Roster.from_json(self.store.get(roster_key(gen)))
        held[gen] = roster
        self._rosters = {g: held[g] for g in sorted(held)[-_ROSTERS_HELD:]}
        return roster

    def watch_from(self, gen: int) -> None:
        """Start (once) a thread that wakes ``changed`` whenever roster ``gen + 1``, ``gen + 2``... appears."""
        self.gen = self.latest_gen = gen
        if not any(t.name == "torchpass-watch" for t in self._threads):
            self._start(self._watch, "torchpass-watch")

    def _watch(self) -> None:
        """Blocks in the store (no polling) until the coordinator flags the next roster for this worker."""
        store = self.thread_store()
        while True:
            key = watch_key(self.env.worker_id, self.latest_gen + 1)
            try:
                store.wait([key], _WATCH_WAIT)
            except dist.DistStoreError:
                continue
            if self._stop.is_set():
                return
            self.latest_gen += 1
            self.changed.set()

    def _beat(self) -> None:
        """Heartbeats; and on the same connection, whether the coordinator asked for a planned migration
        (one key check per beat: off the training thread, which reads only ``drain_notice``)."""
        store = self.thread_store()
        key = heartbeat_key(self.env.worker_id)
        while not self._stop.wait(self.env.heartbeat_interval):
            store.add(key, 1)
            if self.drain_notice is None and store.check([DRAIN_KEY]):
                notice = json.loads(store.get(DRAIN_KEY))  # never deleted: no wait
                if notice["id"] > self._drained_id:
                    self.drain_notice = notice

    def drain_carried_out(self) -> None:
        """Forget the notice (carried out, or found stale)."""
        if self.drain_notice is not None:
            self._drained_id, self.drain_notice = self.drain_notice["id"], None

    def _start(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def wait_newer_than(self, gen: int) -> None:
        """Block until a roster newer than ``gen`` is published (a peer failed; the coordinator decides)."""
        while self.latest_gen <= gen:
            self.changed.wait(_POLL_S)
            self.changed.clear()

    def close(self) -> None:
        """Stop the threads before the interpreter exits (a thread inside C++ at exit aborts the process)."""
        if not self._stop.is_set():
            self.store.add(heartbeat_key(self.env.worker_id), LEAVING)
        self._stop.set()
        self.store.set(watch_key(self.env.worker_id, self.latest_gen + 1), b"closing")  # ends the watch
        for t in self._threads:
            t.join(timeout=2)
