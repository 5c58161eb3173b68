"""Ring replication of shard state: rank r keeps a copy of rank r-1's shard in host memory.

With fully sharded training no survivor holds a lost rank's parameters, so they must already be elsewhere
when it dies. Every ``every`` steps, at a step boundary, each rank packs its shard state (local parameter
shards and optimizer state) in the background (the copy where the core would be idle, :mod:`idle_copy`) and
replicates it to its ring successor while receiving its predecessor's. A round must be complete before the
step's first gradient reduction (:meth:`fence`), so a failure after that point always finds the boundary's
shards replicated. Each rank keeps its own last two packed snapshots (to roll back in memory) and the last
two complete replicas it received (double buffering: a round in flight never overwrites the one a recovery
may need).

A rank packs into segments of its own memory that a successor on the same host maps (:mod:`peer_memory`):
then a round sends one message over the side group (a header that carries the structure), and the replica is
the predecessor's packed snapshot itself, alive in the successor's mapping even after the predecessor dies.
A successor on another host (or one that cannot map it) receives the bytes over the side group instead; the
first round of each generation settles which. Round n rewrites the segment of round n - 3 (the least
recently written of ``KEEP + 1``), which the successor no longer lists: it dropped that replica in its round
n - 1, which it fenced before that step's gradient reduction (or, for a step without one, before the next
boundary's all-reduce), a collective this rank took part in before round n began.
In steady state a round allocates no payload memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchpass_plugins.core.idle_copy import IdleCopy, copy_piece, pieces
from torchpass_plugins.core.peer_memory import NOT_MAPPED, Segment, SegmentId, map_predecessor
from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup
from torchpass_plugins.core.state_transfer import fields_of, frame, pack_plan, structure_of
from torchpass_plugins.testing import faults

KEEP = 2
_FIELDS = 7  # of the header: step, structure bytes, payload bytes, segment (pid, fd, device, inode)
GRACE_S = 0.1  # how long the fence waits for a piece the idle copier holds before it redoes the round


@dataclass
class Packed:
    """A shard state as sent: pickled structure + one flat byte buffer, and what the host must restore."""

    meta: torch.Tensor
    payload: torch.Tensor
    host: Any = None  # loop progress, scheduler and gradient scaler state of the same boundary (never sent)
    mapped: bool = False  # ``payload`` is the predecessor's own segment (this process never writes it)

    @property
    def nbytes(self) -> int:
        return self.meta.numel() + self.payload.numel()


@dataclass
class RingReplicator:
    side: ReconfigurableGroup
    every: int
    share_memory: bool = True  # a same-host successor maps this rank's snapshots instead of receiving them
    copier: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], IdleCopy] = IdleCopy  # (a test's hook)
    own: dict[int, Packed] = field(default_factory=dict)
    replicas: dict[int, Packed] = field(default_factory=dict)  # of the ring predecessor, by step
    _segments: list[Segment] = field(default_factory=list)  # own payload buffers, least recently written first
    _succ_maps: bool | None = None  # does the successor map this rank's segments (None: not settled yet)
    _pred_mapped: bool | None = None  # does this rank map the predecessor's
    _thread: threading.Thread | None = None
    _round_args: tuple[int, Any, Any] | None = None  # of the round in flight
    _copy: IdleCopy | None = None  # its snapshot copy, once planned
    _planned: threading.Event = field(default_factory=threading.Event)
    _abandoned: list[tuple[Segment, IdleCopy]] = field(default_factory=list)  # may still be written
    _started: list[int] = field(default_factory=list)  # the last ``KEEP + 1`` rounds' steps since the reset
    _error: str | None = None
    _crash: Exception | None = None

    def due(self, step: int) -> bool:
        """Every ``every`` steps, and at once when this rank holds no round (after a recovery: until one
        completes, a second failure would find no replica)."""
        return self.every > 0 and (step % self.every == 0 or not self.own)

    def reset(self) -> None:
        """After a recovery: the ring has a new member and nothing older than the restored step matters."""
        self.own.clear()
        self.replicas.clear()
        self._started.clear()
        self._succ_maps = self._pred_mapped = None
        self._thread, self._copy, self._error = None, None, None

    def start_round(self, step: int, shard_state: Any, host: Any) -> None:
        """Copy and replicate this rank's shard state of boundary ``step`` in the background.

        ``shard_state`` may hold the live tensors: they change only at the optimizer step, which comes
        after the fence. The copy runs where the core would be idle (:class:`IdleCopy`); the fence
        finishes what is left of it.
        """
        self.fence()
        self._started[:] = [*self._started, step][-(KEEP + 1):]
        self._error, self._copy, self._round_args = None, None, (step, shard_state, host)
        self._planned.clear()
        self._thread = threading.Thread(
            target=self._round, args=(step, shard_state, host), name="torchpass-replicate", daemon=True
        )
        self._thread.start()

    def _round(self, step: int, shard_state: Any, host: Any, idle: bool = True) -> None:
        try:
            _retire_oldest(self.own)
            meta, size, sources = pack_plan(shard_state)
            payload = self._segment(size)
            if idle:
                self._copy = copy = self.copier(pieces(payload, sources))
                self._planned.set()
                if not copy.wait():
                    return  # given up on: the fence redoes this round
            else:
                for pair in pieces(payload, sources):
                    copy_piece(*pair)
            mine = Packed(meta, payload, host)
            self.own[step] = mine
            faults.point("replicate")
            self._exchange(step, mine)
        except Exception as exc:  # not a peer's failure: this worker fails at the fence, like the training thread
            self._crash = exc
        finally:
            self._planned.set()

    def fence(self) -> None:
        """Finish the round in flight (its copy here, if the idle copier has not); raises ``PeerFailure``
        if it failed."""
        if self._thread is not None:
            self._planned.wait()
            if self._copy is not None and not self._copy.finish(GRACE_S):
                self._thread.join()  # at once: its copy was given up on
                self._abandoned.append((self._segments.pop(), self._copy))  # a piece may still land there
                self._round(*self._round_args, idle=False)  # into another segment, in this thread
            self._thread.join()
            self._thread, self._copy = None, None
        if self._crash is not None:
            raise RuntimeError("torchpass: the shard replication thread failed") from self._crash
        if self._error is not None:
            error, self._error = self._error, None
            raise PeerFailure(f"shard replication: {error}")

    def successor_replays_from(self) -> int:
        """The oldest step the successor may replay this rank's shard from: it holds the ``KEEP`` newest
        rounds it completed, and it completes each before its next gradient reduction, a collective this
        rank makes before starting a round: so none older than this rank's ``KEEP + 1``-th newest."""
        return min(self._started, default=0)

    def host_bytes(self) -> int:
        """What this rank's replication holds: its segments (:attr:`abandoned_bytes` included) and the
        replicas it received (not mapped)."""
        return (sum(s.nbytes for s in self._segments) + self.abandoned_bytes
                + sum(p.meta.numel() for p in self.own.values())
                + sum(p.meta.numel() if p.mapped else p.nbytes for p in self.replicas.values()))

    @property
    def abandoned_bytes(self) -> int:
        """Segments given up on because the idle copier was too slow to fill them (a busy CPU): held until
        its thread has let go of them."""
        return sum(s.nbytes for s, _ in self._abandoned)

    def _segment(self, nbytes: int) -> torch.Tensor:
        """A buffer for this round's snapshot: the least recently written segment that holds none of the
        kept snapshots, once there are ``KEEP + 1`` of them (``KEEP`` if the successor does not map them)."""
        for gone in [a for a in self._abandoned if a[1].settled]:
            self._abandoned.remove(gone)
            gone[0].close()
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        kept = {p.payload.data_ptr() for p in self.own.values() if p.payload.numel()}
        free = [s for s in self._segments if s.tensor.data_ptr() not in kept]
        limit = KEEP if self._succ_maps is False or not self.share_memory else KEEP + 1
        chosen = None
        while free and len(self._segments) >= limit:
            if chosen is not None:
                chosen.close()
            chosen = free.pop(0)
            self._segments.remove(chosen)
        if chosen is None or chosen.nbytes != nbytes:
            if chosen is not None:
                chosen.close()
            chosen = Segment(nbytes)
        self._segments.append(chosen)
        return chosen.tensor

    def _exchange(self, step: int, mine: Packed) -> None:
        side = self.side
        succ, pred = (side.rank + 1) % side.world_size, (side.rank - 1) % side.world_size
        try:
            side.check()
            where = self._segments[-1].id.to_list() if mine.payload.numel() else NOT_MAPPED  # just written
            header, rest = frame([step, mine.meta.numel(), mine.payload.numel(), *where], mine.meta)
            theirs = torch.empty_like(header)
            side.wait_all([side.send([header], succ, 0), side.recv([theirs], pred, 0)], "replication header")
            got_step, meta_n, payload_n, *at = fields_of(theirs, _FIELDS)
            retired = _retire_oldest(self.replicas)
            mapped = self._map(SegmentId(*at), payload_n)
            if self._pred_mapped is None:  # this generation's first round: settle both directions
                self._pred_mapped = mapped is not None
                answer, reply = torch.tensor([int(self._pred_mapped)]), torch.empty(1, dtype=torch.int64)
                handshake = [side.send([answer], pred, 3), side.recv([reply], succ, 3)]
                side.wait_all(handshake, "replication handshake")
                self._succ_maps = bool(reply.item())
            meta, rest_in = structure_of(theirs, _FIELDS, meta_n)
            works = []
            if rest is not None:
                works.append(side.send([rest], succ, 1))
            if rest_in is not None:
                works.append(side.recv([rest_in], pred, 1))
            if mine.payload.numel() and not self._succ_maps:
                works.append(side.send([mine.payload], succ, 2))
            payload = mapped
            if payload is None:
                reusable = retired is not None and not retired.mapped and retired.payload.numel() == payload_n
                payload = retired.payload if reusable else torch.empty(payload_n, dtype=torch.uint8)
                if payload_n:
                    works.append(side.recv([payload], pred, 2))
            if works:
                side.wait_all(works, "replication send/recv")
            self.replicas[got_step] = Packed(meta, payload, mapped=mapped is not None)
        except PeerFailure as exc:
            self._error = str(exc)

    def _map(self, segment: SegmentId, nbytes: int) -> torch.Tensor | None:
        """The predecessor's segment mapped here, or ``None`` where it travels over the side group."""
        if not self.share_memory or self._pred_mapped is False or segment.pid < 0:
            return None
        return map_predecessor(segment, nbytes, settled=bool(self._pred_mapped))


def _retire_oldest(packs: dict[int, Packed]) -> Packed | None:
    """Make room for one more round (``KEEP`` at most) and return the last one retired."""
    retired = None
    for step in sorted(packs)[: max(0, len(packs) - KEEP + 1)]:
        retired = packs.pop(step)
    return retired
