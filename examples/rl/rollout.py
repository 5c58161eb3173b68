"""A rollout replica: plays the bandit with the newest policy the trainer publishes and writes the rounds
as training batches, until the trainer has every batch it needs; then keeps the trained weights.

Replica ``i`` of ``n`` writes the batches whose index is ``i`` modulo ``n``, one file each, complete or not
at all (written aside, then renamed). Batch ``k`` feeds the trainer's step ``k // ranks``, and is played
with a version no more than ``--max-lag`` steps older than that step. A replica that is restarted goes on
with the batches that are missing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from bandit import Policy, contexts, log_prob, rewards

from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.weights import WeightSubscriber


def play(policy: Policy, index: int, rounds: int) -> dict[str, torch.Tensor]:
    context = contexts(index, rounds)
    with torch.no_grad():
        probs = torch.softmax(policy(context), dim=1)
        arms = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(20_000 + index)).squeeze(1)
        return {"context": context, "arm": arms, "reward": rewards(context, arms),
                "log_prob": log_prob(policy, context, arms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("endpoint", help="where the trainer publishes, tcp://HOST:PORT")
    p.add_argument("rollouts", type=Path, help="the directory the trainer reads its batches from")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="the trainer's active ranks")
    p.add_argument("--steps", type=int, required=True, help="the trainer's max_steps")
    p.add_argument("--rounds", type=int, default=256, help="rounds per batch")
    p.add_argument("--max-lag", type=int, default=2, help="the oldest version a batch may be played with, in steps "
                   "(at least 2: Lightning reads the batch of step s + 1 before the weights of step s exist)")
    p.add_argument("--events", type=Path, default=None, help="append weights_received events to this log")
    args = p.parse_args()
    if args.max_lag < 2:
        p.error("--max-lag must be at least 2")
    name = f"replica{args.replica}"
    events = EventLog(args.events, source=f"{name}-{os.getpid()}")  # a restarted replica is a new subscriber
    subscriber = WeightSubscriber(args.endpoint, name=name, events=events)
    policy = Policy().eval()
    args.rollouts.mkdir(parents=True, exist_ok=True)
    for index in range(args.replica, args.steps * args.ranks, args.replicas):
        path = args.rollouts / f"batch{index:05d}.pt"
        if path.exists():
            continue  # written before this replica was restarted
        step = index // args.ranks
        while subscriber.version is None or subscriber.version < step - args.max_lag:
            subscriber.load_into(policy, timeout=300, prefix="policy.")  # the newest the trainer has
        batch = play(policy, index, args.rounds)
        batch["version"] = torch.tensor(subscriber.version)
        aside = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(batch, aside)
        os.replace(aside, path)
    while subscriber.version is None or subscriber.version < args.steps:  # the trained weights (the last version)
        subscriber.load_into(policy, timeout=300, prefix="policy.")
    torch.save(policy.state_dict(), args.rollouts.parent / f"{name}_final.pt")


if __name__ == "__main__":
    main()
