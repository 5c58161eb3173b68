"""What a rank holds that its peers do not, copied to its ring successor as training goes.

A spare receives the training state from a survivor, and most of it is the same on every rank (weights,
optimizer, schedulers, loop progress). Some is not: a metric's running counts, the values an epoch of
``self.log(..., on_epoch=True)`` accumulates, ``callback_metrics``. The lost process takes that with it,
so each rank hands it to its ring successor before it can be needed, twice per step:

- *at the commit vote*, after the gradient reduction and before the vote: what the step's forward and
  backward changed. A rank enters the vote only after this exchange, so a vote that some survivor finished
  means every successor holds its predecessor's copy as of that vote;
- *at the next step boundary*: what ran after the optimizer step (validation, the end of an epoch, hooks).

A spare entering at boundary ``E`` gets its predecessor's copy of boundary ``E`` from the successor; when its
predecessor was lost before that exchange (after step ``E - 1``'s vote), the copy of that vote, which
misses only what ran after the optimizer step (event ``rank_state_received``, ``kind: "vote"``).

A copy may be large (``torchpass_fsdp``'s vote copy carries the step's gradient shard): to a successor that
maps this rank's memory (:mod:`peer_memory`, the same host) only its structure travels, its bytes staying in
a segment of this rank's that the successor's mapping keeps alive.

A rank lost together with its successor (two failures at once, or one during the recovery from another)
leaves no copy of its state; its spare then starts those values over, as resuming from a snapshot would,
and the log says so (event ``rank_state_lost``). A second holder would close that gap, but in small rings
it is also a predecessor, so a connection would carry messages both ways, and gloo aborts the process
when it tears down such a connection to a peer that died.
"""

from __future__ import annotations

from typing import Any

import torch

from torchpass_plugins.core.peer_memory import NOT_MAPPED, SegmentId, SegmentPool, map_predecessor
from torchpass_plugins.core.process_group import ReconfigurableGroup
from torchpass_plugins.core.state_transfer import fields_of, frame, pack, structure_of, unpack

_TAG = 7  # apart from the state hand-over's messages between the same two ranks
_FIELDS = 7  # step, structure bytes, payload bytes, segment (pid, fd, device, inode; -1 when sent)
KEEP = 2


class RankStateRing:
    """This rank's copies of its ring predecessor's rank-local state, by kind and step: the last ``KEEP`` of
    each kind, unless ``keep_votes`` is False (``torchpass_fsdp``'s vote copies carry the step's gradient
    too, kept until its replica round makes them unneeded: :meth:`forget_votes_before`)."""

    def __init__(self, keep_votes: bool = True) -> None:
        self.copies: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, bool]]] = {"vote": {}, "boundary": {}}
        self._bounded = {"vote": keep_votes, "boundary": True}
        self._written = SegmentPool()  # this rank's entries that its successor maps
        self.peak_bytes = 0  # the most host memory the copies held at once (reported with the replicas')

    def exchange(self, transport: ReconfigurableGroup, kind: str, step: int, state: Any,
                 needed_from: int | None = None) -> None:
        """Send ``state`` to the successor and keep the predecessor's, both at once (raises ``PeerFailure``).

        ``needed_from``: the successor maps this rank's memory (:mod:`peer_memory`) and needs no entry of a
        step before it. The bytes are then written where it maps them (into an older entry's memory), and
        only their structure is sent: a shard-sized gradient skips two copies through a socket each step.
        It is written before this returns, so before the vote, and the mapping keeps it if this rank dies."""
        if transport.world_size < 2:
            return
        succ, pred = (transport.rank + 1) % transport.world_size, (transport.rank - 1) % transport.world_size
        if needed_from is None:
            meta, payload = pack(state)
            where, outgoing = NOT_MAPPED, torch.cat([meta, payload])
        else:
            meta, payload = pack(state, lambda n: self._written.take(step, n, needed_from))
            where, outgoing = self._written.where(step).to_list() if payload.numel() else NOT_MAPPED, meta
        first, rest = frame([step, meta.numel(), payload.numel(), *where], outgoing)
        theirs = torch.empty_like(first)
        transport.wait_all([transport.send([first], succ, _TAG), transport.recv([theirs], pred, _TAG)],
                           f"rank state at the {kind}")
        got_step, meta_n, payload_n, *at = fields_of(theirs, _FIELDS)
        mapped = at[0] >= 0
        blob, rest_in = structure_of(theirs, _FIELDS, meta_n if mapped else meta_n + payload_n)
        works = [transport.send([rest], succ, _TAG)] if rest is not None else []
        works += [transport.recv([rest_in], pred, _TAG)] if rest_in is not None else []
        if works:
            transport.wait_all(works, f"rank state at the {kind}")
        kept = self.copies[kind]
        if mapped:
            kept[got_step] = (blob, map_predecessor(SegmentId(*at), payload_n, settled=True), True)
        else:
            kept[got_step] = (blob[:meta_n], blob[meta_n:], False)
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        for old in sorted(kept)[:-KEEP] if self._bounded[kind] else ():
            del kept[old]

    def nbytes(self) -> int:
        """The host memory this rank holds for the ring's copies: those it received (not those it maps: their
        memory is the predecessor's) and the segments of its own entries (those kept for reuse included)."""
        return self._written.nbytes + sum(meta.numel() + (0 if mapped else payload.numel())
                                          for kept in self.copies.values() for meta, payload, mapped in kept.values())

    def get(self, kind: str, step: int) -> Any:
        meta, payload, _ = self.copies[kind][step]
        return unpack(meta, payload)

    def logged(self) -> set[int]:
        """The steps whose vote copy this rank holds."""
        return set(self.copies["vote"])

    def forget_votes_before(self, step: int) -> None:
        for old in [s for s in self.copies["vote"] if s < step]:
            del self.copies["vote"][old]

    def clear(self) -> None:
        """A new ring (after a recovery): the copies came from a predecessor this rank may no longer have."""
        for kept in self.copies.values():
            kept.clear()
        self._written.forget()

    def for_entry(self, entry: int) -> tuple[str, Any]:
        """The predecessor's state at boundary ``entry``: ``("boundary", state)``; else as of the vote before
        it, ``("vote", state)``; else ``("none", None)``: this rank was a spare itself when the copy went round,
        or the predecessor was lost before the first boundary's."""
        for kind, step in (("boundary", entry), ("vote", entry - 1)):
            if step in self.copies[kind]:
                return kind, self.get(kind, step)
        return "none", None
