"""The coordinator's spare pool: how lost ranks get a spare (at once, after a wait for refilled workers, or on
a device borrowed from a lending job), how a rank moves to a spare at a step boundary (a planned migration),
and how a borrowed device is given back. A mixin of :class:`Coordinator`, whose state it uses."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from torchpass_plugins.control.policy import Action
from torchpass_plugins.control.protocol import (
    DRAIN_KEY,
    TRAINED_KEY,
    Roster,
    SpareDeadline,
    assign_key,
    borrow_key,
    slot_order,
)


@dataclass(frozen=True)
class Move:
    """A planned migration: ``worker`` hands logical rank ``rank`` to the reserved ``spare``."""

    rank: int
    worker: str
    spare: str
    why: str


class SparePool:
    """Replacing, borrowing and moving ranks (see the module docstring)."""

    def _replace(self, lost: list[int]) -> None:
        training_complete = bool(self.finished) or self.store.check([TRAINED_KEY])
        decision = self.policy.ranks_lost(lost, len(self.spares), training_complete=training_complete)
        if decision.action is Action.BORROW:
            self._borrow(lost)
        elif decision.action is Action.WAIT and not self._short:
            self.events.emit("spare_awaited", ranks=lost, spares=len(self.spares), wait_s=self.policy.spare_wait_s)
            self._later(self.policy.spare_wait_s, SpareDeadline(self.gen))
        if decision.action in (Action.WAIT, Action.BORROW):
            self._short = lost
            return
        if decision.action is not Action.REPLACE:
            self._stop_job(decision)
            return
        self._short, self._borrowed_for = [], set()
        assignments = {}
        for rank in lost:
            spare = self.spares.popleft()
            self.ranks[rank] = spare
            assignments[spare] = rank
        self._publish(Roster(self.gen + 1, tuple(self.ranks), reason=f"replace rank(s) {lost}"), assignments)

    def _borrow(self, lost: list[int]) -> None:
        """Ask the agents of the lost workers' nodes for devices of lending jobs, for the ranks not yet asked
        for in this shortage; the first request arms the deadline of the wait for their workers."""
        new = [r for r in lost if r not in self._borrowed_for]
        if not new:
            return
        if not self._borrowed_for:
            self.events.emit("spare_awaited", ranks=lost, spares=len(self.spares), wait_s=self.policy.borrow_wait_s)
            self._later(self.policy.borrow_wait_s, SpareDeadline(self.gen))
        self._borrowed_for.update(new)
        for node, count in Counter(slot_order(self.ranks[r])[0] for r in new).items():
            self.store.add(borrow_key(node), count)
            self.events.emit("borrow_requested", node=node, devices=count)

    def _give_back_borrowed(self) -> None:
        """Workers on devices borrowed from a lending job leave once the job's own pool can do without them: an
        idle one at once, one holding a rank (moved at a step boundary) once a spare of the job's own is free."""
        for worker_id in [w for w in self.spares if w in self._on_loan]:
            self._on_migrate(worker_id, "no rank needs the borrowed device: it goes back")
        holding = [w for w in self.ranks if w in self._on_loan]
        if holding and self.spares and self.moving is None:
            self._on_migrate(holding[0], "a spare of the job's own joined: the borrowed device goes back")

    def _on_migrate(self, worker_id: str, why: str) -> None:
        """Move the worker's rank to a spare at a step boundary (the ranks agree on which one); a spare on a
        suspect device just leaves the pool."""
        decision = self.policy.migration_requested(
            job_over=self.outcome is not None, is_spare=worker_id in self.spares, is_rank=worker_id in self.ranks,
            moving=self.moving is not None, spares=len(self.spares))
        if decision.action is Action.RETIRE:
            self.spares.remove(worker_id)
            self.store.set(assign_key(worker_id), json.dumps({"exit": f"retired: {why}"}))
            self.events.emit("spare_retired", worker=worker_id, why=why, spares=len(self.spares))
        elif decision.action is Action.REFUSE:
            self.events.emit("migration_refused", worker=worker_id, rank=self.ranks.index(worker_id), why=why,
                             reason=decision.why)
        elif decision.action is Action.MIGRATE:
            rank = self.ranks.index(worker_id)
            self.moving = Move(rank, worker_id, self.spares.popleft(), why)
            self._moves += 1
            self.store.set(DRAIN_KEY, json.dumps({"id": self._moves, "rank": rank, "worker": worker_id, "why": why}))
            self.events.emit("migration_requested", worker=worker_id, rank=rank, spare=self.moving.spare, why=why)

    def _on_drained(self, worker_id: str) -> None:
        """The moving worker left at the agreed boundary: promote the reserved spare to its rank."""
        move = self.moving
        if move is None or move.worker != worker_id or self.outcome is not None:
            self._left.add(worker_id)  # its spare was lost meanwhile: its exit is a loss like any other
            return
        self.moving = None
        self.ranks[move.rank] = move.spare
        self._publish(Roster(self.gen + 1, tuple(self.ranks), reason=f"migrate rank {move.rank}: {move.why}"),
                      {move.spare: move.rank})
