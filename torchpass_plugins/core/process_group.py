"""One process group whose members can change under it: rebuilt per generation, at fixed logical ranks.

:class:`ReconfigurableGroup` is the only group the package communicates through. Each generation (a
roster published by the coordinator) gets fresh backend groups under a new store prefix, built by one
:class:`~torchpass_plugins.core.backends.Backend` per device type (gloo for CPU tensors, NCCL for CUDA
tensors), so logical rank = backend rank in every generation and a spare takes a lost rank's number.

A collective whose peer died may block the survivors until the backend's timeout, and for gloo neither
``abort()`` nor ``destroy_process_group()`` from another thread unblocks it. So every operation is issued
asynchronously and waited on in short slices: the wait ends as soon as the work completes *or* the
member's roster watch reports a newer generation (then :class:`PeerFailure`). Gloo's work (CUDA tensors it
carries too) is waited for in slices or on a waiter thread; NCCL's is polled through its CUDA events, so
the host waits for that work, never for the whole device. The stuck generation is aborted (:meth:`abort`)
or, where its backend cannot abort, abandoned; its own timeout fires later, harmlessly, as a backstop.

The blocking verbs (``all_reduce``, ``broadcast_from``, ``send_many`` ...) are what the protocol uses;
the ``torch.distributed.ProcessGroup`` methods issue on the current generation and return its ``Work``,
for the failure-semantics wrappers in :mod:`torchpass_plugins.core.default_group`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpass_plugins.control.membership import Member, under
from torchpass_plugins.core.backends import AbortHung, Backend, GlooBackend, abort_within
from torchpass_plugins.core.waits import completion, waited_in_thread
from torchpass_plugins.errors import ConfigError

_TICK = 0.05
_SLICE = timedelta(seconds=_TICK)
_POLL_S = 0.0002  # between ``is_completed()`` queries of CUDA work: a few microseconds of host time each


class PeerFailure(RuntimeError):
    """A collective could not complete in this generation: a peer died or a newer roster exists."""


def generation_error(built: bool, gen: int, latest_gen: int, failure: str | None) -> str | None:
    """Why a generation's group is unusable (not built, a newer roster, a failure it saw); None if usable."""
    if not built:
        return "no group built yet"
    if latest_gen > gen:
        return f"generation {latest_gen} replaced {gen}"
    return failure


