"""The process group of ``fake_engine``'s job: each generation's collectives and point-to-point messages in
memory, matched between the worker threads, with the failures the job scripts.

A collective completes when every rank of the generation has issued it (the sum in rank order, so every rank
gets the same bits), a message when its receive is posted. A failed generation fails every pending and later
operation with ``PeerFailure``; a newer roster fails the waits of the older generation as the real group's
do; a worker that died raises :class:`Killed` from its next wait.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchpass_plugins.core.process_group import PeerFailure, generation_error

if TYPE_CHECKING:
    from fake_engine import FakeMember, FakeWorld

    from torchpass_plugins.core.runtime import Runtime


class Killed(BaseException):
    """This worker died (a BaseException: no ``except Exception`` of the engine may survive it)."""


@dataclass
class Op:
    """One issued operation (the fake's ``Work``)."""

    generation: Generation
    rank: int
    kind: str  # allreduce, allgather, send, recv
    what: str
    step: int  # the issuing runtime's step
    tensors: list[torch.Tensor]
    out: list[torch.Tensor] | None = None  # an all-gather's outputs
    done: bool = False


class Generation:
    """One roster's communication: collectives matched by their order, messages by (source, destination, tag)."""

    def __init__(self, world: FakeWorld, gen: int) -> None:
        self.world, self.gen, self.roster = world, gen, world.rosters[gen]
        self.connected: set[int] = set()
        self.failed: str | None = None
        self._issued = [0] * world.world_size
        self._collectives: dict[int, dict[int, Op]] = {}
        self._sends: dict[tuple[int, int, int], deque[Op]] = {}
        self._recvs: dict[tuple[int, int, int], deque[Op]] = {}

    def fail(self, why: str) -> None:
        self.failed = self.failed or why

    def collective(self, op: Op) -> None:
        index, self._issued[op.rank] = self._issued[op.rank], self._issued[op.rank] + 1
        slot = self._collectives.setdefault(index, {})
        slot[op.rank] = op
        self.world.republish_if_due(self, list(slot.values()))
        if len(slot) == self.world.world_size:
            self._complete([slot[r] for r in range(self.world.world_size)])

    def _complete(self, ops: list[Op]) -> None:
        first = ops[0]
        if any((op.kind, op.what, op.tensors[0].shape) != (first.kind, first.what, first.tensors[0].shape)
               for op in ops):
            issued = [(op.rank, op.kind, op.what, tuple(op.tensors[0].shape)) for op in ops]
            return self.world.protocol_error(self, f"ranks issued different collectives: {issued}")
        total = first.tensors[0].clone()
        for op in ops[1:]:
            total += op.tensors[0]  # in rank order: every rank gets the same bits
        cut = self.world.cut_due(ops)
        for op in ops:
            if cut is not None and op.rank not in cut.delivered:
                continue
            if op.kind == "allreduce":
                op.tensors[0].copy_(total)
            else:
                for out, src in zip(op.out, ops, strict=True):
                    out.copy_(src.tensors[0])
            op.done = True
        if cut is not None:
            self.world.dead.add(self.roster.ranks[cut.victim])
            self.fail(f"rank {cut.victim} died in {cut.what}")

    def message(self, op: Op, peer: int, tag: int) -> None:
        src, dst = (op.rank, peer) if op.kind == "send" else (peer, op.rank)
        mine, theirs = (self._sends, self._recvs) if op.kind == "send" else (self._recvs, self._sends)
        waiting = theirs.get((src, dst, tag))
        if not waiting:
            mine.setdefault((src, dst, tag), deque()).append(op)
            return
        other = waiting.popleft()
        send, recv = (op, other) if op.kind == "send" else (other, op)
        s, r = send.tensors[0], recv.tensors[0]
        if (s.dtype, s.shape) != (r.dtype, r.shape):  # gloo would abort the process
            return self.world.protocol_error(self, f"message {src}->{dst} of {s.shape} into {r.shape}")
        r.copy_(s)
        send.done = recv.done = True


class FakeGroup:
    """What the runtime, the gradient buckets, the rank-state ring and ``state_transfer`` use of
    :class:`~torchpass_plugins.core.process_group.ReconfigurableGroup`, over the world's generations."""

    def __init__(self, world: FakeWorld, member: FakeMember) -> None:
        self.world, self.member = world, member
        self.world_size = world.world_size
        self.timeout = timedelta(seconds=30)
        self.gen, self.rank = -1, -1
        self.waited = 0.0
        self.runtime: Runtime | None = None  # its step labels the operations
        self._generation: Generation | None = None
        self._failure: str | None = None

    def built(self) -> bool:
        return self._generation is not None

    def stale(self) -> bool:
        return self.member.latest_gen > self.gen

    def errored(self) -> str | None:
        return generation_error(self._generation is not None, self.gen, self.member.latest_gen, self._failure)

    def check(self) -> None:
        why = self.errored()
        if why is not None:
            raise PeerFailure(why)

    def configure(self, generation: int, rank: int, path: int = 0) -> None:
        self.abort()
        self.gen, self.rank, self.path, self._failure = generation, rank, path, None
        with self.world.cond:
            g = self.world.generation(generation)
            g.connected.add(rank)
            self.world.cond.notify_all()
            while len(g.connected) < self.world_size:
                if self.stale():
                    raise PeerFailure(f"connect generation {generation}: generation {self.member.latest_gen} "
                                      f"replaced it")
                self.world.wait(self.member.worker)
        self._generation = g

    def abort(self) -> None:
        self._generation = None

    def drain(self, timeout: float) -> bool:
        return True

    def track(self, work: Op) -> None:
        pass

    # -- issuing --------------------------------------------------------------------------------------
    def _post(self, kind: str, tensors: list[torch.Tensor], what: str, peer: int = -1, tag: int = 0,
              out: list[torch.Tensor] | None = None) -> Op:
        with self.world.cond:
            self.world.ops.append((self.gen, self.member.worker, self.rank, self.runtime.step, kind, what))  # tries too
        self.check()
        op = Op(self._generation, self.rank, kind, what, self.runtime.step, tensors, out)
        with self.world.cond:
            if op.generation.failed:
                self._failure = f"{what}: {op.generation.failed}"
                raise PeerFailure(self._failure)
            if kind in ("send", "recv"):
                op.generation.message(op, peer, tag)
            else:
                op.generation.collective(op)
            self.world.cond.notify_all()
        return op

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> Op:
        if opts is not None:
            raise NotImplementedError("the fake group sums only")
        return self._post("allreduce", tensors, "allreduce")

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Op:
        return self._post("send", tensors, "send", dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Op:
        return self._post("recv", tensors, "recv", src, tag)

    # -- waiting --------------------------------------------------------------------------------------
    def wait(self, op: Op, what: str) -> None:
        t0 = time.perf_counter()
        try:
            with self.world.cond:
                while not op.done:
                    if self.member.worker in self.world.dead:
                        raise Killed(self.member.worker)
                    if op.generation.failed:
                        self._failure = f"{what}: {op.generation.failed}"
                        raise PeerFailure(self._failure)
                    if self.stale():
                        raise PeerFailure(f"{what}: generation {self.member.latest_gen} replaced {self.gen}")
                    self.world.wait(self.member.worker)
        finally:
            self.waited += time.perf_counter() - t0

    def wait_all(self, ops: list[Op], what: str) -> None:
        for op in ops:
            self.wait(op, what)

    # -- blocking verbs -------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "all_reduce") -> None:
        if op != dist.ReduceOp.SUM:
            raise NotImplementedError("the fake group sums only")
        self.wait(self._post("allreduce", [tensor], what), what)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.wait(self._post("allgather", [tensor], "all_gather", out=out), "all_gather")
        return out

    def sync(self, what: str = "barrier") -> None:
        self.all_reduce(torch.zeros(1), what=what)

    def send_to(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.wait(self.send([tensor], dst, tag), "send")

    def recv_from(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.wait(self.recv([tensor], src, tag), "recv")

    def send_many(self, tensors, dst: int, tag: int = 0) -> None:
        self.wait_all([self.send([t], dst, tag) for t in tensors], "send")

    def recv_many(self, tensors, src: int, tag: int = 0) -> None:
        self.wait_all([self.recv([t], src, tag) for t in tensors], "recv")
