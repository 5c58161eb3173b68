"""The job's store on etcd v3: a ``torch.distributed.Store`` whose keys live in a replicated, consensus
store, so that they outlive any one node (the embedded ``TCPStore`` lives in node 0's agent).

It reaches the members through ``etcd_gateway``: an operation that no member can serve (no quorum) is
retried until the store's timeout, so nothing is decided without a quorum. Atomic operations (``add``,
``compare_set``, the queue) are etcd transactions that compare a key's revision, retried on a race.
``torch.distributed`` takes it as any store: process groups rendezvous through it, under a ``PrefixStore``.
An ``add`` whose reply is lost after etcd applied it (a member failing mid-request) is retried and
counts twice. Each write is a revision of etcd's history: run etcd with ``--auto-compaction-retention``.
Keep a Python reference to it while torch uses it: torch holds only its C++ side, and once the Python
object is collected every call fails with torch's "Not implemented".
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from torchpass_plugins.control.etcd_gateway import NO_CREDENTIALS, RETRY_S, Credentials, Gateway, parse

_POLL_S = (0.005, 0.1)  # a blocking queue pop polls from the first interval, doubling up to the second
_WATCH_ROUND_S = 10.0  # the longest a wait listens to one member before it looks again (see ``wait``)
_TXN_OPS = 128  # etcd's default --max-txn-ops


def open_address(store_address: str, timeout: timedelta) -> EtcdStore:
    """A client of the job's keys at ``store_address``, once some member answers (else ``DistStoreError``)."""
    members, name, credentials = parse(store_address)
    store = EtcdStore(members, prefix=f"torchpass/{name}", timeout=timeout, credentials=credentials)
    store.check(["reachable"])
    return store


