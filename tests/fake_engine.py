"""A job of several :class:`Runtime` s in one process, one thread per worker, over fakes of the membership
and the process group (``fake_group``), so that the recovery protocol runs, and fails, deterministically and
in milliseconds.

:class:`FakeWorld` is the coordinator: rosters (rank -> worker) by generation, the assignments of the
spares, and the faults a test scripts: :class:`Kill` (a rank dies at a fault point), :class:`Cut` (a rank
dies while a collective completes, its result reaching only some ranks) and :class:`Republish` (a newer
roster appears while ranks wait in a collective). A dead rank's generations fail and the next roster gives
its rank to the first waiting spare. :func:`run_job` runs a job to its end and returns what each worker did
(:class:`Job`): its outcome, runtime, adapter and phases, the events, every operation tried.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch.distributed as dist
from fake_group import FakeGroup, Generation, Killed, Op

from torchpass_plugins.control.membership import JobAborted
from torchpass_plugins.control.protocol import TRAINED_KEY, Roster, RosterChange
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.core.runtime import Runtime, SpareReleased
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing import faults

_TICK = 0.05  # a waiter looks at the deadline this often (every change of the world wakes it at once)


@dataclass
class Kill:
    """Logical rank ``rank`` dies at fault point ``phase`` of step ``step``."""

    rank: int
    step: int
    phase: str


@dataclass
class Cut:
    """Rank ``victim`` dies as collective ``what`` of step ``step`` completes: only ``delivered`` get its result."""

    victim: int
    step: int
    what: str
    delivered: tuple[int, ...] = ()


@dataclass
class Republish:
    """Once ``posted`` ranks entered collective ``what`` of step ``step``, a newer roster (the same workers)
    is published: they wait in a generation that is no longer the newest."""

    step: int
    what: str
    posted: int = 2


class FakeWorld:
    """The coordinator of one job, and its generations; every change wakes every waiter (one condition)."""

    def __init__(self, world_size: int, spares: int, faults_: list, timeout_s: float) -> None:
        self.world_size = world_size
        self.cond = threading.Condition()
        workers = [f"w{i}" for i in range(world_size + spares)]
        self.rosters = {0: Roster(0, tuple(workers[:world_size]))}
        self.assignments = {w: {"gen": 0, "rank": r} for r, w in enumerate(workers[:world_size])}
        self.waiting_spares = deque(workers[world_size:])
        self.generations: dict[int, Generation] = {}
        self.faults = list(faults_)
        self.dead: set[str] = set()
        self.finished: set[str] = set()
        self.done = False
        self.broken: str | None = None  # an unexpected error anywhere: every waiter gives up
        self.errors: list[str] = []  # protocol violations seen by the fake network
        self.ops: list[tuple[int, str, int, int, str, str]] = []  # (gen, worker, rank, step, kind, what)
        self.events: list[dict[str, Any]] = []
        self.store = dist.HashStore()
        self.deadline = time.monotonic() + timeout_s

    @property
    def latest_gen(self) -> int:
        return max(self.rosters)

    def generation(self, gen: int) -> Generation:
        if gen not in self.generations:
            self.generations[gen] = Generation(self, gen)
        return self.generations[gen]

    def wait(self, worker: str) -> None:
        """One turn of ``worker``'s wait for a change, with ``cond`` held: a dead worker waits no more."""
        if worker in self.dead:
            raise Killed(worker)
        if self.broken:
            raise AssertionError(f"fake world: gave up after another worker failed: {self.broken}")
        if time.monotonic() > self.deadline:
            self.broken = "deadline passed"
            raise AssertionError("fake world: a worker waited past the job's deadline (a hang)")
        self.cond.wait(_TICK)

    def _publish(self, ranks: tuple[str, ...], reason: str, abort: str | None = None) -> None:
        gen = self.latest_gen + 1
        self.rosters[gen] = Roster(gen, ranks, abort=abort, reason=reason)
        self.cond.notify_all()

    def lost(self, worker: str) -> None:
        """``worker`` died: its generations fail, and the next roster gives its rank to a spare."""
        with self.cond:
            self.dead.add(worker)
            for g in self.generations.values():
                if worker in g.roster.ranks:
                    g.fail(f"{worker} died")
            ranks = list(self.rosters[self.latest_gen].ranks)
            if worker not in ranks:
                return
            rank = ranks.index(worker)
            if self.store.check([TRAINED_KEY]):  # the coordinator's policy: nothing left to recover
                return self._publish(tuple(ranks), f"{worker} died", abort=f"rank {rank} lost after training")
            if not self.waiting_spares:
                return self._publish(tuple(ranks), f"{worker} died", abort=f"no spare for rank {rank}")
            ranks[rank] = spare = self.waiting_spares.popleft()
            self._publish(tuple(ranks), f"{worker} died")
            self.assignments[spare] = {"gen": self.latest_gen, "rank": rank}

    def finish(self, worker: str, aborted: str | None = None) -> None:
        """``worker`` left the job: finished training (done once every rank has), or stopped it with the
        message ``aborted``, which the coordinator publishes to every member (as an aborting roster)."""
        with self.cond:
            self.finished.add(worker)
            self.done = aborted is not None or set(self.rosters[self.latest_gen].ranks) <= self.finished
            if aborted is not None and self.rosters[self.latest_gen].abort is None:
                self._publish(self.rosters[self.latest_gen].ranks, "aborted", abort=aborted)
            self.cond.notify_all()

    def break_(self, why: str) -> None:
        with self.cond:
            self.broken = self.broken or why
            self.cond.notify_all()

    def protocol_error(self, g: Generation, why: str) -> None:
        self.errors.append(why)
        g.fail(why)

    def kill_due(self, rank: int, step: int, phase: str) -> bool:
        with self.cond:
            for f in self.faults:
                if isinstance(f, Kill) and (f.rank, f.step, f.phase) == (rank, step, phase):
                    self.faults.remove(f)
                    return True
        return False

    def cut_due(self, ops: list[Op]) -> Cut | None:
        for f in self.faults:
            if isinstance(f, Cut) and (ops[f.victim].step, ops[f.victim].what) == (f.step, f.what):
                self.faults.remove(f)
                return f
        return None

    def republish_if_due(self, g: Generation, posted: list[Op]) -> None:
        for f in self.faults:
            if (isinstance(f, Republish) and len(posted) == f.posted
                    and all((op.step, op.what) == (f.step, f.what) for op in posted)):
                self.faults.remove(f)
                self._publish(g.roster.ranks, f"republished at {f.what} of step {f.step}")
                return


