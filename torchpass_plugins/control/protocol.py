"""The control plane's protocol: the store's key schema, the coordinator's inbox messages, and exit codes.

Workers and agents tell the coordinator what they observed by pushing one message onto the inbox queue
(:func:`send`); the coordinator answers through keys (rosters, assignments, the job's outcome). Each
message is a frozen dataclass encoded as JSON with a ``kind`` field, so a sender and the coordinator
cannot disagree on a name, and a message of an unknown kind fails loud. Every key lives under one prefix
per attempt (``membership.prefixed``) so that a job's keys never mix with other users of the same store.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


class ExitCode(IntEnum):
    """Exit statuses with a meaning for the job (what each one leads to is ``Policy``'s decision)."""

    OK = 0
    KILLED = -9  # SIGKILLed (Popen's returncode); also what a worker written off by the coordinator counts as
    REJECTED = 77  # EX_NOPERM: the coordinator refused the worker's join token
    CONFIG_ERROR = 78  # EX_CONFIG: a mistake every worker would repeat; the message may be in abort_request_key
    UNRECOVERABLE = 79  # no spare can restore the lost state; the message is in abort_request_key


# -- keys ---------------------------------------------------------------------------------------------
PREFIX = "torchpass"
INBOX = "inbox"  # the coordinator's one input queue: encoded messages, see ``send``
ABORT_KEY = "abort"
RESTART_KEY = "restart"  # set instead of ABORT_KEY when the agents are to restart every worker
DONE_KEY = "done"  # the job's outcome, set by the coordinator when it ends ("done" on success)
# The newest planned migration, ``{"id", "rank", "worker", "why"}``, set by the coordinator. Workers act on
# it only while ``worker`` still holds ``rank`` in their roster, so a notice already carried out is inert.
DRAIN_KEY = "drain"
# Set by a rank that passed the barrier ending ``fit``: from then on every rank has finished training, so a
# worker lost afterwards (in the script's code after ``fit``, or at exit) is not replaced.
TRAINED_KEY = "trained"
# The shapes and dtypes of the state's large tensors (``Landing.describe``), set once by rank 0 after the first
# optimizer step: a waiting spare allocates and touches them while it idles, and receives into them.
LANDING_KEY = "landing"
LEAVING = 1 << 40  # added to a heartbeat counter by a worker on its way out: no hang check from then on


def slot_order(worker_id: str) -> tuple[int, int, int]:
    """Workers are named ``n{node}-s{slot}-i{incarnation}``; initial ranks follow (node, slot)."""
    node, slot, inc = (int(part[1:]) for part in worker_id.split("-"))
    return node, slot, inc


def join_key(worker_id: str) -> str:
    """The join token a worker presents, set before its ``Join``."""
    return f"join/{worker_id}"


def roster_key(gen: int) -> str:
    return f"roster/{gen}"


def roster_change_key(gen: int) -> str:
    """``RosterChange`` of generation ``gen``. Every worker reads it after a failure; were that the whole
    roster, the store would send bytes in the square of the world size."""
    return f"roster_change/{gen}"


def assign_key(worker_id: str) -> str:
    """The coordinator's answer to a join: ``{"gen", "rank"}``, ``{"exit": why}`` or ``{"reject": why}``."""
    return f"assign/{worker_id}"


def abort_request_key(worker_id: str) -> str:
    """The message of a worker that exits with ``CONFIG_ERROR`` or ``UNRECOVERABLE``."""
    return f"abort_request/{worker_id}"


def logger_version_key(index: int) -> str:
    """The version (run directory) of the Trainer's ``index``-th logger, as the job's rank 0 chose it."""
    return f"logger_version/{index}"


def heartbeat_key(worker_id: str) -> str:
    return f"hb/{worker_id}"


def watch_key(worker_id: str, gen: int) -> str:
    """Set by the coordinator for every worker concerned when roster ``gen`` is published."""
    return f"watch/{worker_id}/{gen}"


def evict_key(worker_id: str) -> str:
    """Set by the coordinator for a worker it replaced while the process lives on (it stalled the others'
    collectives): its agent SIGKILLs it."""
    return f"evict/{worker_id}"


def agent_beat_key(node: int) -> str:
    """Counted up by the agent of ``node`` at every supervision check: node 0's agent watches it."""
    return f"agent_hb/{node}"


def node_lost_key(node: int) -> str:
    """Set when the coordinator has written ``node`` off: its agent, if it is still alive, stops its workers.
    An agent started again for that node (a replacement) deletes it, and the node is watched again."""
    return f"node_lost/{node}"


def node_agent_key(node: int) -> str:
    """The identity of the agent now serving ``node``: one that finds another's here was replaced, and stops."""
    return f"node_agent/{node}"


def node_paths_key(node: int) -> str:
    """How many network paths the agent serving ``node`` has (its ``--interfaces``; 1 without): the
    coordinator compares them before the job starts and when a node's spare joins."""
    return f"node_paths/{node}"


def incarnations_key(node: int, slot: int) -> str:
    """Counts the workers started in a slot over the whole job (every attempt, every agent of the node), so
    that a worker's name is never used twice."""
    return f"incarnations/n{node}-s{slot}"


def links_key(node: int) -> str:
    """Where ``node``'s agent answers link probes: ``[[address, port], ...]``, one per path (``control/links.py``)."""
    return f"links/{node}"


def reached_key(rank: int) -> str:
    """Optimizer steps a logical rank had applied when its attempt was aborted."""
    return f"reached/{rank}"


def borrow_key(node: int) -> str:
    """A counter: the devices the coordinator asked node ``node``'s agent to borrow from a lending job."""
    return f"borrow/{node}"


def borrowed_key(worker_id: str) -> str:
    """Set for a worker its agent started on a device borrowed from a lending job."""
    return f"borrowed/{worker_id}"


def spare_error_key(rank: int) -> str:
    """The error of the last spare promoted to ``rank`` that failed before completing a step."""
    return f"spare_error/{rank}"


@dataclass(frozen=True)
class Roster:
    """Generation ``gen`` of the job: logical rank ``r`` is run by worker ``ranks[r]``, and its groups are built
    on ``path`` (the index of the interface in every node's ``--interfaces``)."""

    gen: int
    ranks: tuple[str, ...]
    abort: str | None = None
    reason: str = ""
    path: int = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "ranks": list(self.ranks), "abort": self.abort, "reason": self.reason,
                           "path": self.path})

    @classmethod
    def from_json(cls, text: str | bytes) -> Roster:
        d = json.loads(text)
        return cls(gen=d["gen"], ranks=tuple(d["ranks"]), abort=d.get("abort"), reason=d.get("reason", ""),
                   path=d.get("path", 0))

    def change_from(self, before: Roster | None) -> RosterChange:
        """This roster as a change of ``before``, the generation before it (None: every rank is new)."""
        was = before.ranks if before is not None else (None,) * self.world_size
        changed = {rank: w for rank, (w, old) in enumerate(zip(self.ranks, was, strict=True)) if w != old}
        return RosterChange(self.gen, changed, self.abort, self.reason, self.path)

    def changed_by(self, change: RosterChange) -> Roster:
        """The next roster, from its ``change`` of this one."""
        if change.gen != self.gen + 1:
            raise ValueError(f"roster change {change.gen} does not follow roster {self.gen}")
        ranks = list(self.ranks)
        for rank, worker in change.changed.items():
            ranks[rank] = worker
        return Roster(change.gen, tuple(ranks), change.abort, change.reason, change.path)


