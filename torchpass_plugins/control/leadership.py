"""Which agent coordinates the job, and the coordinator's inbox as that agent sees it.

With node 0's ``TCPStore`` (``Sole``) the store and the coordinator live in node 0's agent: there is nothing
to elect, and losing node 0 ends the job. With etcd (``Election``) every agent is a candidate: the one
that creates the leader key, attached to a lease it renews, coordinates; when it dies, is cut off or pauses
past the lease, etcd deletes the key and another agent wins. Each term writes through a store fenced by
the leader key's creation revision, so a leader that lost its lease unnoticed cannot write once another
won: no split brain. A successor rebuilds the coordinator from the state its predecessor saved with its
last handled batch (``JournaledInbox``); the workers and agents meanwhile only wait for the next roster.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from torchpass_plugins.control.etcd_store import Deposed, EtcdStore
from torchpass_plugins.control.protocol import INBOX, Stop, encode, send

LEADER_KEY = "coordinator/leader"  # the elected agent's name, attached to its lease
STATE_KEY = "coordinator/state"  # the coordinator's state after the last batch it handled
BATCH_KEY = "coordinator/batch"  # the batch being handled: taken off the inbox, not yet reflected in the state
_POLL_S = (0.005, 0.1)  # an idle leader looks at the inbox from the first interval, doubling up to the second
_FOREVER = timedelta(days=365)

# ``lead(store, inbox)`` coordinates the job until the inbox yields ``Stop``; it writes through ``store``.
Lead = Callable[[dist.Store, "QueueInbox | JournaledInbox"], None]


class QueueInbox:
    """The inbox of a coordinator that never moves: messages are popped, one blocking wait for the first."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def predecessor_state(self) -> None:
        return None

    def take(self) -> list[bytes]:
        """The next batch: the first message to arrive and whatever waits behind it."""
        return [self.store.queue_pop(INBOX, block=True), *self.waiting()]

    def waiting(self) -> list[bytes]:
        items = []
        while self.store.queue_len(INBOX) > 0:
            items.append(self.store.queue_pop(INBOX, block=False))
        return items

    def handled(self, state: dict) -> None:
        """Nothing to save: no other agent takes over."""


class JournaledInbox:
    """The inbox of a coordinator that may move (etcd). A batch moves off the inbox into ``BATCH_KEY`` in
    one transaction, and leaves it in the same transaction that saves the coordinator's state after it. A
    successor restores that state and handles a batch left there first: the coordinator decides the same
    from the same state and messages, so what its predecessor had already published is written again,
    unchanged. Nothing is lost and nothing is decided twice in two different ways."""

    def __init__(self, store: EtcdStore, over: threading.Event) -> None:
        self.store = store
        self.over = over  # the term ended (lease lost, or the agent stops): the next ``take`` yields ``Stop``
        self._left = json.loads(store.get(BATCH_KEY)) if store.check([BATCH_KEY]) else None

    def predecessor_state(self) -> dict | None:
        return json.loads(self.store.get(STATE_KEY)) if self.store.check([STATE_KEY]) else None

    def take(self) -> list[bytes]:
        if self._left is not None:
            batch, self._left = [m.encode() for m in self._left], None
            return batch
        pause = _POLL_S[0]
        while not self.over.is_set():
            batch = self.store.queue_take(INBOX, BATCH_KEY)
            if batch:
                return batch
            self.over.wait(pause)
            pause = min(pause * 2, _POLL_S[1])
        return [encode(Stop()).encode()]

    def handled(self, state: dict) -> None:
        self.store.write({STATE_KEY: json.dumps(state).encode()}, [BATCH_KEY])


class Sole:
    """A ``TCPStore`` job: node 0's agent hosts the store and coordinates; the others never do."""

    def __init__(self, connect: Callable[[], dist.Store], leads: bool) -> None:
        self.connect = connect  # a new connection to this attempt's keys
        self.leads = leads

    def run(self, lead: Lead) -> None:
        if self.leads:
            store = self.connect()
            store.set_timeout(_FOREVER)  # the inbox wait has no deadline: ``close`` ends it
            lead(store, QueueInbox(store))

    def close(self) -> None:
        if self.leads:
            send(self.connect(), Stop())


class Election:
    """An etcd job: every agent runs one; whoever holds the leader key coordinates until its term ends.

    A term ends when the lease cannot be renewed within its time to live (etcd then deletes the key), when
    a fenced write finds another leader, when etcd is unreachable for the store's timeout, or on ``close``;
    the agent then stands again. ``ttl``: how long a silent leader keeps the job without a coordinator.
    """

    def __init__(self, store: EtcdStore, node: int, ttl: float) -> None:
        self.store = store
        self.name = f"node{node}-{uuid.uuid4().hex[:8]}"
        self.ttl = ttl
        self._closed = threading.Event()
        self._over = threading.Event()

    def run(self, lead: Lead) -> None:
        while not self._closed.is_set():
            try:
                lease = self.store.grant_lease(self.ttl)
                created = self.store.create_leased(LEADER_KEY, self.name, lease)
                if created is None:
                    self.store.revoke_lease(lease)
                    self._wait_vacancy()
                else:
                    self._term(lease, created, lead)
            except dist.DistStoreError as exc:  # no quorum for the store's timeout: stand again
                print(f"torchpass: coordinator election: {exc}", file=sys.stderr, flush=True)

    def _term(self, lease: int, created: int, lead: Lead) -> None:
        self._over = over = threading.Event()
        if self._closed.is_set():
            over.set()
        renewal = threading.Thread(target=self._renew, args=(lease, over), name="torchpass-lease", daemon=True)
        renewal.start()
        fenced = self.store.fenced(LEADER_KEY, created)
        try:
            lead(fenced, JournaledInbox(fenced, over))
        except Deposed as exc:
            print(f"torchpass: this agent no longer coordinates the job: {exc}", file=sys.stderr, flush=True)
        finally:
            over.set()
            self.store.revoke_lease(lease)  # the next leader need not wait for the lease to run out

    def _renew(self, lease: int, over: threading.Event) -> None:
        """Renew three times per time to live, on a client that gives up within one: a lease that could
        not be renewed in time has ended at etcd, and so has this term."""
        client = self.store.clone()
        client.set_timeout(timedelta(seconds=self.ttl))
        while not over.wait(self.ttl / 3):
            try:
                renewed = client.renew_lease(lease)
            except dist.DistStoreError:
                renewed = False
            if not renewed:
                print("torchpass: this agent no longer coordinates the job: its lease ended", file=sys.stderr,
                      flush=True)
                break
        over.set()

    def _wait_vacancy(self) -> None:
        while self.store.check([LEADER_KEY]) and not self._closed.wait(self.ttl / 4):
            pass

    def close(self) -> None:
        self._closed.set()
        self._over.set()


def candidacy(connect: Callable[[], dist.Store], elected: bool, node: int, ttl: float) -> Sole | Election:
    """This agent's candidacy: an ``Election`` on etcd (``elected``), else ``Sole`` (node 0 coordinates)."""
    return Election(connect(), node, ttl) if elected else Sole(connect, leads=node == 0)
