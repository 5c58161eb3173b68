"""Chaos scenarios: which faults strike where, drawn from a seed so that any one of them can be replayed.

A scenario is the demo job (3 active ranks, 1 spare, snapshots every 3 steps) on one strategy with one
or two faults from :mod:`torchpass_plugins.testing.faults`. Scenario ``i`` of seed ``s`` depends on nothing but
``(s, i)``: ``torchpass chaos --seed s --only i`` replays it alone.

Link scenarios (``torchpass chaos --links``) are a family of their own, as they need root: the job runs on
test hosts (network namespaces, ``testing/netns.py``), each rank on a host with two paths, and one link
fault strikes the path the job uses, at the rank's host, in a phase of a step. Scenario ``i`` of that family
is link fault ``i // 7 % 3`` in step phase ``i % 7``: any 21 consecutive ones cover every pair.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from torchpass_plugins.testing.faults import LINK_ACTIONS, RECOVERY_PHASES, STEP_PHASES, Fault

STRATEGIES = ("torchpass_ddp", "torchpass_fsdp")
WORLD = 3
STEPS = 10
SNAPSHOT_EVERY = 3
# Kills dominate real failures (a lost process, a lost node); every other action is drawn as often as one kind
# of kill. ``kill-agent`` ends the job (on one node, the agent hosts the coordinator): it is drawn least.
_ACTIONS = {"kill": 3, "exit": 1, "raise": 1, "stop": 1, "spin": 1, "stall": 1, "slow": 1, "kill-agent": 0.5}
# A scenario's kind: a fault in a training step, in a background thread, in a recovery (a second fault
# striking while the first is being repaired), or two ranks killed at once (more failures than spares).
_KINDS = {"step": 6, "background": 2, "recovery": 3, "double": 1}
SINGLE_FAULT = ("step", "background")  # the kinds with one fault
SLOW_S = 0.3


@dataclass(frozen=True)
class Scenario:
    seed: int
    index: int
    kind: str
    strategy: str
    replicate_every: int
    faults: tuple[Fault, ...]

    @property
    def spec(self) -> str:
        """The ``TORCHPASS_FAULTS`` value."""
        return ";".join(str(f) for f in self.faults)

    @property
    def target(self) -> Fault:
        """The fault the scenario is about (in a recovery scenario, the one striking the recovery)."""
        return self.faults[-1]

    @property
    def name(self) -> str:
        """Its run directory's name."""
        return f"s{self.seed}-{self.index:04d}" + ("-link" if self.on_hosts else "")

    @property
    def on_hosts(self) -> bool:
        """Whether the job runs on test hosts, a rank per host (a link scenario)."""
        return self.kind == "link"

    @property
    def reference(self) -> str:
        """Which failure-free run the result must equal, bit for bit."""
        return f"{self.strategy}-r{self.replicate_every}" + ("-hosts" if self.on_hosts else "")

    def __str__(self) -> str:
        return f"#{self.index} {self.strategy} (replicate every {self.replicate_every}): {self.spec}"


def _weighted(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _fault(rng: random.Random, action: str, rank: int | None, step: int | None, phase: str) -> Fault:
    return Fault(action, rank, step, phase, SLOW_S if action == "slow" else 0.0)


def draw(seed: int, index: int) -> Scenario:
    rng = random.Random(f"torchpass-chaos:{seed}:{index}")
    strategy = rng.choice(STRATEGIES)
    replicate_every = rng.choice((1, 2)) if strategy == "torchpass_fsdp" else 1
    kind = _weighted(rng, _KINDS)
    rank, step = rng.randrange(WORLD), rng.randint(1, STEPS - 2)
    if kind == "step":
        faults = (_fault(rng, _weighted(rng, _ACTIONS), rank, step, rng.choice(STEP_PHASES)),)
    elif kind == "background":
        # The threads run at boundaries the job chooses (replication rounds, snapshot steps): a fault strikes
        # the first one at or after its step on its rank, so the step leaves room for one more snapshot.
        phase = rng.choice(("replicate", "snapshot") if strategy == "torchpass_fsdp" else ("snapshot",))
        faults = (_fault(rng, _weighted(rng, _ACTIONS), rank, min(step, STEPS - SNAPSHOT_EVERY), phase),)
    elif kind == "recovery":
        first = _fault(rng, "kill", rank, step, rng.choice(STEP_PHASES))
        faults = (first, _fault(rng, _weighted(rng, _ACTIONS), None, None, rng.choice(RECOVERY_PHASES)))
    else:
        other = rng.choice([r for r in range(WORLD) if r != rank])
        phase = rng.choice(STEP_PHASES)
        faults = (_fault(rng, "kill", rank, step, phase), _fault(rng, "kill", other, step, phase))
    return Scenario(seed, index, kind, strategy, replicate_every, faults)


def draw_link(seed: int, index: int) -> Scenario:
    """Link scenario ``index`` of ``seed``: its fault and phase from the index, the rest drawn."""
    rng = random.Random(f"torchpass-chaos-links:{seed}:{index}")
    strategy = rng.choice(STRATEGIES)
    replicate_every = rng.choice((1, 2)) if strategy == "torchpass_fsdp" else 1
    action, phase = LINK_ACTIONS[index // len(STEP_PHASES) % len(LINK_ACTIONS)], STEP_PHASES[index % len(STEP_PHASES)]
    fault = _fault(rng, action, rng.randrange(WORLD), rng.randint(1, STEPS - 2), phase)
    return Scenario(seed, index, "link", strategy, replicate_every, (fault,))
