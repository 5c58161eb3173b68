"""Fault injection for tests and drills, driven by ``TORCHPASS_FAULTS``.

``TORCHPASS_FAULTS="kill@rank=1,step=5,phase=reduce;stop@rank=2,step=9"`` makes the worker holding
logical rank 1 SIGKILL itself at step 5 while the gradient all-reduce is in flight, and so on. Each
fault fires once per run (a marker file in the run directory), so the spare that replays the step does
not fail again. Actions: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: a hang), ``exit`` (``os._exit(3)``),
``raise`` (an exception in the training process), ``slow`` (from then on, this process sleeps ``seconds``
at every step boundary: a straggler; the spare that replaces it is not slow), ``stall`` (the training
thread stops for good while the process stays alive and keeps its heartbeat: the others wait in their
next collective, which times out). Phases: ``boundary``
(start of the step), ``data`` (before a micro-batch is fetched), ``forward`` (before the training step's
forward; Lightning strategies), ``backward`` (before a micro-batch's backward), ``reduce`` (gradient
all-reduce issued, not yet complete), ``commit`` (reduced, not yet committed), ``optimizer`` (the
optimizer has applied the committed update; Lightning's step bookkeeping has not run yet).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ACTIONS = ("kill", "stop", "exit", "raise", "slow", "stall")
PHASES = ("boundary", "data", "forward", "backward", "reduce", "commit", "optimizer")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    phase: str = "boundary"
    seconds: float = 0.0  # ``slow``: the sleep per step

    @classmethod
    def parse(cls, text: str) -> Fault:
        action, _, rest = text.strip().partition("@")
        fields = dict(part.split("=", 1) for part in rest.split(",") if part)
        fault = cls(action, int(fields["rank"]), int(fields["step"]), fields.get("phase", "boundary"),
                    float(fields.get("seconds", 0)))
        if fault.action not in ACTIONS or fault.phase not in PHASES:
            raise ValueError(f"bad fault {text!r}: actions {ACTIONS}, phases {PHASES}")
        return fault


def _load() -> list[Fault]:
    spec = os.environ.get("TORCHPASS_FAULTS", "")
    return [Fault.parse(item) for item in spec.split(";") if item.strip()]


_FAULTS = _load()
_where = (-1, -1)
_slow = 0.0  # seconds this process sleeps per step boundary, once a ``slow`` fault fired in it


def at(rank: int, step: int) -> None:
    """Record where this process is (called at each step boundary)."""
    global _where
    _where = (rank, step)


def point(phase: str) -> None:
    """An injection point; free when no fault is configured."""
    if not _FAULTS:
        return
    for index, fault in enumerate(_FAULTS):
        if (fault.rank, fault.step, fault.phase) == (*_where, phase) and _claim(index):
            _fire(fault)
    if _slow and phase == "boundary":
        time.sleep(_slow)


def _claim(index: int) -> bool:
    marker = Path(os.environ.get("TORCHPASS_RUN_DIR", ".")) / "faults" / f"fired-{index}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _fire(fault: Fault) -> None:
    global _slow
    if fault.action == "slow":
        _slow = fault.seconds
        return
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "exit":
        os._exit(3)
    elif fault.action == "stall":
        while True:
            time.sleep(60)
    raise RuntimeError(f"torchpass fault injected: {fault}")