@dataclass(frozen=True)
class RosterChange:
    """What generation ``gen`` changed: the ranks a new worker runs, and whether the job stops there. What a
    worker needs after a failure, in a few bytes where the roster has a world's worth of names."""

    gen: int
    changed: dict[int, str]
    abort: str | None = None
    reason: str = ""
    path: int = 0

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "changed": self.changed, "abort": self.abort, "reason": self.reason,
                           "path": self.path})

    @classmethod
    def from_json(cls, text: str | bytes) -> RosterChange:
        d = json.loads(text)
        return cls(d["gen"], {int(rank): w for rank, w in d["changed"].items()}, d["abort"], d["reason"],
                   d.get("path", 0))


# -- inbox messages -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Join:
    """A worker registered (its token is at ``join_key``): it becomes a rank or a spare."""

    worker: str


@dataclass(frozen=True)
class Exit:
    """An agent saw its worker exit with ``code`` (reported at once, faster than any heartbeat)."""

    worker: str
    code: int
    why: str = ""


@dataclass(frozen=True)
class Migrate:
    """A health watch asks to move the worker off its device."""

    worker: str
    why: str


@dataclass(frozen=True)
class Straggler:
    """The ranks judged the worker a straggler (its compute time per step is far above the median)."""

    worker: str
    why: str