class Deposed(RuntimeError):
    """A fenced write found that its writer no longer holds the key it is fenced by (another leads now)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """Keys under ``prefix`` in the etcd cluster at ``endpoints`` (``host:port`` of its client URLs)."""

    def __init__(self, endpoints: list[str], prefix: str = "torchpass", timeout: timedelta = timedelta(seconds=300),
                 credentials: Credentials = NO_CREDENTIALS) -> None:
        super().__init__()
        self._gateway = Gateway(endpoints, credentials)
        self._prefix = prefix.encode().rstrip(b"/") + b"/"
        self._fence: list[dict] = []  # compared by every write (see ``fenced``)
        self.set_timeout(timeout)

    def clone(self) -> EtcdStore:
        """Another client of the same keys (each thread of torchpass takes its own, as with a TCPStore)."""
        return self.under("")

    def under(self, prefix: str) -> EtcdStore:
        """A client of the keys under ``prefix`` (torch's ``PrefixStore`` would hide the queue methods)."""
        path = self._prefix.decode() + prefix if prefix else self._prefix[:-1].decode()
        store = EtcdStore(self._gateway.endpoints, path, self.timeout, self._gateway.credentials)
        store._fence = self._fence
        return store

    def fenced(self, key: str, created: int) -> EtcdStore:
        """A client whose every write is applied only while ``key`` is the one created at revision ``created``
        (the leader key it won), and otherwise raises ``Deposed``: a leader that lost its lease unnoticed (cut
        off, paused) cannot write once another has won, whatever its clock says."""
        store = self.under("")
        store._fence = [{"key": _b64(self._key(key)), "target": "CREATE", "result": "EQUAL",
                         "create_revision": str(created)}]
        return store

    def _call(self, path: str, body: dict) -> dict:
        return self._gateway.call(path, body, self.timeout)

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _range(self, key: str) -> dict | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(self._key(key))}).get("kvs")
        return kvs[0] if kvs else None

    def _txn(self, compare: list[dict], success: list[dict]) -> bool:
        """One transaction, fenced: whether ``compare`` held (``success`` applied). Raises ``Deposed`` when
        the fence does not hold."""
        reply = self._call("/v3/kv/txn", {"compare": compare + self._fence, "success": success})
        if reply.get("succeeded"):
            return True
        if self._fence and not self._call("/v3/kv/txn", {"compare": self._fence}).get("succeeded"):
            raise Deposed(f"etcd: {base64.b64decode(self._fence[0]['key']).decode()} is no longer this writer's")
        return False

    def _put_if(self, key: str, revision: int, value: bytes) -> bool:
        """Put ``value`` if ``key``'s last change is ``revision`` (0: if it does not exist)."""
        k = _b64(self._key(key))
        compare = {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}
        return self._txn([compare], [{"request_put": {"key": k, "value": _b64(value)}}])

    def _put(self, key: str, value: bytes) -> dict:
        return {"request_put": {"key": _b64(self._key(key)), "value": _b64(value)}}

    def _delete(self, key: str) -> dict:
        return {"request_delete_range": {"key": _b64(self._key(key))}}

    # -- torch.distributed.Store --------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._txn([], [self._put(key, _bytes(value))])

    def get(self, key: str) -> bytes:
        self.wait([key])
        return base64.b64decode(self._range(key)["value"])

    def add(self, key: str, amount: int) -> int:
        if amount == 0:  # a read: no write, no new revision (counters are read this way every beat)
            kv = self._range(key)
            return int(base64.b64decode(kv["value"])) if kv else 0
        while True:
            kv = self._range(key)
            value = int(base64.b64decode(kv["value"]) if kv else 0) + amount
            if self._put_if(key, int(kv["mod_revision"]) if kv else 0, str(value).encode()):
                return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As ``TCPStore``: ``desired`` if the key held ``expected`` (or was absent and ``expected`` is
        empty); else the key's value, or ``expected`` for an absent key."""
        expected, desired = _bytes(expected), _bytes(desired)
        while True:
            kv = self._range(key)
            current = base64.b64decode(kv["value"]) if kv else None
            if current is None and expected:
                return expected
            if current is not None and current != expected:
                return current
            if self._put_if(key, int(kv["mod_revision"]) if kv else 0, desired):
                return desired

    def check(self, keys: list[str]) -> bool:
        return all(self._range(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key exists; a ``timeout`` of zero waits without limit, as c10d's stores do. A missing key
        is watched (etcd pushes its creation), not polled: a waiting member costs the cluster one request per
        ``_WATCH_ROUND_S``."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + (timeout.total_seconds() or float("inf"))
        for key in keys:
            while True:
                reply = self._call("/v3/kv/range", {"key": _b64(self._key(key)), "keys_only": True})
                if reply.get("kvs"):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(f"etcd: wait timeout for {keys} after {timeout}")
                began, seconds = time.monotonic(), min(left, _WATCH_ROUND_S)
                if not self._gateway.watch_for_put(_b64(self._key(key)), int(reply["header"]["revision"]) + 1, seconds):
                    time.sleep(max(0.0, min(RETRY_S, began + seconds - time.monotonic())))  # no hot loop

    def delete_key(self, key: str) -> bool:
        if self._fence:
            existed = self.check([key])
            return self._txn([], [self._delete(key)]) and existed
        return int(self._call("/v3/kv/deleterange", {"key": _b64(self._key(key))}).get("deleted", 0)) > 0

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set many keys in a few transactions (``_TXN_OPS`` puts each, etcd's default limit): a roster's
        wake-ups cost a request per ``_TXN_OPS`` members rather than one each. Not atomic as a whole."""
        puts = [self._put(k, _bytes(v)) for k, v in zip(keys, values, strict=True)]
        for first in range(0, len(puts), _TXN_OPS):
            self._txn([], puts[first:first + _TXN_OPS])

    def write(self, puts: dict[str, bytes], deletes: list[str]) -> None:
        """Put and delete keys in one transaction: all of them or none."""
        self._txn([], [self._put(k, v) for k, v in puts.items()] + [self._delete(k) for k in deletes])

    def num_keys(self) -> int:
        end = self._prefix[:-1] + bytes([self._prefix[-1] + 1])
        reply = self._call("/v3/kv/range", {"key": _b64(self._prefix), "range_end": _b64(end), "count_only": True})
        return int(reply.get("count", 0))

    # -- a queue with one consumer (the coordinator's inbox) -----------------------------------------------
    def queue_push(self, key: str, value: str | bytes) -> None:
        """One put under a name of its own: safe to retry, and no gap a lost writer could leave."""
        self.set(f"{key}/item/{uuid.uuid4().hex}", value)

    def _items(self, key: str, **options) -> dict:
        start = self._key(f"{key}/item/")
        end = start[:-1] + bytes([start[-1] + 1])
        return self._call("/v3/kv/range", {"key": _b64(start), "range_end": _b64(end), **options})

    def queue_len(self, key: str) -> int:
        return int(self._items(key, count_only=True).get("count", 0))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item (by when it was written); waits for one (up to the store's timeout) if ``block``."""
        deadline = time.monotonic() + (self.timeout.total_seconds() or float("inf"))
        pause = _POLL_S[0]
        while True:
            kvs = self._items(key, sort_order="ASCEND", sort_target="CREATE", limit=1).get("kvs")
            if kvs:
                self._txn([], [{"request_delete_range": {"key": kvs[0]["key"]}}])
                return base64.b64decode(kvs[0]["value"])
            if not block:
                raise dist.DistStoreError(f"etcd: queue {key} is empty")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"etcd: queue {key} stayed empty for {self.timeout}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])

    def queue_take(self, key: str, into: str, limit: int = 100) -> list[bytes]:
        """Move the oldest items of queue ``key`` (up to ``limit``: one transaction stays under etcd's
        128 operations) into one JSON list at ``into``, atomically; ``[]`` if the queue is empty. A consumer
        that dies before it is done with them leaves them at ``into`` for the next one."""
        kvs = self._items(key, sort_order="ASCEND", sort_target="CREATE", limit=limit).get("kvs") or []
        if not kvs:
            return []
        items = [base64.b64decode(kv["value"]) for kv in kvs]
        taken = json.dumps([item.decode() for item in items]).encode()
        self._txn([], [self._put(into, taken)] + [{"request_delete_range": {"key": kv["key"]}} for kv in kvs])
        return items

    # -- leases (the coordinator's leadership) ----------------------------------------------------------------
    def grant_lease(self, ttl: float) -> int:
        """A lease that etcd ends ``ttl`` seconds (at least one) after its last renewal."""
        return int(self._call("/v3/lease/grant", {"TTL": max(1, round(ttl))})["ID"])

    def renew_lease(self, lease: int) -> bool:
        """Renew ``lease``; False if it already ended."""
        reply = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0)) > 0

    def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now; the keys attached to it go with it."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)})
        except dist.DistStoreError:  # already ended
            pass

    def create_leased(self, key: str, value: str | bytes, lease: int) -> int | None:
        """Create ``key``, attached to ``lease``, unless it exists: the revision that created it, else None."""
        k = _b64(self._key(key))
        reply = self._call("/v3/kv/txn", {
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": _b64(_bytes(value)), "lease": str(lease)}}]})
        return int(reply["header"]["revision"]) if reply.get("succeeded") else None
