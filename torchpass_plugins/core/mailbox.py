"""Entries a rank leaves in its own memory for its ring successor, which maps that memory once per generation.

A rank's own state (and ``torchpass_fsdp``'s gradient log) must be at its ring successor before the rank
votes on a step. Sent as a message, each hand-over is a round trip both ranks wait for, twice per step.
A successor on the same host instead maps its predecessor's *mailbox* (a :class:`Segment`, settled at the
generation's first hand-over) and the predecessor writes each entry there: nothing is sent, nobody waits,
and the mapping keeps the entries after the predecessor dies, which is the only time they are read.

Layout: a directory of :data:`SLOTS` fixed-size slots, then the entries' bytes (each a packed state: its
structure, then its tensors). A slot describes one entry and carries a sequence number that is odd while
the slot is being rewritten or no longer valid and even (and non-zero) once its entry is complete. The
writer makes a slot odd before it reuses that entry's memory and even only after writing the new entry,
so a reader that sees the same even number before and after copying an entry copied a whole one; a writer
killed mid-entry leaves an odd slot, read as no entry at all. Pages exist only where entries were written:
the reserved size is address space, not memory.
"""

from __future__ import annotations

from typing import Any

import torch

from torchpass_plugins.core.peer_memory import Segment, SegmentId, map_peer
from torchpass_plugins.core.state_transfer import pack_plan, unpack

RESERVE = 1 << 36  # bytes of address space per mailbox (64 GiB); pages only where written
SLOTS = 4096
_SLOT_FIELDS = 8  # sequence, kind, step, offset, structure bytes, payload bytes, 2 unused (64 bytes)
_DATA = SLOTS * _SLOT_FIELDS * 8  # where entries start
_ALIGN = 64
KINDS = ("boundary", "vote")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Mailbox:
    """This rank's entries, by (kind, step), where a same-host successor maps them."""

    def __init__(self, reserve: int = RESERVE) -> None:
        self.segment = Segment(reserve)  # OSError where this host cannot map that much: entries are sent
        self._slots = self.segment.tensor[:_DATA].view(torch.int64).view(SLOTS, _SLOT_FIELDS)
        self._live: dict[tuple[str, int], tuple[int, int, int]] = {}  # (kind, step) -> slot, offset, bytes
        self.extent = _DATA  # the end of the furthest entry written: the memory this mailbox holds

    @property
    def id(self) -> SegmentId:
        return self.segment.id

    def steps(self, kind: str) -> list[int]:
        return sorted(step for k, step in self._live if k == kind)

    def put(self, kind: str, step: int, state: Any, keep: set[int]) -> None:
        """Write ``state`` as the ``kind`` entry of ``step``; of the other entries of that kind only those of
        ``keep``'s steps stay (their memory is written over from now on)."""
        for key in [k for k in self._live if k[0] == kind and (k[1] == step or k[1] not in keep)]:
            self._drop(key)
        meta, size, sources = pack_plan(state)
        head = _aligned(meta.numel())
        offset, slot = self._room(head + size), self._free_slot()
        fields = self._slots[slot]
        if int(fields[0]) % 2 == 0:
            fields[0] += 1  # a fresh slot (0): odd while written
        data = self.segment.tensor
        data[offset : offset + meta.numel()].copy_(meta)
        for at, flat in sources:
            data[offset + head + at : offset + head + at + flat.numel()].copy_(flat)
        fields[1:6] = torch.tensor([KINDS.index(kind), step, offset, meta.numel(), size])
        fields[0] += 1  # even: complete
        self._live[(kind, step)] = (slot, offset, head + size)
        self.extent = max(self.extent, offset + head + size)

    def forget(self) -> None:
        """A new ring after a recovery: no entry written so far will be read."""
        for key in list(self._live):
            self._drop(key)

    def _drop(self, key: tuple[str, int]) -> None:
        slot, _, _ = self._live.pop(key)
        self._slots[slot, 0] += 1  # odd: no entry

    def _room(self, nbytes: int) -> int:
        """The lowest offset with ``nbytes`` free (entries are written where older ones were, so the pages
        touched stay close to what the kept entries need)."""
        start = _DATA
        for _, offset, length in sorted(self._live.values(), key=lambda v: v[1]):
            if offset - start >= nbytes:
                break
            start = max(start, _aligned(offset + length))
        if start + nbytes > self.segment.nbytes:
            raise RuntimeError(f"torchpass: the ring copies of this rank's state need more than "
                               f"{self.segment.nbytes >> 30} GiB; lower replicate_every_n_steps")
        return start

    def _free_slot(self) -> int:
        used = {slot for slot, _, _ in self._live.values()}
        for slot in range(SLOTS):
            if slot not in used:
                return slot
        raise RuntimeError(f"torchpass: more than {SLOTS} ring copies of this rank's state are kept at once; "
                           "lower replicate_every_n_steps")


class PredecessorMailbox:
    """The ring predecessor's mailbox, mapped here: read only when the predecessor was lost (or at a
    recovery, to say what could be rebuilt), when it no longer writes."""

    def __init__(self, segment: SegmentId, nbytes: int = RESERVE) -> None:
        self._data = map_peer(segment, nbytes)  # OSError where this process cannot map it
        self._slots = self._data[:_DATA].view(torch.int64).view(SLOTS, _SLOT_FIELDS)

    def _complete(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the directory, and which of its slots hold a complete ``kind`` entry."""
        table = self._slots.clone()
        return table, (table[:, 0] > 0) & (table[:, 0] % 2 == 0) & (table[:, 1] == KINDS.index(kind))

    def steps(self, kind: str) -> set[int]:
        """The steps of the complete ``kind`` entries."""
        table, complete = self._complete(kind)
        return set(table[complete, 2].tolist())

    def get(self, kind: str, step: int) -> Any | None:
        """The ``kind`` entry of ``step``, copied out; None if there is no complete one."""
        table, complete = self._complete(kind)
        found = (complete & (table[:, 2] == step)).nonzero().flatten()
        if not found.numel():
            return None
        slot = int(found[0])
        seq, _, _, offset, meta_n, size = table[slot, :6].tolist()
        head = _aligned(meta_n)
        state = unpack(self._data[offset : offset + meta_n].clone(), self._data[offset + head : offset + head + size])
        return state if int(self._slots[slot, 0]) == seq else None  # else rewritten meanwhile
