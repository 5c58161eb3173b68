"""What an agent does with its slots' devices: the health watch's findings (a warning, or the worker moved off
a failing device to a spare) and loans between jobs (a slot yielded to a borrowing job; a slot on a device
borrowed from a lending one, see ``lending``). A mixin of :class:`Agent`, whose state it uses."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from torchpass_plugins.control.lending import Loan, Request
from torchpass_plugins.control.membership import prefixed
from torchpass_plugins.control.policy import Action
from torchpass_plugins.control.protocol import Migrate, send
from torchpass_plugins.health.watch import Finding


@dataclass
class Slot:
    """One of the node's worker slots (slot i uses GPU i), or one on a device borrowed from a lending job."""

    index: int
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    worker_id: str = ""
    lent_for: Request | None = None  # the request its device was yielded to (its worker waits for it back)
    loan: Loan | None = None  # a slot on a device borrowed from a lending job
    failed_starts: int = 0  # its workers in a row that failed before joining the job


class SlotDevices:
    """See the module docstring."""

    # -- device health --------------------------------------------------------------------------------
    def _watched_devices(self) -> list[int]:
        """Slot i uses GPU i (its workers' local rank): the devices of running workers not yet moved off."""
        return [s.index for s in self.slots if s.proc is not None and s.index not in self.unhealthy and s.loan is None]

    def _on_device(self, device: int, findings: list[Finding]) -> None:
        """Log a warning, or ask the coordinator to move the slot's worker to a spare, as the policy decides."""
        slot = next((s for s in self.slots if s.index == device), None)
        if slot is None:
            return  # (a borrowed slot, gone meanwhile)
        for decision in self.policy.device_findings(findings):
            if decision.action is Action.MIGRATE:
                self._move_off(slot, decision.why)
            else:
                self.events.emit("health_warning", worker=slot.worker_id, device=slot.index, why=decision.why)

    def _move_off(self, slot: Slot, why: str) -> None:
        self.unhealthy.add(slot.index)
        self.events.emit("health_migrate", worker=slot.worker_id, device=slot.index, why=why)
        print(f"torchpass: moving worker {slot.worker_id} off its device: {why}", file=sys.stderr, flush=True)
        store = prefixed(self._client.clone(), self.attempt)  # this thread's own connection
        send(store, Migrate(slot.worker_id, why))

    # -- loans of devices between jobs -----------------------------------------------------------------
    def _yield(self, slot: Slot) -> None:
        """A borrowing job takes this slot's device: its worker goes now (its job sees it lost)."""
        slot.proc.kill()
        slot.proc.wait()

    def _start_borrowed(self, loan: Loan) -> None:
        slot = Slot(max(s.index for s in self.slots) + 1, loan=loan)  # (an index of no device of this job)
        self.slots.append(slot)
        self._spawn(slot)

    def _give_back_loans(self) -> None:
        """The job restarts, on its own slots: every borrowed device goes back."""
        if self.loans is not None:
            self.loans.new_attempt()
            for slot in [s for s in self.slots if s.loan is not None]:
                self._drop_borrowed(slot)

    def _drop_borrowed(self, slot: Slot) -> None:
        """The worker on a borrowed device is gone: the device goes back, the slot is no more."""
        self.slots.remove(slot)
        self.loans.give_back(slot.loan)