class FakeMember:
    """What the runtime uses of :class:`~torchpass_plugins.control.membership.Member`."""

    def __init__(self, world: FakeWorld, worker: str, env: WorkerEnv) -> None:
        self.world, self.worker, self.env = world, worker, env
        self.store = world.store
        self.drain_notice = None

    @property
    def latest_gen(self) -> int:
        return self.world.latest_gen

    def join(self) -> None:
        pass

    def wait_assignment(self, idle=lambda: None) -> dict:
        while True:
            idle()
            with self.world.cond:
                if self.worker in self.world.assignments:
                    return self.world.assignments[self.worker]
                if self.world.done:
                    return {"exit": "done"}
                self.world.wait(self.worker)

    def watch_from(self, gen: int) -> None:
        pass

    def roster(self, gen: int) -> Roster:
        return self.world.rosters[gen]

    def change(self, gen: int) -> RosterChange:
        return self.world.rosters[gen].change_from(self.world.rosters.get(gen - 1))

    def wait_newer_than(self, gen: int) -> None:
        with self.world.cond:
            while self.world.latest_gen <= gen:
                self.world.wait(self.worker)

    def drain_carried_out(self) -> None:
        pass

    def close(self) -> None:
        pass


class RecordingEvents(EventLog):
    """The event log, kept in the world's list (``source``: the worker)."""

    def __init__(self, world: FakeWorld, worker: str) -> None:
        super().__init__(None, source=worker)
        self.world = world

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = super().emit(event, **fields)
        with self.world.cond:
            self.world.events.append(record)
        return record


