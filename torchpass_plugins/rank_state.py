"""What a rank holds that its peers do not, copied to its next ring successors as training goes.

A spare receives the training state from a survivor, and most of it is the same on every rank (weights,
optimizer, schedulers, loop progress). Some is not: a metric's running counts, the values an epoch of
``self.log(..., on_epoch=True)`` accumulates, ``callback_metrics``. The lost process takes that with it,
so each rank hands it to its next ``HOLDERS`` ring successors before it can be needed, twice per step:

- *at the commit vote*, after the gradient reduction and before the vote: what the step's forward and
  backward changed. A rank enters the vote only after this exchange, so a vote that some survivor finished
  means every holder has its predecessors' copies as of that vote;
- *at the next step boundary*: what ran after the optimizer step (validation, the end of an epoch, hooks).

Two holders, so that two failures at once (two ranks, or a rank and then a survivor during the recovery it
started) still leave a copy of each lost rank's state: with a single holder, a rank lost together with its
successor had nothing to come back from. Both copies travel in the same round of messages, so the second
holder adds bytes, not latency. Only when every holder of a lost rank is lost too is its state gone; the
spare then stops the job with that reason (it restarts from its newest snapshot) instead of going on with
its own empty state.

A spare entering at boundary ``E`` gets its predecessor's copy of boundary ``E`` from a holder; when its
predecessor was lost before that exchange (after step ``E - 1``'s vote), the copy of that vote, which
misses only what ran after the optimizer step (event ``rank_state_received``, ``kind: "vote"``).
"""

from __future__ import annotations

from typing import Any

import torch

from torchpass_plugins.state_transfer import fields_of, frame, pack, structure_of, unpack
from torchpass_plugins.transport import Transport

_TAG = 7  # apart from the state hand-over's messages between the same two ranks
_FIELDS = 3  # step, structure bytes, payload bytes
KEEP = 2
HOLDERS = 2


def holders(rank: int, world_size: int) -> list[int]:
    """The ranks that keep copies of ``rank``'s state, nearest first."""
    return [(rank + d) % world_size for d in range(1, min(HOLDERS, world_size - 1) + 1)]


class RankStateRing:
    """This rank's copies of its ring predecessors' rank-local state, by predecessor, kind and step."""

    def __init__(self) -> None:
        self.copies: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def exchange(self, transport: Transport, kind: str, step: int, state: Any) -> None:
        """Send ``state`` to this rank's holders and keep its predecessors' copies, every message of the round
        posted at once (raises ``PeerFailure``)."""
        world, rank = transport.world_size, transport.rank
        distances = range(1, min(HOLDERS, world - 1) + 1)
        if not distances:
            return
        meta, payload = pack(state)
        first, rest = frame([step, meta.numel(), payload.numel()], torch.cat([meta, payload]))
        theirs = {d: torch.empty_like(first) for d in distances}
        works = [transport.pg.send([first], (rank + d) % world, _TAG + d) for d in distances]
        works += [transport.pg.recv([theirs[d]], (rank - d) % world, _TAG + d) for d in distances]
        transport.wait_all(works, f"rank state at the {kind}")
        works, arrived = [], {}
        for d in distances:
            got_step, meta_n, payload_n = fields_of(theirs[d], _FIELDS)
            blob, rest_in = structure_of(theirs[d], _FIELDS, meta_n + payload_n)
            arrived[d] = (got_step, blob[:meta_n], blob[meta_n:])
            if rest is not None:
                works.append(transport.pg.send([rest], (rank + d) % world, _TAG + d))
            if rest_in is not None:
                works.append(transport.pg.recv([rest_in], (rank - d) % world, _TAG + d))
        if works:
            transport.wait_all(works, f"rank state at the {kind}")
        for d, (got_step, meta_in, payload_in) in arrived.items():
            kept = self.copies.setdefault(((rank - d) % world, kind), {})
            kept[got_step] = (meta_in, payload_in)
            for old in sorted(kept)[:-KEEP]:
                del kept[old]

    def for_entry(self, lost: int, entry: int) -> tuple[str, Any]:
        """Rank ``lost``'s state at boundary ``entry``: ``("boundary", state)``; else as of the vote before it,
        ``("vote", state)``; else ``("none", None)``: this rank never received it (it was a spare then)."""
        for kind, step in (("boundary", entry), ("vote", entry - 1)):
            kept = self.copies.get((lost, kind), {})
            if step in kept:
                return kind, unpack(*kept[step])
        return "none", None
