"""Weights of a fully sharded model (``torchpass_fsdp``) published as full tensors, assembled off the
training loop.

No rank holds the full weights, and gathering them with a collective would stop every rank. Instead each
rank serves its own shards of every N-th boundary with a :class:`WeightPublisher` of its own (an ephemeral
port, written to the job's store under ``weights/shards/RANK``), and the process holding logical rank 0
follows them with one :class:`WeightSubscriber` per rank, in threads. A version is assembled (each
parameter's shards concatenated along the dimension FSDP shards) and published to the job's subscribers
once rank 0 holds every rank's shards of that same step; so a published version is never a mix of steps.
Versions some rank skipped or did not send (a busy publisher, a rank being replaced) are never complete and
are passed over for the next. A spare that takes a rank over serves its shards at a new address, which
the followers read from the store again; a spare that takes rank 0 over starts following.

Each rank's training loop pays the copy of its own shards into host memory, once per version.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from torchpass_plugins.core.host_copy import to_host
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.weights import rank_zero
from torchpass_plugins.weights.publisher import WeightPublisher
from torchpass_plugins.weights.rank_zero import RankZeroPublishing
from torchpass_plugins.weights.subscriber import WeightSubscriber

# Versions rank 0 keeps of its own shards, and of each other rank's, while it waits for all ranks' shards of
# one step. The others' are the newest their publishers had when asked, so a few of them suffice; its own
# must reach back as many steps as a shard takes to arrive.
KEEP_OWN, KEEP_OTHERS = 8, 2
_FOLLOW_POLL_S = 2.0  # how often a follower with nothing new looks for a new address of its rank
SENDER = "__torchpass_rank__"  # in each rank's shards: who sent them (an address in the store may be stale)


def shard_key(rank: int) -> str:
    return f"weights/shards/{rank}"


class ShardedPublishing(RankZeroPublishing):
    """:class:`RankZeroPublishing` for ``torchpass_fsdp``: called on every rank at the same points of a
    step; ``runtime`` gives the job's store, the rank's address and the world size."""

    def __init__(self, plain: RankZeroPublishing, runtime: Any) -> None:
        super().__init__(plain.endpoint, plain.every_n_steps, plain.dtype_name, plain.storage)
        self.runtime = runtime
        self.shard_publisher: WeightPublisher | None = None  # ranks other than 0
        self.collector: ShardCollector | None = None  # rank 0
        self._staged = -1

    def at_start(self, rank: int, step: int, module: torch.nn.Module, events: Any) -> None:
        self._stage(rank, step, module, events, last=False)

    def at_boundary(self, rank: int, step: int, module: torch.nn.Module, events: Any) -> None:
        if step % self.every_n_steps == 0:
            self._stage(rank, step, module, events, last=False)

    def before_optimizer_step(self) -> None:
        """Nothing: each rank's shards are copied whole at the boundary."""

    def at_end(self, rank: int, step: int, module: torch.nn.Module, events: Any) -> None:
        """Every rank's shards of the trained weights; rank 0 publishes them assembled. Each process then
        outlives training (a thread that is not a daemon) until its shards reached rank 0, or rank 0's
        assembled weights its subscribers: at most ``LAST_DELIVERY_S`` for each of the two waits."""
        if self._delivering:
            return
        self._stage(rank, step, module, events, last=True)
        self._delivering = True
        threading.Thread(target=self._deliver_last, args=(events, step, rank), name="weights-last-delivery").start()

    def _deliver_last(self, events: Any, step: int, rank: int) -> None:
        if self.collector is None and self.shard_publisher is None:
            return  # (a spare that never held its rank's state: nothing of its own was published)
        if self.collector is None:
            # (rank 0 may not follow this process yet: a spare that took the rank over shortly before the end)
            self.shard_publisher.deliver_newest(rank_zero.LAST_DELIVERY_S, expected=(_follower(rank),))
            self.shard_publisher.close()
            return
        if not self.collector.wait_published(step, rank_zero.LAST_DELIVERY_S):
            events.emit("weights_skipped", version=step, reason="not every rank's shards of the trained weights "
                        f"arrived within {rank_zero.LAST_DELIVERY_S:g} s")
        self.collector.close()
        super()._deliver_last(events)

    def _stage(self, rank: int, step: int, module: torch.nn.Module, events: Any, last: bool) -> None:
        if step <= self._staged or self.runtime.phase in (Phase.SPARE, Phase.ENTERING):
            return  # (a promoted spare's shards are not yet the rank's before its entry boundary is passed)
        self._staged = step
        state = module.state_dict()
        sharded = {name for name, tensor in state.items() if isinstance(tensor, DTensor)}
        for name in sharded:
            if tuple(state[name].placements) != (Shard(0),):
                raise ConfigError(f"torchpass: publish_weights assembles parameters sharded along their first "
                                  f"dimension; {name!r} is placed {state[name].placements}")
        if rank == 0:
            if self.collector is None:
                self.publisher = WeightPublisher(self.endpoint, dtype=self.dtype, events=events, storage=self.storage)
                self.collector = ShardCollector(self.runtime, self.publisher, sharded, events)
            local = [tensor.to_local() if name in sharded else tensor for name, tensor in state.items()]
            own = [t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t
                   for t in to_host(local, copy=True)]  # kept until the other ranks' shards of this step arrive
            self.collector.add(0, step, dict(zip(state, own, strict=True)))
            return
        if self.shard_publisher is None:
            host = _address_towards(self.runtime.env.store_host_port[0])
            self.shard_publisher = WeightPublisher(f"tcp://{host}:0", dtype=self.dtype, events=EventLog(None))
            self.runtime.member.store.set(shard_key(rank), self.shard_publisher.endpoint)
        shards = {name: state[name].to_local() for name in sorted(sharded)}
        self.shard_publisher.publish({**shards, SENDER: torch.tensor(rank)}, step, wait=last)

    def close(self) -> None:
        for part in (self.collector, self.shard_publisher):
            if part is not None:
                part.close()
        super().close()


