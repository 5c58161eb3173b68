"""The process group of one generation, with waits that a newer roster can break.

A gloo collective whose peer died may block the survivors until the group's timeout, and neither
``abort()`` nor ``destroy_process_group()`` from another thread unblocks it. So every operation here is
issued asynchronously and waited on in short slices (``Work.wait(timeout)`` gives up without touching the
operation): the wait ends as soon as the work completes *or* the member's roster watch reports a newer
generation. The waiting thread sleeps in gloo's own condition variable, so a completed operation wakes it
directly, with no helper thread or Python callback in between (gloo send/recv are the exception: see
:meth:`Transport.wait`). The stuck group is abandoned; its own timeout fires later, harmlessly, as a
backstop.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpass_plugins.membership import Member

_TICK = 0.05
_SLICE = timedelta(seconds=_TICK)


class PeerFailure(RuntimeError):
    """A collective could not complete in this generation: a peer died or a newer roster exists."""


class Transport:
    """Gloo process group of the member's current generation (rank = logical rank)."""

    def __init__(self, member: Member, timeout: timedelta, name: str = "pg") -> None:
        self.member = member
        self.name = name  # store prefix: groups of the same generation with other names are independent
        self.timeout = timeout
        self.pg: dist.ProcessGroup | None = None
        self.gen = -1
        self.rank = -1
        self.world_size = member.env.world_size
        self._escaped: list = []  # completion futures of operations that may still be pending (see _retire)
        self.waited = 0.0  # seconds spent waiting for operations so far (straggler detection subtracts it)

    def stale(self) -> bool:
        return self.member.latest_gen > self.gen

    def connect(self, gen: int, rank: int) -> None:
        """Join the group of generation ``gen``; raises ``PeerFailure`` if an even newer one appears."""
        # Its own connection: a rendezvous abandoned for a newer roster may block in the store for long,
        # and a store client serves one blocking operation at a time.
        store = dist.PrefixStore(f"{self.name}/{gen}", self.member.thread_store())
        result: Future = Future()

        def build() -> None:
            try:
                result.set_result(dist.ProcessGroupGloo(store, rank, self.world_size, self.timeout))
            except Exception as exc:  # handed over to the waiting thread
                result.set_exception(exc)

        self._retire(self.pg)
        self.gen, self.rank, self.pg = gen, rank, None
        threading.Thread(target=build, name=f"torchpass-connect-{self.name}-{gen}", daemon=True).start()
        self.pg = self._wait_future(result, f"connect generation {gen}")

    def track(self, work: dist.Work) -> None:
        """An operation issued but waited for elsewhere (or never, if a recovery comes first)."""
        self._escaped = [f for f in self._escaped if not f.done()]
        self._escaped.append(_completion(work))

    def _retire(self, pg: dist.ProcessGroup | None) -> None:
        """Drop a replaced group. If one of its operations is still pending (escaped from a wait, or
        issued and never waited for), its destructor would join a thread stuck with a dead peer, so the
        group is kept alive for good instead; closing the groups of the other survivors is what makes
        such an operation fail and its thread end."""
        self._escaped = [f for f in self._escaped if not f.done()]
        if pg is not None and self._escaped:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))

    def close(self) -> None:
        """Drop the group (its gloo threads end now); only once :meth:`drain` found nothing pending."""
        self.pg = None

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for operations left in replaced groups; True when none is pending."""
        deadline = time.monotonic() + timeout
        while any(not f.done() for f in self._escaped) and time.monotonic() < deadline:
            time.sleep(_TICK)
        return all(f.done() for f in self._escaped)

    def wait(self, work: dist.Work, what: str) -> None:
        """Block until ``work`` is done; ``PeerFailure`` if it failed or a newer roster replaced the group."""
        try:
            work.get_future()
        except RuntimeError:  # gloo send/recv: no future, and a timed-out wait would close the connection
            self.wait_all([work], what)
            return
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    work.wait(_SLICE)  # a collective's timed-out wait leaves the operation running
                    return
                except Exception:
                    if work.is_completed():  # failed: the plain wait below raises its own error
                        break
                if self.stale():
                    self._escaped.append(work.get_future())
                    raise PeerFailure(f"{what}: generation {self.member.latest_gen} replaced {self.gen}")
            try:
                work.wait()
            except Exception as exc:
                raise PeerFailure(f"{what}: {exc}") from exc
        finally:
            self.waited += time.perf_counter() - t0

    def wait_all(self, works: list[dist.Work], what: str) -> None:
        """Like :meth:`wait` for several works (send/recv too): one helper thread waits for them in turn."""
        t0 = time.perf_counter()
        try:
            self._wait_future(_waited_in_thread(works), what)
        finally:
            self.waited += time.perf_counter() - t0

    def _wait_future(self, fut: Future, what: str):
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        while not done.wait(_TICK):
            if self.stale():
                self._escaped.append(fut)
                raise PeerFailure(f"{what}: generation {self.member.latest_gen} replaced {self.gen}")
        try:
            return fut.result()
        except Exception as exc:
            raise PeerFailure(f"{what}: {exc}") from exc

    # -- operations (each blocks until done or until a failure is known) -------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, what: str = "all_reduce") -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.wait(self.pg.allreduce([tensor], opts), what)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.wait(self.pg.broadcast([tensor], opts), "broadcast")

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.wait(self.pg.allgather([out], [tensor]), "all_gather")
        return out

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def wait_for_all(self, name: str) -> None:
        """A barrier with no time limit, for ranks that wait while one of them works alone for as long as
        it takes (``prepare_data`` downloading a data set): a mark per rank in the job's store, polled, and
        escaped like every wait when a newer roster replaces this group."""
        store, prefix = self.member.store, f"torchpass/wait_for_all/{self.gen}/{name}/"
        store.set(f"{prefix}{self.rank}", b"1")
        marks = [f"{prefix}{r}" for r in range(self.world_size)]
        while not store.check(marks):
            if self.stale():
                raise PeerFailure(f"{name}: generation {self.member.latest_gen} replaced {self.gen}")
            time.sleep(_TICK)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.wait(self.pg.send([tensor], dst, tag), "send")

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.wait(self.pg.recv([tensor], src, tag), "recv")

    def send_many(self, tensors: Iterable[torch.Tensor], dst: int, tag: int = 0) -> None:
        """Send ``tensors`` in order, all posted at once (gloo streams them back to back); waits for all."""
        self.wait_all(self._post(self.pg.send, tensors, dst, tag), "send")

    def recv_many(self, tensors: Iterable[torch.Tensor], src: int, tag: int = 0) -> None:
        """Receive into ``tensors`` in order (matching :meth:`send_many`), all posted at once; waits for
        all. ``tensors`` may be a generator: each receive is posted as soon as its tensor is made, while
        the earlier ones stream."""
        self.wait_all(self._post(self.pg.recv, tensors, src, tag), "recv")

    def _post(self, op, tensors: Iterable[torch.Tensor], peer: int, tag: int) -> list[dist.Work]:
        works: list[dist.Work] = []
        try:
            for tensor in tensors:
                works.append(op([tensor], peer, tag))
        except Exception:
            for work in works:  # posted, never to be waited for here
                self.track(work)
            raise
        return works


def _completion(work: dist.Work):
    """A future that is done once ``work`` is (gloo send/recv have none of their own: a helper thread's)."""
    try:
        return work.get_future()
    except RuntimeError:
        return _waited_in_thread([work])


def _waited_in_thread(works: list[dist.Work]) -> Future:
    """A future that a helper thread completes once every work is done (or fails with the first error)."""
    fut: Future = Future()

    def wait_works() -> None:
        try:
            for work in works:
                work.wait()
            fut.set_result(None)
        except Exception as exc:  # handed over to the waiting thread
            fut.set_exception(exc)

    threading.Thread(target=wait_works, name="torchpass-wait", daemon=True).start()
    return fut
