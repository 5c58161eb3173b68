"""Fault injection for tests, drills and the chaos matrix, driven by ``TORCHPASS_FAULTS``.

``TORCHPASS_FAULTS="kill@rank=1,step=5,phase=reduce;stop@rank=2,step=9"`` makes the worker holding
logical rank 1 SIGKILL itself at step 5 while the gradient all-reduce is in flight, and so on. Each
fault fires once per run (a marker file in the run directory), so the spare that replays the step does
not fail again. Leaving out ``rank`` or ``step`` matches any. ``micro=K`` strikes at the K-th time (from 0)
the step reaches the phase: ``phase=data,micro=2`` is between a step's second and third micro-batch.

Actions: ``kill`` (SIGKILL), ``exit`` (``os._exit(3)``), ``raise`` (an exception in the thread that reaches
the point), ``stop`` (SIGSTOP: a hang), ``spin`` (a busy loop that never releases the GIL: every thread of
the process stops, heartbeats included), ``stall`` (the thread stops for good while the process stays
alive and keeps its heartbeat: the others wait in their next collective, which times out), ``slow`` (from
then on, this process sleeps ``seconds`` at every step boundary: a straggler; the spare that replaces it is
not slow), ``kill-agent`` (SIGKILL this worker's agent; on node 0 the agent hosts the store and the
coordinator). Link faults, for jobs on test hosts (``testing/netns.py``) that name this worker's switch
port in ``TORCHPASS_FAULT_LINK`` (``NAMESPACE/PORT``, the port of the path the job prefers): ``link-down``
(the cable pulled for good), ``link-flap`` (pulled for ``seconds``, 3 by default, then plugged back),
``link-slow`` (the port shaped to 256 kbit/s: a degraded link); the worker goes on.

Phases of a training step: ``boundary`` (start of the step), ``data`` (before a micro-batch is fetched),
``forward`` (before the training step's forward; Lightning strategies), ``backward`` (before a micro-batch's
backward), ``reduce`` (gradient all-reduce issued, not yet complete), ``commit`` (reduced, not yet
committed), ``optimizer`` (the optimizer has applied the committed update; Lightning's step bookkeeping has
not run yet). Background work: ``replicate`` (``torchpass_fsdp``'s ring replication thread, its shard packed,
before the exchange), ``snapshot`` (the snapshot thread, before this rank's file is written), ``publish`` (a
weights publisher's thread, half-way through sending a version to a subscriber); these threads
run at boundaries the job chooses, so for them ``step`` means the first one at or after it. A recovery:
``survivor`` (a survivor joined the new group, before the agreement), ``donor`` (before sending state to a
spare), ``promoted`` (a promoted spare, before receiving its state); for these, ``step`` is the boundary the
rank last passed (-1 for a spare), so they are usually given without one. The user's own collectives:
``collective`` (before an operation of the default ``torch.distributed`` group, which the user's code and
libraries call: an evaluation's ``gather_for_metrics``, torchmetrics' synchronization), ``step`` being the
boundary last passed; with ``micro=K``, the K-th such operation after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.errors import ConfigError

LINK_ACTIONS = ("link-down", "link-flap", "link-slow")
ACTIONS = ("kill", "exit", "raise", "stop", "spin", "stall", "slow", "kill-agent", *LINK_ACTIONS)
LINK_VARIABLE = "TORCHPASS_FAULT_LINK"
FLAP_S = 3.0
STEP_PHASES = ("boundary", "data", "forward", "backward", "reduce", "commit", "optimizer")
BACKGROUND_PHASES = ("replicate", "snapshot", "publish")
RECOVERY_PHASES = ("survivor", "donor", "promoted")
USER_PHASES = ("collective",)
PHASES = STEP_PHASES + BACKGROUND_PHASES + RECOVERY_PHASES + USER_PHASES


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int | None = None  # None: any rank
    step: int | None = None  # None: any step
    phase: str = "boundary"
    seconds: float = 0.0  # ``slow``: the sleep per step
    micro: int | None = None  # the how-manieth time within the step the phase is reached (None: any)

    @classmethod
    def parse(cls, text: str) -> Fault:
        action, _, rest = text.strip().partition("@")
        try:
            fields = dict(part.split("=", 1) for part in rest.split(",") if part)
            rank, step = (int(fields[k]) if k in fields else None for k in ("rank", "step"))
            micro = int(fields["micro"]) if "micro" in fields else None
            fault = cls(action, rank, step, fields.get("phase", "boundary"), float(fields.get("seconds", 0)), micro)
        except ValueError as exc:
            raise ValueError(f"bad fault {text!r}: {exc}; write ACTION@rank=R,step=S,phase=P") from None
        if fault.action not in ACTIONS or fault.phase not in PHASES:
            raise ValueError(f"bad fault {text!r}: actions {ACTIONS}, phases {PHASES}")
        return fault

    def __str__(self) -> str:
        fields = [f"{k}={v}" for k, v in (("rank", self.rank), ("step", self.step)) if v is not None]
        fields.append(f"phase={self.phase}")
        if self.seconds:
            fields.append(f"seconds={self.seconds:g}")
        if self.micro is not None:
            fields.append(f"micro={self.micro}")
        return f"{self.action}@{','.join(fields)}"

    def matches(self, rank: int, step: int, phase: str, reached: int = 0) -> bool:
        """``reached``: how often this step reached ``phase`` before."""
        if phase != self.phase or self.rank not in (None, rank) or self.micro not in (None, reached):
            return False
        return self.step is None or step == self.step or (phase in BACKGROUND_PHASES and step > self.step)


def parse_all(spec: str) -> list[Fault]:
    return [Fault.parse(item) for item in spec.split(";") if item.strip()]


_faults: tuple[Fault, ...] | None = None  # this process's TORCHPASS_FAULTS, once :func:`load` parsed it
_where = (-1, -1)
_reached: dict[str, int] = {}  # how often each phase was reached in the current step
_slow = 0.0  # seconds this process sleeps per step boundary, once a ``slow`` fault fired in it


def at(rank: int, step: int) -> None:
    """Record where this process is (called at each step boundary, and when a spare gets its rank)."""
    global _where
    if (rank, step) != _where:
        _reached.clear()
    _where = (rank, step)


def load() -> tuple[Fault, ...]:
    """This process's faults: ``TORCHPASS_FAULTS``, parsed on first use rather than on import (importing has
    no effect that depends on the environment). The worker's entry calls it before the script runs, so a
    malformed value stops the job before training, with a ``ConfigError`` naming the variable."""
    global _faults
    if _faults is None:
        try:
            _faults = tuple(parse_all(os.environ.get("TORCHPASS_FAULTS", "")))
        except ValueError as exc:
            raise ConfigError(f"torchpass: TORCHPASS_FAULTS: {exc}") from None
    return _faults


def point(phase: str) -> None:
    """An injection point; free when no fault is configured."""
    configured = load()
    if not configured:
        return
    reached = _reached.get(phase, 0)
    _reached[phase] = reached + 1
    for index, fault in enumerate(configured):
        if fault.matches(*_where, phase, reached) and _claim(index):
            _fire(fault)
    if _slow and phase == "boundary":
        time.sleep(_slow)


def _claim(index: int) -> bool:
    env = WorkerEnv.from_env()
    marker = Path(env.run_dir if env is not None else ".") / "faults" / f"fired-{index}"
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
    if fault.action in LINK_ACTIONS:
        _strike_link(fault)
        return
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "exit":
        os._exit(3)
    elif fault.action == "kill-agent":
        os.kill(WorkerEnv.from_env().agent_pid, signal.SIGKILL)
        return
    elif fault.action == "spin":
        sum(range(1 << 62))  # one C call: the GIL is never released
    elif fault.action == "stall":
        while True:
            time.sleep(60)
    raise RuntimeError(f"torchpass fault injected: {fault}")


def _strike_link(fault: Fault) -> None:
    """Pull, flap or shape this worker's preferred link at its switch port (``LINK_VARIABLE``)."""
    where = os.environ.get(LINK_VARIABLE)
    if not where:
        raise ConfigError(f"torchpass: fault {fault} needs {LINK_VARIABLE}=NAMESPACE/PORT (jobs on test hosts set it)")
    switch, port = where.split("/")
    if fault.action == "link-slow":
        subprocess.run(["ip", "netns", "exec", switch, "tc", "qdisc", "replace", "dev", port, "root", "tbf", "rate",
                        "256kbit", "burst", "2kb", "latency", "2s"], check=True)
        return
    subprocess.run(["ip", "-n", switch, "link", "set", port, "down"], check=True)
    if fault.action == "link-flap":
        plug = ["ip", "-n", switch, "link", "set", port, "up"]
        threading.Timer(fault.seconds or FLAP_S, subprocess.run, (plug,)).start()  # (non-daemon: it always runs)