class ShardCollector:
    """Rank 0's side: follows every other rank's shard publisher, and publishes each step for which it
    holds all ranks' shards (the newest such, newer than the last published), assembled."""

    def __init__(self, runtime: Any, publisher: WeightPublisher, sharded: set[str], events: Any) -> None:
        self.world_size = runtime.world_size
        self.publisher, self.sharded, self.events = publisher, sharded, events
        self._shards: dict[int, dict[int, dict[str, torch.Tensor]]] = {r: {} for r in range(self.world_size)}
        self._changed = threading.Condition()
        self._published = -1
        self._closed = False
        self._threads = [threading.Thread(target=self._follow, args=(runtime.member.thread_store(), rank),
                                          name=f"weights-follow-rank{rank}", daemon=True)
                         for rank in range(1, self.world_size)]
        self._threads.append(threading.Thread(target=self._assemble, name="weights-assemble", daemon=True))
        for thread in self._threads:
            thread.start()

    def add(self, rank: int, version: int, shards: dict[str, torch.Tensor]) -> None:
        with self._changed:
            kept = self._shards[rank]
            kept[version] = shards
            for old in sorted(kept)[:-(KEEP_OWN if rank == 0 else KEEP_OTHERS)]:
                del kept[old]
            self._changed.notify_all()

    def wait_published(self, version: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._published < version and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return self._published >= version

    def _follow(self, store: Any, rank: int) -> None:
        """Rank ``rank``'s shards, from whichever process serves them now (its address in the store)."""
        subscriber, endpoint, have = None, None, -1
        while not self._closed:
            try:
                current = store.get(shard_key(rank)).decode() if store.check([shard_key(rank)]) else None
                if current != endpoint:
                    if subscriber is not None:
                        subscriber.close()
                    endpoint = current
                    subscriber = (WeightSubscriber(endpoint, name=_follower(rank), retry_s=0.05)
                                  if endpoint else None)
                if subscriber is None:
                    time.sleep(0.1)
                    continue
                try:  # (from rank 0's newest step on: every follower asks for the same steps, in step)
                    version, shards = subscriber.wait_newer(max(have, self._own_newest() - 1), _FOLLOW_POLL_S)
                except TimeoutError:
                    continue
                if int(shards.pop(SENDER, torch.tensor(-1))) != rank:
                    raise ValueError(f"{endpoint} served another rank's shards: its address in the store is stale")
                have = version
                self.add(rank, version, shards)
            except Exception as exc:  # (logged; this rank's next shards are asked for again)
                self.events.emit("weights_shards_failed", rank=rank, error=str(exc)[:500])
                endpoint = None
                time.sleep(1.0)
        if subscriber is not None:
            subscriber.close()

    def _assemble(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (version := self._complete()) is None:
                    self._changed.wait()
                if self._closed:
                    return
                parts = [self._shards[rank][version] for rank in range(self.world_size)]
            try:
                state = {name: torch.cat([part[name] for part in parts]) if name in self.sharded else tensor
                         for name, tensor in parts[0].items()}
                published = not self.publisher.publish(state, version, wait=True).skipped
            except Exception as exc:  # (logged; the next complete step is tried)
                self.events.emit("weights_shards_failed", version=version, error=str(exc)[:500])
                published = False
            with self._changed:
                self._published = version if published else self._published
                for kept in self._shards.values():  # never assembled again
                    for old in [v for v in kept if v <= version]:
                        del kept[old]
                self._changed.notify_all()

    def _own_newest(self) -> int:
        with self._changed:
            return max(self._shards[0], default=-1)

    def _complete(self) -> int | None:
        """The newest step whose shards every rank's are here, if newer than the last published."""
        common = set.intersection(*(set(kept) for kept in self._shards.values()))
        newest = max(common, default=-1)
        return newest if newest > self._published else None

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _follower(rank: int) -> str:
    """The name rank 0's follower of ``rank``'s shards gives itself."""
    return f"rank0-follows-rank{rank}"


def _address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (the job's store): where other ranks reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # (no packet is sent: UDP only picks the route)
        return probe.getsockname()[0]
