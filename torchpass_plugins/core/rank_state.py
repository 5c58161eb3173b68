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

A successor on the same host reads nothing at all while training goes: it maps its predecessor's
:class:`~torchpass_plugins.core.mailbox.Mailbox` once per generation (settled by the generation's first
hand-over, which is sent as a message), and from then on a hand-over is the predecessor writing its entry
there, with no message and no wait. The successor reads an entry only when it needs one: at a recovery, once
the predecessor was lost (a predecessor killed while writing leaves no entry of that step, as if it had died
before the exchange). A successor on another host (or in another PID namespace) receives every entry as a
message instead.

A rank lost together with its successor (two failures at once, or one during the recovery from another)
leaves no copy of its state; its spare then starts those values over, as resuming from a snapshot would,
and the log says so (event ``rank_state_lost``). A second holder would close that gap, but in small rings
it is also a predecessor, so a connection would carry messages both ways, and gloo aborts the process
when it tears down such a connection to a peer that died.
"""

from __future__ import annotations

from typing import Any

import torch

from torchpass_plugins.core.mailbox import Mailbox, PredecessorMailbox
from torchpass_plugins.core.peer_memory import NOT_MAPPED, SegmentId
from torchpass_plugins.core.process_group import ReconfigurableGroup
from torchpass_plugins.core.state_transfer import fields_of, first_buffer, frame, pack, structure_of, unpack

_TAG, _ANSWER = 7, 8  # apart from the state hand-over's messages between the same two ranks
_FIELDS = 7  # step, structure bytes, payload bytes, the sender's mailbox (pid, fd, device, inode; -1: none)
KEEP = 2


class RankStateRing:
    """This rank's copies of its ring predecessor's rank-local state, by kind and step: the last ``KEEP`` of
    each kind, unless ``keep_votes`` is False (``torchpass_fsdp``'s vote copies carry the step's gradient
    too, kept until its replica round makes them unneeded: ``keep_votes_from`` of :meth:`exchange` for
    those in this rank's mailbox, :meth:`forget_votes_before` for those received)."""

    def __init__(self, keep_votes: bool = True, share_memory: bool = True) -> None:
        self.copies: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {"vote": {}, "boundary": {}}
        self._bounded = {"vote": keep_votes, "boundary": True}
        self._share = share_memory  # (False: every entry is sent, as to another host)
        self._mailbox: Mailbox | None = None  # this rank's, made at the first hand-over
        self._pred: PredecessorMailbox | None = None  # the predecessor's, where this rank maps it
        self._gen: int | None = None  # the generation whose first hand-over settled who maps whose mailbox
        self._succ_maps = False
        self.peak_bytes = 0  # the most host memory the copies held at once (reported with the replicas')

    def exchange(self, transport: ReconfigurableGroup, kind: str, step: int, state: Any,
                 keep_votes_from: int | None = None) -> None:
        """Hand ``state`` to the successor: into this rank's mailbox where the successor maps it, else as a
        message while receiving the predecessor's (raises ``PeerFailure``). Either way it is at the successor
        when this returns, so before the vote. ``keep_votes_from``: the oldest step whose vote entry the
        successor may still need (with ``keep_votes`` False)."""
        if transport.world_size < 2:
            return
        settle = self._gen != transport.gen
        to_mailbox = not settle and self._succ_maps
        if to_mailbox:
            self._mailbox.put(kind, step, state, self._kept(kind, step, keep_votes_from))
        receive = settle or self._pred is None
        if receive or not to_mailbox:
            self._messages(transport, kind, step, None if to_mailbox else state, receive, settle)
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def _messages(self, transport: ReconfigurableGroup, kind: str, step: int, state: Any, receive: bool,
                  settle: bool) -> None:
        """Send ``state`` to the successor (unless None: it maps this rank's mailbox) and, if ``receive``,
        the predecessor's entry from it (where this rank does not map the predecessor's mailbox); each rank
        decides both per neighbour, so ranks on either side of a host boundary pair up. The first hand-over
        of a generation does both and settles whether each rank maps its predecessor's mailbox: it announces
        its own, and answers whether it mapped the one announced to it."""
        succ, pred = (transport.rank + 1) % transport.world_size, (transport.rank - 1) % transport.world_size
        what, works, rest = f"rank state at the {kind}", [], None
        if state is not None:
            meta, payload = pack(state)
            mailbox = self._own_mailbox() if settle else None
            where = mailbox.id.to_list() if mailbox is not None else NOT_MAPPED
            first, rest = frame([step, meta.numel(), payload.numel(), *where], torch.cat([meta, payload]))
            works.append(transport.send([first], succ, _TAG))
        if receive:
            theirs = first_buffer()
            works.append(transport.recv([theirs], pred, _TAG))
        transport.wait_all(works, what)
        works = [transport.send([rest], succ, _TAG)] if rest is not None else []
        if receive:
            got_step, meta_n, payload_n, *at = fields_of(theirs, _FIELDS)
            blob, rest_in = structure_of(theirs, _FIELDS, meta_n + payload_n)
            works += [transport.recv([rest_in], pred, _TAG)] if rest_in is not None else []
        if settle:
            view = self._map(SegmentId(*at))
            answer, reply = torch.tensor([int(view is not None)]), torch.zeros(1, dtype=torch.int64)
            works += [transport.send([answer], pred, _ANSWER), transport.recv([reply], succ, _ANSWER)]
        if works:
            transport.wait_all(works, what)
        if settle:
            self._pred, self._succ_maps, self._gen = view, bool(reply.item()), transport.gen
        if receive:
            kept = self.copies[kind]
            kept[got_step] = (blob[:meta_n], blob[meta_n:])
            for old in sorted(kept)[:-KEEP] if self._bounded[kind] else ():
                del kept[old]

    def _own_mailbox(self) -> Mailbox | None:
        if self._mailbox is None and self._share:
            try:
                self._mailbox = Mailbox()
            except OSError:  # (address space limited: ulimit -v) the entries are sent instead
                self._share = False
        return self._mailbox

    def _map(self, segment: SegmentId) -> PredecessorMailbox | None:
        if not self._share or segment.pid < 0:
            return None
        try:
            return PredecessorMailbox(segment)
        except OSError:  # another host or PID namespace
            return None

    def _kept(self, kind: str, step: int, keep_votes_from: int | None) -> set[int]:
        """The steps of this rank's ``kind`` entries that stay in its mailbox besides ``step``'s."""
        others = [s for s in self._mailbox.steps(kind) if s != step]
        if kind == "vote" and not self._bounded["vote"] and keep_votes_from is not None:
            return {s for s in others if s >= keep_votes_from}
        return set(others[-(KEEP - 1):])

    def nbytes(self) -> int:
        """The host memory this rank holds for the ring's copies: those it received, and its mailbox (not the
        predecessor's that it maps: that memory is the predecessor's)."""
        mailbox = self._mailbox.extent if self._mailbox is not None else 0
        return mailbox + sum(meta.numel() + payload.numel() for kept in self.copies.values()
                             for meta, payload in kept.values())

    def get(self, kind: str, step: int) -> Any:
        if step in self.copies[kind]:
            return unpack(*self.copies[kind][step])
        state = self._pred.get(kind, step) if self._pred is not None else None
        if state is None:
            raise RuntimeError(f"torchpass: the predecessor's {kind} copy of step {step} changed while read")
        return state

    def held(self, kind: str) -> set[int]:
        """The steps whose ``kind`` copy this rank holds (received, or complete in the mapped mailbox)."""
        return set(self.copies[kind]) | (self._pred.steps(kind) if self._pred is not None else set())

    def logged(self) -> set[int]:
        """The steps whose vote copy this rank holds."""
        return self.held("vote")

    def forget_votes_before(self, step: int) -> None:
        """The received vote copies before ``step`` (those in the predecessor's mailbox are its to keep)."""
        for old in [s for s in self.copies["vote"] if s < step]:
            del self.copies["vote"][old]

    def clear(self) -> None:
        """A new ring (after a recovery): the copies came from a predecessor this rank may no longer have."""
        for kept in self.copies.values():
            kept.clear()
        self._pred, self._gen = None, None
        if self._mailbox is not None:
            self._mailbox.forget()

    def for_entry(self, entry: int) -> tuple[str, Any]:
        """The predecessor's state at boundary ``entry``: ``("boundary", state)``; else as of the vote before
        it, ``("vote", state)``; else ``("none", None)``: this rank was a spare itself when the copy went round,
        or the predecessor was lost before the first boundary's."""
        for kind, step in (("boundary", entry), ("vote", entry - 1)):
            if step in self.held(kind):
                return kind, self.get(kind, step)
        return "none", None