class ReconfigurableGroup(dist.ProcessGroup):
    """The member's process group, at its logical rank, in the current generation."""

    def __init__(self, member: Member, timeout: timedelta, name: str = "pg") -> None:
        # c10d never sees this group (the default group wraps it): its C++ rank stays 0; ``rank`` is the logical one
        super().__init__(0, member.env.world_size)
        self.member = member
        self.name = name  # store prefix: groups of the same generation with other names are independent
        self.timeout = timeout
        self.backends: dict[str, Backend] = {"cpu": GlooBackend(tuple(member.env.interfaces))}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._stores: dict[tuple[int, str], dist.Store] = {}  # each group's store, by generation and device
        self.gen = -1
        self.path = 0  # the generation's network path (``control/links.py``)
        self.rank = -1  # an attribute here (over c10d's rank()): the wrappers answer c10d
        self.world_size = member.env.world_size
        self._failure: str | None = None  # what failed in this generation (it cannot be used again)
        self._escaped: list = []  # completion futures of operations that may still be pending (see abort)
        self._on_device: dict[int, dist.Work] = {}  # issued NCCL work, polled rather than waited in slices
        self.waited = 0.0  # seconds spent waiting for operations so far (straggler detection subtracts it)

    # -- identity ---------------------------------------------------------------------------------------
    def size(self) -> int:
        return self.world_size

    def getBackendName(self) -> str:
        return "+".join(b.name for b in self.backends.values())

    # -- generations ------------------------------------------------------------------------------------
    def use_backend(self, backend: Backend) -> None:
        """Communicate tensors of ``backend.device`` through ``backend`` (from the current generation on)."""
        self.backends[backend.device] = backend
        if self.built():
            self._groups[backend.device] = self._build(backend, self.gen, self.rank, self.member.thread_store())

    def _build(self, backend: Backend, generation: int, rank: int, client: dist.Store) -> dist.ProcessGroup:
        """``backend``'s group of ``generation`` under keys of its own; the store stays referenced (etcd's)."""
        store = under(client, f"{self.name}/{generation}/{backend.device}")
        kept = {k: v for k, v in self._stores.items() if k[0] >= generation - 1}  # the live generation's too
        self._stores = {**kept, (generation, backend.device): store}
        return backend.build(store, rank, self.world_size, self.timeout, path=self.path)

    def built(self) -> bool:
        """Whether the current generation's groups exist (they may have failed since)."""
        return bool(self._groups)

    def stale(self) -> bool:
        return self.member.latest_gen > self.gen

    def errored(self) -> str | None:
        """Why this generation's group cannot be used (a failure seen, a newer roster, none built); else None."""
        return generation_error(self.built(), self.gen, self.member.latest_gen, self._failure)

    def check(self) -> None:
        """Raise ``PeerFailure`` if this generation's group cannot be used (:meth:`errored`)."""
        why = self.errored()
        if why is not None:
            raise PeerFailure(why)

    def configure(self, generation: int, rank: int, path: int = 0) -> None:
        """Abort the current generation and join ``generation`` at ``rank`` on network ``path`` (the roster's,
        ``control/links.py``); ``PeerFailure`` if an even newer one appears meanwhile. Where the old generation
        cannot be aborted in time, this process leaves (exit status 1): a spare then takes its rank."""
        try:
            self.abort()
        except AbortHung as exc:
            print(f"{exc}; leaving the job so that a spare takes rank {self.rank}", file=sys.stderr, flush=True)
            os._exit(1)
        result: Future = Future()
        # Its own connection: a rendezvous abandoned for a newer roster may block in the store for long,
        # and a store client serves one blocking operation at a time.
        client = self.member.thread_store()

        def build() -> None:
            try:
                result.set_result({device: self._build(backend, generation, rank, client)
                                   for device, backend in self.backends.items()})
            except Exception as exc:  # handed over to the waiting thread
                result.set_exception(exc)

        self.gen, self.rank, self.path, self._failure = generation, rank, path, None
        threading.Thread(target=build, name=f"torchpass-connect-{self.name}-{generation}", daemon=True).start()
        self._groups = self._wait_future(result, f"connect generation {generation}")

    def abort(self) -> None:
        """End the current generation, which is being replaced (a peer may have died): every backend aborts
        its group within its deadline, then lets it go as it finds safe (:meth:`Backend.retire`). Raises
        :class:`~torchpass_plugins.core.backends.AbortHung` if a backend's abort does not return in time:
        only leaving the process frees it."""
        groups = self._end()
        self._escaped = [f for f in self._escaped if not f.done()]
        for device, pg in groups.items():
            self.backends[device].retire(pg, pending=bool(self._escaped))

    def release(self) -> None:
        """At the process's end, every peer done: end the current generation and let its groups go (gloo's
        threads end as its groups are dropped)."""
        self._end()

    def _end(self) -> dict[str, dist.ProcessGroup]:
        groups, self._groups = self._groups, {}
        self._on_device.clear()
        for device, pg in groups.items():
            if self.backends[device].can_abort:
                abort_within(self.backends[device], pg)
        return groups

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for operations left in replaced groups; True when none is pending."""
        deadline = time.monotonic() + timeout
        while any(not f.done() for f in self._escaped) and time.monotonic() < deadline:
            time.sleep(_TICK)
        return all(f.done() for f in self._escaped)

    # -- torch.distributed.ProcessGroup: issue on the current generation, return its Work ---------------
    def _issue(self, tensors: list[torch.Tensor], op: str, *args) -> dist.Work:
        self.check()
        device = tensors[0].device.type if tensors else "cpu"
        own_backend = device != "cpu" and device in self._groups
        group = self._groups[device if own_backend else "cpu"]  # gloo carries CUDA tensors too
        try:
            work = getattr(group, op)(*args)
        except RuntimeError as exc:  # the backend refused it (NCCL: a communicator its watchdog aborted)
            raise self._fail(op, exc) from exc
        if own_backend:  # its events say when it is done; gloo's do not (its reduce-scatter's never completes)
            self._on_device[id(work)] = work
        return work

    def on_device(self, work: dist.Work) -> bool:
        """Whether ``work`` is NCCL's, whose ``wait`` only orders streams (gloo's blocks, CUDA tensors too)."""
        return id(work) in self._on_device

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        return self._issue(tensors, "allreduce", tensors, opts or dist.AllreduceOptions())

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        return self._issue(tensors, "broadcast", tensors, opts or dist.BroadcastOptions())

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        return self._issue(inputs, "allgather", outputs, inputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        return self._issue([input], "_allgather_base", output, input)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        return self._issue([input], "_reduce_scatter_base", output, input, opts or dist.ReduceScatterOptions())

    def gather(self, outputs, inputs: list[torch.Tensor], opts=None) -> dist.Work:
        return self._issue(inputs, "gather", outputs, inputs, opts or dist.GatherOptions())

    def scatter(self, outputs: list[torch.Tensor], inputs, opts=None) -> dist.Work:
        return self._issue(outputs, "scatter", outputs, inputs, opts or dist.ScatterOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._issue(tensors, "send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._issue(tensors, "recv", tensors, src, tag)

    def barrier(self, opts=None) -> dist.Work:
        return self.allreduce([torch.zeros(1)])

    # -- escapable waits --------------------------------------------------------------------------------
    def track(self, work: dist.Work) -> None:
        """An operation issued but waited for elsewhere (or never, if a recovery comes first)."""
        self._escaped = [f for f in self._escaped if not f.done()]
        self._escaped.append(completion(work))

    def _fail(self, what: str, why: object) -> PeerFailure:
        self._failure = f"{what}: {why}"
        return PeerFailure(self._failure)

    def wait(self, work: dist.Work, what: str) -> None:
        """Block until ``work`` is done; ``PeerFailure`` if it failed or a newer roster replaced the group."""
        t0 = time.perf_counter()
        try:
            if self._on_device.pop(id(work), None) is not None:
                self._poll(work, what)
                return
            try:
                work.get_future()
            except RuntimeError:  # gloo send/recv: no future, and a timed-out wait would close the connection
                self._wait_future(waited_in_thread([work]), what)
                return
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
                raise self._fail(what, exc) from exc
        finally:
            self.waited += time.perf_counter() - t0

    def _poll(self, work: dist.Work, what: str) -> None:
        """CUDA work: done when its events say so (no host sync); then ``wait()`` orders the current stream
        after it and raises the backend's error, if any."""
        while not work.is_completed():
            if self.stale():
                self.track(work)
                raise PeerFailure(f"{what}: generation {self.member.latest_gen} replaced {self.gen}")
            time.sleep(_POLL_S)
        try:
            work.wait()
        except Exception as exc:
            raise self._fail(what, exc) from exc

    def wait_all(self, works: list[dist.Work], what: str) -> None:
        """Like :meth:`wait` for several works, in turn."""
        if any(id(w) in self._on_device for w in works):
            for w in works:
                self.wait(w, what)
            return
        t0 = time.perf_counter()
        try:
            self._wait_future(waited_in_thread(works), what)
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
        except ConfigError:
            raise  # (a group this node cannot build on any try: the job stops, naming the setting)
        except Exception as exc:
            raise self._fail(what, exc) from exc

    # -- blocking verbs (each returns once done, or raises PeerFailure) ---------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, what: str = "all_reduce") -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.wait(self.allreduce([tensor], opts), what)

    def broadcast_from(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.wait(self.broadcast([tensor], opts), "broadcast")

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.wait(self.allgather([out], [tensor]), "all_gather")
        return out

    def sync(self, what: str = "barrier") -> None:
        self.all_reduce(torch.zeros(1), what=what)

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

    def send_to(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.wait(self.send([tensor], dst, tag), "send")

    def recv_from(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.wait(self.recv([tensor], src, tag), "recv")

    def send_many(self, tensors: Iterable[torch.Tensor], dst: int, tag: int = 0) -> None:
        """Send ``tensors`` in order, all posted at once (gloo streams them back to back); waits for all."""
        self.wait_all(self._post(self.send, tensors, dst, tag), "send")

    def recv_many(self, tensors: Iterable[torch.Tensor], src: int, tag: int = 0) -> None:
        """Receive into ``tensors`` in order (matching :meth:`send_many`), all posted at once; waits for
        all. ``tensors`` may be a generator: each receive is posted as soon as its tensor is made, while
        the earlier ones stream."""
        self.wait_all(self._post(self.recv, tensors, src, tag), "recv")

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