def runtime_for(world: FakeWorld, worker: str, seed: int) -> Runtime:
    """``worker``'s runtime, on the world's fakes (no straggler windows: they would depend on timing)."""
    env = WorkerEnv(store="fake:0", token="", worker_id=worker, world_size=world.world_size, node_rank=0,
                    local_slot=0, run_dir="", seed=seed, heartbeat_interval=1.0, straggler_window=0)
    member = FakeMember(world, worker, env)
    group = FakeGroup(world, member)
    rt = Runtime(env, group.timeout, member=member, group=group, events=RecordingEvents(world, worker))
    group.runtime = rt
    return rt


@dataclass
class Worker:
    """One worker of a job, and how it ended: finished, killed, released (a spare never needed), aborted."""

    name: str
    outcome: str = "running"
    rt: Runtime | None = None
    trainer: Any = None  # its adapter
    phases: list[tuple[Any, Phase]] = field(default_factory=list)  # (where, phase): after join, entry, boundaries


@dataclass
class Job:
    world: FakeWorld
    workers: dict[str, Worker]

    def at_rank(self) -> dict[int, Worker]:
        """The worker that finished training at each logical rank."""
        return {w.rt.rank: w for w in self.workers.values() if w.outcome == "finished"}

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.world.events if e["event"] == name]

    def tries(self, worker: str, step: int, what: str, gen: int | None = None) -> int:
        """How often ``worker`` issued, or tried to issue, collective ``what`` at step ``step`` in generation
        ``gen`` (None: any; a try in a generation that a newer one replaced counts)."""
        return sum(1 for g, w, _, s, _, wh in self.world.ops if (w, s, wh) == (worker, step, what) and gen in (None, g))


_here = threading.local()  # the thread's world and fault position (``faults`` keeps one per process)


def _at(rank: int, step: int) -> None:
    _here.where = (rank, step)


def _point(phase: str) -> None:
    world = getattr(_here, "world", None)
    if world is not None and world.kill_due(*_here.where, phase):
        raise Killed(phase)


def _run_worker(world: FakeWorld, w: Worker, train: Callable[[Runtime, Worker], None], seed: int) -> None:
    _here.world, _here.where = world, (-1, -1)
    try:
        w.rt = rt = runtime_for(world, w.name, seed)
        rt.join()
        w.phases.append(("joined", rt.phase))
        train(rt, w)
        w.outcome = "finished"
        world.finish(w.name)
    except Killed:
        w.outcome = "killed"
        world.lost(w.name)
    except SpareReleased:
        w.outcome = "released"
    except JobAborted as exc:
        w.outcome = f"aborted: {exc}"
        world.finish(w.name, aborted=str(exc))
    except BaseException:
        w.outcome = "error: " + traceback.format_exc()
        world.break_(f"{w.name}: {traceback.format_exc(limit=1)}")


def run_job(train: Callable[[Runtime, Worker], None], world_size: int, spares: int, scripted: list[Any],
            seed: int, timeout_s: float = 20.0) -> Job:
    """Run a job, each worker in a thread of its own: ``train`` takes over once the worker joined (it sets
    the adapter, enters a promoted spare, trains). Fails on an unexpected error, a hang, a protocol
    violation or a scripted fault that never fired."""
    world = FakeWorld(world_size, spares, scripted, timeout_s)
    workers = {f"w{i}": Worker(f"w{i}") for i in range(world_size + spares)}
    threads = [threading.Thread(target=_run_worker, args=(world, w, train, seed), name=f"fake-{w.name}", daemon=True)
               for w in workers.values()]
    with mock.patch.object(faults, "at", _at), mock.patch.object(faults, "point", _point):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 5)
        if any(t.is_alive() for t in threads):
            world.break_("the test gave up waiting")
            for t in threads:
                t.join(5)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads still running: {stuck}"
    errors = [f"{w.name}: {w.outcome}" for w in workers.values() if w.outcome.startswith("error")]
    assert not errors, "\n".join(errors)
    assert world.errors == [], world.errors
    assert not world.faults, f"faults that never fired: {world.faults}"
    return Job(world, workers)
