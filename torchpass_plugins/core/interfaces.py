"""The engine's contracts: the phases of a member, what it needs from a training framework
(:class:`Adapter`), and how a strategy recovers (:class:`RecoveryPlan`).

A strategy or loop integration implements these and calls the runtime's verbs (``join``, ``boundary``,
``collective``, ``reduce_gradients``, ``recover``, ``training_complete``); the runtime owns the protocol.
``docs/protocol.md`` describes the protocol these take part in.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Protocol

import torch

from torchpass_plugins.core.training_state import Stateful


class Phase(Enum):
    """Where a member stands in the job; every rank's mode is derived from this one value.

    A member of the first generation starts ``ACTIVE``. A spare promoted to a logical rank is a ``SPARE``
    until the recovery hands it the state, ``ENTERING`` until it passes its entry boundary (the
    survivors make no collective it could join meanwhile), and ``PROVING`` until it passes a later
    boundary: an error before then would recur on every spare, so the job stops instead of consuming them.
    """

    SPARE = "spare"
    ENTERING = "entering"
    PROVING = "proving"
    ACTIVE = "active"


class Adapter(Protocol):
    """What the protocol needs from the training framework."""

    def applied_steps(self) -> int:
        """Optimizer steps applied so far."""

    def boundary_snapshot(self) -> Any:
        """Cheap per-boundary record of what changes within a step (e.g. loop progress)."""

    def training_state(self) -> dict[str, Stateful]:
        """The training state as of the last step boundary, as named parts
        (:mod:`torchpass_plugins.core.training_state`); ``own``, where there is one, is what this rank holds
        that its peers do not (metric states, logged values)."""

    def load_state(self, values: dict[str, Any]) -> None:
        """Spare side: adopt the parts' values received from the donor (and the lost rank's ``own``, where
        it travels with them)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """The large tensors of the training state (weights, optimizer state) without building it: what a
        spare prepares a :class:`Landing` for (empty where no full state is handed over)."""


class RecoveryPlan(Protocol):
    """How one strategy recovers, run by :meth:`Runtime.recover` in each new generation until it succeeds."""

    def prepare(self) -> None:
        """Before the new generation's groups are built: end work still bound to the old ones."""

    def row(self) -> torch.Tensor:
        """This member's row of the agreement (one int64 tensor, the same shape on every member)."""

    def decide(self, rows: list[torch.Tensor]) -> Any:
        """The decision every member derives from the same rows (pure)."""

    def describe(self, decision: Any) -> dict[str, Any]:
        """The decision's fields for the ``transport_rebuilt`` event."""

    def exchange(self, decision: Any) -> None:
        """Move state between members as decided (``PeerFailure``: the loop starts over)."""

    def finish(self, decision: Any) -> tuple[Any, dict[str, Any]]:
        """Apply the decision locally, once the exchange succeeded: (what ``recover`` returns, the fields of
        the ``recovered`` event)."""