@dataclass(frozen=True)
class LeftForMigration:
    """The worker of a planned migration left at the agreed step boundary."""

    worker: str


@dataclass(frozen=True)
class Stalled:
    """A collective of the worker timed out while generation ``gen`` was current; the others' would within
    ``grace_s``."""

    worker: str
    gen: int
    grace_s: float
    why: str = ""


@dataclass(frozen=True)
class StallVerdict:
    """Sent by the coordinator to itself ``grace_s`` after the first ``Stalled`` of generation ``gen``."""

    gen: int


@dataclass(frozen=True)
class SpareDeadline:
    """Sent by the coordinator to itself when the wait for refilled spares for generation ``gen`` ends."""

    gen: int


@dataclass(frozen=True)
class NodeLost:
    """Node 0's agent found the agent of ``node`` silent too long: each of its workers counts as lost."""

    node: int
    why: str


@dataclass(frozen=True)
class LinkDown:
    """The agent of ``node`` has not reached ``peer``'s over ``path`` for ``seconds``, while another path to it
    answers: a link failed, not a process."""

    node: int
    peer: int
    path: int
    seconds: float


@dataclass(frozen=True)
class Stop:
    """The hosting agent ends the coordinator's loop."""


Message = (Join | Exit | Migrate | Straggler | LeftForMigration | Stalled | StallVerdict | SpareDeadline | NodeLost
           | LinkDown | Stop)
_KINDS: dict[str, type[Message]] = {
    "join": Join, "exit": Exit, "migrate": Migrate, "straggler": Straggler, "left_for_migration": LeftForMigration,
    "stalled": Stalled, "stall_verdict": StallVerdict, "spare_deadline": SpareDeadline, "node_lost": NodeLost,
    "stop": Stop, "link_down": LinkDown,
}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


class ProtocolError(ValueError):
    """An inbox message this code does not understand (a sender of another version, or a bug)."""


def encode(message: Message) -> str:
    return json.dumps({"kind": _KIND_OF[type(message)], **asdict(message)})


def decode(raw: str | bytes) -> Message:
    data = json.loads(raw)
    kind = data.pop("kind", None)
    cls = _KINDS.get(kind)
    if cls is None:
        raise ProtocolError(f"torchpass: unknown control message kind {kind!r} in {raw!r}; known: {sorted(_KINDS)}. "
                            "Every process of a job must run the same torchpass-plugins version")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING}
    if not required <= set(data) <= names:
        raise ProtocolError(f"torchpass: control message {kind!r} has fields {sorted(data)}, expected "
                            f"{sorted(names)} (required: {sorted(required)})")
    return cls(**data)


def send(store: dist.Store, message: Message) -> None:
    """Push ``message`` onto the coordinator's inbox."""
    store.queue_push(INBOX, encode(message))
