"""Borrowed spares: a job launched with ``--lend`` lets jobs launched with ``--borrow`` on its nodes borrow
its devices when they lose a worker and no spare of their own joins in time.

Each lending agent lists itself in a registry on its node (``--lend-registry``, a directory; one
subdirectory per user): its job's store, its node and its pid. The borrowing job's coordinator asks its agent
on the node that lost the worker; that agent asks each live lender listed in turn, through the lender's
store, and waits up to ``--yield-timeout`` seconds: the lender SIGKILLs the worker of one of its slots and
names that slot's device. The borrower starts a worker there (``CUDA_VISIBLE_DEVICES`` set to that device),
which joins its job as a spare and takes the lost rank. The lender's job handles its yielded worker as any
lost worker (a spare of its own takes the rank, or it restarts from its newest snapshot once the slot is
back). The borrowed worker leaves once the borrowing job can do without it (a spare of its own joined), or
at its end; its agent then gives the device back, and the lender starts its slot again. A lender also takes
its device back when the borrowing agent dies, and a borrower that stops waiting cancels its request, so a
device is never lost between two jobs.

The exchange is a few keys in the lender's store, outside its attempts' prefixes (a lender that restarts
keeps its loans): ``lend/N/asked`` counts requests to node N, ``lend/N/ask/K`` is request K (the borrower's
store and agent pid), ``lend/N/answer/K`` its answer, ``lend/N/back/K`` set when the device is given back or
the request cancelled.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchpass_plugins.control.membership import connect_store
from torchpass_plugins.control.protocol import borrow_key

_POLL_S = 0.1
_UNWRITTEN_S = 5.0  # a request numbered but not written this long was dropped by a borrower that died
_LATE_S = 0.5  # past its own deadline, how long a borrowing thread may still deliver before its loan goes back


class BorrowFailed(RuntimeError):
    """No lender of this node gave a slot in time."""


@dataclass(frozen=True)
class Lender:
    endpoint: str  # its job's store, as its workers reach it
    node: int
    pid: int  # its agent


class Registry:
    """The lenders of this node: one JSON file per lending agent, in a directory of the user's own under
    ``directory`` (jobs find each other when they run as the same user, as a platform's do)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory) / str(os.getuid())

    def enter(self, endpoint: str, node: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.directory / f"{os.getpid()}.json"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps({"endpoint": endpoint, "node": node, "pid": os.getpid()}))
        partial.chmod(0o600)
        partial.replace(path)
        return path

    def lenders(self, other_than: str) -> list[Lender]:
        """The live lenders listed, oldest first, other than the job at ``other_than``."""
        found = []
        for path in self.directory.glob("*.json"):
            try:
                entry, listed = Lender(**json.loads(path.read_text())), path.stat().st_mtime
            except (OSError, ValueError, TypeError):
                continue  # half gone
            if entry.endpoint != other_than and _alive(entry.pid):
                found.append((listed, entry))
        return [entry for _, entry in sorted(found, key=lambda pair: pair[0])]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Request:
    number: int
    borrower: str  # the borrowing job's store
    pid: int  # the borrowing agent: the device comes back when it dies


class LendingDesk:
    """The lender's side, polled by its agent: requests not yet seen, answers, devices given back."""

    def __init__(self, store: dist.Store, node: int) -> None:
        self.store, self.node = store, node
        self.seen = store.add(f"lend/{node}/asked", 0)  # (requests to an agent before this one are not its own)
        self.unwritten_since: float | None = None

    def requests(self) -> list[Request]:
        """The requests not yet seen, in order; one numbered but not yet written is waited for (never with a
        blocking read: the agent's supervision goes on) and skipped after ``_UNWRITTEN_S``."""
        asked, new = self.store.add(f"lend/{self.node}/asked", 0), []
        while self.seen < asked:
            key = f"lend/{self.node}/ask/{self.seen + 1}"
            if not self.store.check([key]):
                self.unwritten_since = self.unwritten_since or time.monotonic()
                if time.monotonic() - self.unwritten_since < _UNWRITTEN_S:
                    break
            else:
                try:
                    entry = json.loads(self.store.get(key))
                    new.append(Request(self.seen + 1, str(entry["borrower"]), int(entry["pid"])))
                except (ValueError, KeyError, TypeError):
                    pass  # not a request of ours: skipped
            self.seen, self.unwritten_since = self.seen + 1, None
        return new

    def answer(self, request: int, device: str | None, why: str = "") -> None:
        self.store.set(f"lend/{self.node}/answer/{request}", json.dumps({"device": device, "why": why}))

    def given_back(self, request: int) -> bool:
        return self.store.check([f"lend/{self.node}/back/{request}"])


@dataclass
class Loan:
    """A device borrowed from ``lender`` (request ``request``), to give back once its worker is gone."""

    lender: Lender
    request: int
    device: str

    def give_back(self) -> str | None:
        """Give the device back; the reason it could not be told, if any (the lender's agent is gone, or takes
        it back itself once this agent is gone)."""
        return _give_back(self.lender, self.request)


def _give_back(lender: Lender, request: int) -> str | None:
    try:
        connect_store(lender.endpoint, timeout=10.0).set(f"lend/{lender.node}/back/{request}", "1")
    except (dist.DistError, OSError) as exc:
        return str(exc).splitlines()[0]
    return None


def borrow(registry: Registry, own_endpoint: str, timeout_s: float) -> Loan:
    """A device from a lender of this node (each live one in turn) yielded within ``timeout_s`` seconds; a
    request not answered in time is cancelled (a late answer gives the device straight back)."""
    deadline = time.monotonic() + timeout_s
    refusals = []
    for lender in registry.lenders(other_than=own_endpoint):
        try:
            store = connect_store(lender.endpoint, timeout=max(1.0, deadline - time.monotonic()))
            request = store.add(f"lend/{lender.node}/asked", 1)  # (the lender's get waits for the set)
            store.set(f"lend/{lender.node}/ask/{request}", json.dumps({"borrower": own_endpoint, "pid": os.getpid()}))
            key = f"lend/{lender.node}/answer/{request}"
            while not store.check([key]):
                if time.monotonic() > deadline:
                    _give_back(lender, request)
                    raise BorrowFailed(f"the lender at {lender.endpoint} did not yield a device within {timeout_s:g} s")
                time.sleep(_POLL_S)
        except (dist.DistError, OSError) as exc:
            refusals.append(f"{lender.endpoint}: {str(exc).splitlines()[0]}")
            continue
        answer = json.loads(store.get(key))
        if answer["device"] is not None:
            return Loan(lender, request, answer["device"])
        refusals.append(f"{lender.endpoint}: {answer['why']}")
    raise BorrowFailed("; ".join(refusals) or f"no lender listed in {registry.directory}")


def device_of(slot: int) -> str:
    """The device of this node's slot ``slot`` as another job names it: its entry in ``CUDA_VISIBLE_DEVICES``
    when that is set (slot i uses visible GPU i), else the index."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[slot % len(visible)] if visible else str(slot)


class SlotLoans:
    """An agent's loans, tended at its supervision ticks: as a lender, the slots it yielded and gets back; as a
    borrower, the devices its coordinator asked for (borrowed on threads: a lender may take seconds). ``slots``
    are the agent's ``Slot``s (``lent_for``: the request a slot was yielded to; ``loan``: the loan a borrowed
    slot runs on)."""

    def __init__(self, *, lend: bool, borrow: bool, registry: str, yield_timeout: float, endpoint: str,
                 client: dist.Store, node: int, events: Any) -> None:
        self.registry, self.endpoint, self.node, self.events = Registry(registry), endpoint, node, events
        self.yield_timeout, self.borrowing = yield_timeout, borrow
        self.desk = LendingDesk(client.clone(), node) if lend else None
        self.listed = self.registry.enter(endpoint, node) if lend else None
        self.asked = 0  # devices the coordinator of this attempt asked this node to borrow, so far
        self.threads = 0  # borrowing threads started (numbered across attempts)
        self.pending: dict[int, float] = {}  # borrowing threads still out, by number: their deadlines
        self.answers: queue.SimpleQueue[tuple[int, Loan | BorrowFailed]] = queue.SimpleQueue()

    def tend(self, slots: list[Any], job_store: dist.Store, unhealthy: set[int], yield_slot: Callable[[Any], None],
             start: Callable[[Any], None], start_borrowed: Callable[[Loan], None]) -> None:
        if self.desk is not None:
            try:
                self._lend(slots, unhealthy, yield_slot, start)
            except dist.DistError as exc:  # the job's own store: this tick's look is lost, the next one retries
                self.events.emit("lending_error", error=str(exc).splitlines()[0])
        if self.borrowing:
            self._borrow_asked(job_store.add(borrow_key(self.node), 0), start_borrowed)

    def _lend(self, slots: list[Any], unhealthy: set[int], yield_slot: Callable[[Any], None],
              start: Callable[[Any], None]) -> None:
        for request in self.desk.requests():
            if self.desk.given_back(request.number):
                continue  # cancelled: the borrower stopped waiting
            slot = next((s for s in reversed(slots) if s.proc is not None and s.lent_for is None and s.loan is None
                         and s.index not in unhealthy), None)
            if slot is None:
                self.desk.answer(request.number, None, "no slot of this node is running a worker on a healthy device")
                continue
            slot.lent_for, device = request, device_of(slot.index)
            yield_slot(slot)
            self.desk.answer(request.number, device)
            self.events.emit("slot_lent", slot=slot.index, device=device, to=request.borrower)
        for slot in slots:
            if slot.lent_for is None:
                continue
            back = self.desk.given_back(slot.lent_for.number)
            if back or not _alive(slot.lent_for.pid):
                slot.lent_for = None
                self.events.emit("slot_returned", slot=slot.index,
                                 why="given back" if back else "the borrowing agent is gone")
                start(slot)

    def _borrow_asked(self, asked: int, start_borrowed: Callable[[Loan], None]) -> None:
        """Start a thread for each device newly asked for; start a worker on each device borrowed in time, and
        say which were not (a thread stuck on a frozen lender is left behind: a late loan goes straight back)."""
        for _ in range(self.asked, asked):
            self.pending[self.threads] = time.monotonic() + self.yield_timeout + _LATE_S
            threading.Thread(target=self._borrow, args=(self.threads,), name="torchpass-borrow", daemon=True).start()
            self.threads += 1
        self.asked = max(self.asked, asked)
        while not self.answers.empty():
            number, outcome = self.answers.get()
            if self.pending.pop(number, None) is None:
                if isinstance(outcome, Loan):
                    outcome.give_back()  # too late: its deadline was reported
            elif isinstance(outcome, Loan):
                self.events.emit("slot_borrowed", device=outcome.device, lender=outcome.lender.endpoint,
                                 request=outcome.request)
                start_borrowed(outcome)
            else:
                self.events.emit("borrow_failed", node=self.node, why=str(outcome))
        for number, deadline in list(self.pending.items()):
            if time.monotonic() > deadline:
                del self.pending[number]
                self.events.emit("borrow_failed", node=self.node, why=f"no lender of this node yielded a device "
                                                                       f"within {self.yield_timeout:g} s")

    def new_attempt(self) -> None:
        """The job restarted: its coordinator counts the devices it asks for afresh (a loan still on its way
        is given back when it comes)."""
        self.asked = 0
        for _ in self.pending:
            self.events.emit("borrow_failed", node=self.node, why="the job restarted before a lender yielded a device")
        self.pending.clear()

    def _borrow(self, number: int) -> None:
        try:
            self.answers.put((number, borrow(self.registry, self.endpoint, self.yield_timeout)))
        except BorrowFailed as exc:
            self.answers.put((number, exc))

    def give_back(self, loan: Loan) -> None:
        why = loan.give_back()
        self.events.emit("slot_given_back", device=loan.device, lender=loan.lender.endpoint,
                         **({"error": why} if why else {}))

    def close(self, slots: list[Any]) -> None:
        """The agent leaves: every device it borrowed goes back; it is no longer listed as a lender."""
        for slot in slots:
            if slot.loan is not None:
                self.give_back(slot.loan)
        if self.listed is not None:
            self.listed.unlink(missing_ok=True)
