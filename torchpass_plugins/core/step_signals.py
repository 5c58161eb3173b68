"""Planned migrations and step times, carried by a collective every step makes anyway.

Each rank contributes a row to a sum every rank receives (every strategy appends it to its commit vote),
so every rank reads the same total and takes the same decisions without a message of its own: which rank
moves to a spare at which boundary, and which ranks are stragglers. The straggler verdict is an observation sent to the
coordinator; whether the rank moves is the coordinator's decision.
"""

from __future__ import annotations

import statistics

import torch

from torchpass_plugins.control.membership import Member
from torchpass_plugins.control.protocol import LeftForMigration, Straggler, send
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.core.process_group import ReconfigurableGroup
from torchpass_plugins.health.stragglers import StepTimer, stragglers
from torchpass_plugins.observe.events import EventLog


class StepSignals:
    """One rank's side of the per-step signals: its row, and the decisions taken from the total."""

    def __init__(self, env: WorkerEnv, member: Member, group: ReconfigurableGroup, events: EventLog) -> None:
        self.env, self.member, self.group, self.events = env, member, group, events
        self.timer = StepTimer(env.straggler_window)
        self.drain: tuple[int, int, str] | None = None  # agreed planned migration: (boundary, rank, its worker)
        self._judged = -1  # the step of the last straggler verdict
        self._reported_slow = False

    def row(self) -> torch.Tensor:
        """This rank's row: a 1 at the index of a rank the coordinator asked to migrate (if this rank has
        seen that notice), and this rank's median compute time per step at ``world_size + rank``."""
        w, rank, gen = self.env.world_size, self.group.rank, self.group.gen
        row = [0.0] * (2 * w)  # built in Python: one tensor op instead of several, on the step's hot path
        notice = self.member.drain_notice
        if notice is not None and self.member.roster(gen).ranks[notice["rank"]] != notice["worker"]:
            self.member.drain_carried_out()  # stale: that worker no longer holds the rank
            notice = None
        if notice is not None:
            row[notice["rank"]] = 1.0
        row[w + rank] = self.timer.median
        return torch.tensor(row, dtype=torch.float64)

    def take(self, total: torch.Tensor, step: int, drain_at: int) -> None:
        """``total``: the sum of every rank's :meth:`row` at step ``step``, the same on every rank, so every
        rank takes the same decisions: the migration (at boundary ``drain_at``) and the verdict."""
        w = self.env.world_size
        values = total.tolist()
        asked = next((r for r in range(w) if values[r]), None)
        if asked is not None and self.drain is None:
            self.drain = (drain_at, asked, self.member.roster(self.group.gen).ranks[asked])
        window = self.timer.window
        if window and step and step % window == 0 and self._judged != step:
            self._judged = step
            self._judge(values[w:], step)

    def _judge(self, medians: list[float], step: int) -> None:
        rank = self.group.rank
        slow = stragglers(medians, self.env.straggler_factor)
        if not slow:
            return
        if rank == 0:  # one record for the job
            self.events.emit("straggler", ranks=slow, step=step, window=self.timer.window,
                             compute_s=medians, factor=self.env.straggler_factor)
        if rank in slow and not self._reported_slow:  # the coordinator's policy decides whether it moves
            self._reported_slow = True
            typical = statistics.median(medians)
            why = f"straggler: rank {rank} computes {medians[rank] / typical:.2f}x the median step"
            send(self.member.store, Straggler(self.env.worker_id, why))

    def drain_due(self, step: int) -> int | None:
        """The logical rank that moves to a spare at this boundary, if one does. A migration whose worker
        was lost meanwhile (and replaced by a recovery) is dropped: its rank has moved already."""
        if self.drain is None or self.drain[0] != step:
            return None
        _, rank, worker = self.drain
        if self.member.roster(self.group.gen).ranks[rank] != worker:
            self.drain = None
            self.member.drain_carried_out()
            return None
        return rank

    def replaced_by_drain(self, step: int) -> int | None:
        """The rank that moves at boundary ``step`` if the roster that replaced this rank's group is that
        move: the moving worker leaves as soon as it has passed the boundary's first collective (the
        rank-state exchange, which on one host goes through mailboxes and waits for no one), so a rank that
        reaches the boundary later finds its group replaced by the migration's roster. None otherwise."""
        if self.drain is None or self.drain[0] != step or self.member.latest_gen <= self.group.gen:
            return None
        _, rank, worker = self.drain
        roster = self.member.roster(self.group.gen + 1)  # the move, not a failure that replaced the rank
        return rank if roster.ranks[rank] != worker and roster.reason.startswith(f"migrate rank {rank}") else None

    def recovery_cause(self, step: int, cause: str) -> str:
        """``cause``, unless the group was replaced by the migration agreed for this boundary."""
        moved = self.replaced_by_drain(step)
        return cause if moved is None else f"planned migration of rank {moved}"

    def take_drain(self) -> int:
        """The agreed migration happens now: forget it and return the rank that moves."""
        rank = self.drain[1]
        self.drain = None
        self.member.drain_carried_out()
        return rank


class Drained(SystemExit):
    """This worker handed its logical rank to a spare (a planned migration): exit cleanly."""


class SignalVerbs:
    """The runtime's verbs for the step signals and the migrations they agree on (mixed into ``Runtime``,
    whose ``signals``, ``transport``, ``member``, ``events``, ``leave_hooks`` and recovery they use)."""

    def drain_due(self, step: int) -> int | None:
        """The logical rank that moves to a spare at this boundary, if one does."""
        return self.signals.drain_due(step)

    def carry_out_drain(self, step: int) -> None:
        """At the agreed boundary: the moving rank leaves; the others rebuild the group with the spare."""
        rank = self.end_drain(step)
        # where this rank is: past the boundary's collectives (the rank-state exchange), which the spare,
        # entering at this boundary, must then skip as it would after a failure
        self._recover((self.step, self.count), reduced=False, cause=f"planned migration of rank {rank}")

    def end_drain(self, step: int) -> int:
        """The agreed migration happens now: the moving rank leaves (this does not return there); the
        others get the rank that moved, and rebuild the group with the spare."""
        rank = self.signals.take_drain()
        if rank != self.rank:
            return rank
        # Tell the coordinator (which promotes the reserved spare), land what is in flight, and exit. The
        # state reaches the spare from a peer at this boundary.
        send(self.member.store, LeftForMigration(self.env.worker_id))
        self.events.emit("drained", rank=self.rank, worker=self.env.worker_id, step=step)
        for hook in self.leave_hooks:
            hook()
        raise Drained(0)
