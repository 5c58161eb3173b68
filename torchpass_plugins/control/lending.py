"""Borrowed spares: a job launched with ``--lend`` lets jobs launched with ``--borrow`` on its nodes borrow
its devices when they lose a worker and have no spare free.

Each lending agent lists itself in a registry on its node (``--lend-registry``, a directory): its job's
store and its node. The borrowing job's coordinator asks its agent on the node that lost the worker; that
agent takes the first live lender listed, asks it for a slot through the lender's store and waits up to
``--yield-timeout`` seconds: the lender SIGKILLs the worker of one of its slots and names that slot's
device. The borrower starts a worker there (``CUDA_VISIBLE_DEVICES`` set to that device), which joins its
job as a spare and takes the lost rank. The lender's job handles its yielded worker as any lost worker (a
spare of its own takes the rank, or the job restarts from its newest snapshot once the slot is back). When
the borrowed worker exits (its job ended), the borrower gives the device back and the lender starts its
slot again. A lender that does not answer in time leaves the borrower to its own fallback (its snapshot).

The exchange is a few keys in the lender's store, outside its attempts' prefixes (a lender that restarts
keeps its loans): ``lend/N/asked`` counts requests to node N, ``lend/N/ask/K`` is request K,
``lend/N/answer/K`` its answer, ``lend/N/back/K`` set when the device is given back.
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

_POLL_S = 0.1


class BorrowFailed(RuntimeError):
    """No lender of this node gave a slot in time."""


@dataclass(frozen=True)
class Lender:
    endpoint: str  # its job's store, as its workers reach it
    node: int
    pid: int  # its agent


class Registry:
    """The lenders of this node: one JSON file per lending agent, in a directory only the platform writes."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

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
        for path in sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime):
            try:
                entry = Lender(**json.loads(path.read_text()))
                os.kill(entry.pid, 0)
            except (OSError, ValueError, TypeError):
                continue  # left by an agent that died, or half gone
            if entry.endpoint != other_than:
                found.append(entry)
        return found


class LendingDesk:
    """The lender's side, polled by its agent: requests not yet seen, answers, devices given back."""

    def __init__(self, store: dist.Store, node: int) -> None:
        self.store, self.node, self.seen = store, node, 0

    def requests(self) -> list[tuple[int, str]]:
        """(request number, borrower) of each request not yet seen."""
        asked = self.store.add(f"lend/{self.node}/asked", 0)
        new = [(k, json.loads(self.store.get(f"lend/{self.node}/ask/{k}"))["borrower"])
               for k in range(self.seen + 1, asked + 1)]
        self.seen = asked
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

    def give_back(self) -> None:
        try:
            store = connect_store(self.lender.endpoint, timeout=10.0)
            store.set(f"lend/{self.lender.node}/back/{self.request}", "1")
        except (dist.DistError, OSError):
            pass  # the lender is gone: nothing waits for the device


def borrow(registry: Registry, own_endpoint: str, borrower: str, timeout_s: float) -> Loan:
    """A device from the first lender of this node that yields one within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    refusals = []
    for lender in registry.lenders(other_than=own_endpoint):
        try:
            store = connect_store(lender.endpoint, timeout=max(1.0, deadline - time.monotonic()))
            request = store.add(f"lend/{lender.node}/asked", 1)  # (the lender's get waits for the set)
            store.set(f"lend/{lender.node}/ask/{request}", json.dumps({"borrower": borrower}))
            key = f"lend/{lender.node}/answer/{request}"
            while not store.check([key]):
                if time.monotonic() > deadline:
                    raise BorrowFailed(f"the lender at {lender.endpoint} did not yield a slot within {timeout_s:g} s")
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
    borrower, the devices its coordinator asked for (borrowed on threads: a lender may take seconds) and the
    loans its borrowed workers hold. ``slots`` are the agent's ``_Slot``s (``lent``: the request a slot was
    lent for; ``loan``: the loan a borrowed slot runs on)."""

    def __init__(self, *, lend: bool, borrow: bool, registry: str, yield_timeout: float, endpoint: str,
                 client: dist.Store, node: int, events: Any) -> None:
        self.registry, self.endpoint, self.node, self.events = Registry(registry), endpoint, node, events
        self.yield_timeout, self.borrowing = yield_timeout, borrow
        self.desk = LendingDesk(client.clone(), node) if lend else None
        self.listed = self.registry.enter(endpoint, node) if lend else None
        self.asked = 0  # devices the coordinator asked this node to borrow, so far
        self.pending: dict[int, float] = {}  # borrowing threads still out, by number: their deadlines
        self.answers: queue.SimpleQueue[tuple[int, Loan | BorrowFailed]] = queue.SimpleQueue()

    def tend(self, slots: list[Any], job_store: dist.Store, yield_slot: Callable[[Any], None],
             start: Callable[[Any], None], start_borrowed: Callable[[Loan], None]) -> None:
        if self.desk is not None:
            for request, borrower in self.desk.requests():
                slot = next((s for s in reversed(slots) if s.proc is not None and s.lent is None and s.loan is None),
                            None)
                if slot is None:
                    self.desk.answer(request, None, "no slot of this node is running a worker")
                    continue
                slot.lent = request
                yield_slot(slot)
                self.desk.answer(request, device_of(slot.index))
                self.events.emit("slot_lent", slot=slot.index, device=device_of(slot.index), to=borrower)
            for slot in slots:
                if slot.lent is not None and self.desk.given_back(slot.lent):
                    slot.lent = None
                    self.events.emit("slot_returned", slot=slot.index)
                    start(slot)
        if self.borrowing:
            self._borrow_asked(job_store.add(f"borrow/{self.node}", 0), start_borrowed)

    def _borrow_asked(self, asked: int, start_borrowed: Callable[[Loan], None]) -> None:
        """Start a thread for each device newly asked for; start a worker on each device borrowed in time, and
        say which were not (a thread stuck on a frozen lender is left behind: its late loan goes back)."""
        for number in range(self.asked, asked):
            self.pending[number] = time.monotonic() + self.yield_timeout
            threading.Thread(target=self._borrow, args=(number,), name="torchpass-borrow", daemon=True).start()
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
        self.pending.clear()

    def _borrow(self, number: int) -> None:
        try:
            self.answers.put((number, borrow(self.registry, self.endpoint, self.endpoint, self.yield_timeout)))
        except BorrowFailed as exc:
            self.answers.put((number, exc))

    def close(self, slots: list[Any]) -> None:
        """The agent leaves: every device it borrowed goes back; it is no longer listed as a lender."""
        for slot in slots:
            if slot.loan is not None:
                slot.loan.give_back()
        if self.listed is not None:
            self.listed.unlink(missing_ok=True)
