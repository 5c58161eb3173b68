"""Ring replication of shard state: rank r keeps a copy of rank r-1's shard in host memory.

With fully sharded training no survivor holds a lost rank's parameters, so they must already be
elsewhere when it dies. Every ``every`` steps, at a step boundary, each rank packs its shard state (local
parameter shards and optimizer state) and a background thread sends it to its ring successor over a side
gloo group while receiving its predecessor's; training goes on meanwhile (the copy is made in that
thread too). A round must be complete
before the step's first gradient reduction (:meth:`fence`), so a failure after that point always finds
the boundary's shards replicated. Each rank keeps its own last two packed snapshots (to roll back in
memory) and the last two complete replicas it received (double buffering: a round in flight never
overwrites the one a recovery may need). A round packs into, and receives into, the buffers of the
oldest snapshot and replica, which it retires first, so steady state allocates nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from torchpass_plugins import faults
from torchpass_plugins.state_transfer import pack
from torchpass_plugins.transport import PeerFailure, Transport

KEEP = 2


@dataclass
class Packed:
    """A shard state as sent: pickled structure + one flat byte buffer, and what the host must restore."""

    meta: torch.Tensor
    payload: torch.Tensor
    host: Any = None  # loop progress and scheduler state of the same boundary (never sent)

    @property
    def nbytes(self) -> int:
        return self.meta.numel() + self.payload.numel()


@dataclass
class RingReplicator:
    side: Transport
    every: int
    own: dict[int, Packed] = field(default_factory=dict)
    replicas: dict[int, Packed] = field(default_factory=dict)  # of the ring predecessor, by step
    _thread: threading.Thread | None = None
    _error: str | None = None
    _crash: Exception | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def reset(self) -> None:
        """After a recovery: the ring has a new member and nothing older than the restored step matters."""
        self.own.clear()
        self.replicas.clear()
        self._thread, self._error = None, None

    def start_round(self, step: int, shard_state: Any, host: Any) -> None:
        """Copy and replicate this rank's shard state of boundary ``step`` in the background.

        ``shard_state`` may hold the live tensors: they change only at the optimizer step, which comes
        after the fence, so the background copy is consistent and costs the training thread nothing.
        """
        self.fence()
        self._error = None
        self._thread = threading.Thread(
            target=self._round, args=(step, shard_state, host), name="torchpass-replicate", daemon=True
        )
        self._thread.start()

    def _round(self, step: int, shard_state: Any, host: Any) -> None:
        try:
            mine = Packed(*pack(shard_state, into=_retire_oldest(self.own)), host)
            self.own[step] = mine
            faults.point("replicate")
            self._exchange(step, mine)
        except Exception as exc:  # not a peer's failure: this worker fails at the fence, like the training thread
            self._crash = exc

    def fence(self) -> None:
        """Wait for the round in flight; raises ``PeerFailure`` if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._crash is not None:
            raise RuntimeError("torchpass: the shard replication thread failed") from self._crash
        if self._error is not None:
            error, self._error = self._error, None
            raise PeerFailure(f"shard replication: {error}")

    def host_bytes(self) -> int:
        return sum(p.nbytes for p in self.own.values()) + sum(p.nbytes for p in self.replicas.values())

    def _exchange(self, step: int, mine: Packed) -> None:
        side = self.side
        succ, pred = (side.rank + 1) % side.world_size, (side.rank - 1) % side.world_size
        try:
            if side.stale() or side.pg is None:
                raise PeerFailure("newer roster")
            header = torch.tensor([step, mine.meta.numel(), mine.payload.numel()], dtype=torch.int64)
            theirs = torch.empty(3, dtype=torch.int64)
            side.wait_all([side.pg.send([header], succ, 0), side.pg.recv([theirs], pred, 0)], "replication header")
            got_step, meta_n, payload_n = theirs.tolist()
            meta = torch.empty(meta_n, dtype=torch.uint8)
            payload = _retire_oldest(self.replicas)
            if payload is None or payload.numel() != payload_n:
                payload = torch.empty(payload_n, dtype=torch.uint8)
            works = [side.pg.send([mine.meta], succ, 1), side.pg.recv([meta], pred, 1)]
            if mine.payload.numel():
                works.append(side.pg.send([mine.payload], succ, 2))
            if payload_n:
                works.append(side.pg.recv([payload], pred, 2))
            side.wait_all(works, "replication send/recv")
            self.replicas[got_step] = Packed(meta, payload)
        except PeerFailure as exc:
            self._error = str(exc)


def _retire_oldest(packs: dict[int, Packed]) -> torch.Tensor | None:
    """Make room for one more round (``KEEP`` at most) and return the payload buffer of the round retired."""
    payload = None
    for step in sorted(packs)[: max(0, len(packs) - KEEP + 1)]:
        payload = packs.pop(step).payload
    return payload
