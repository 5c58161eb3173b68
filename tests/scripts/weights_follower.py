"""A rollout replica as the tests run it: follow the weights a job publishes, and write one line per version
received, ``VERSION SHA256`` of its tensors, until the final version arrives or the publisher has been gone
for ``--patience`` seconds. ``--events``: its event log (versions received, connections lost). ``--tcp``:
receive the bytes even on the publisher's host (a test of a link between network namespaces)."""

from __future__ import annotations

import argparse
import hashlib

import torch

from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.weights import WeightSubscriber


def digest(state) -> str:
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("out")
    p.add_argument("--final", type=int, required=True)
    p.add_argument("--patience", type=float, default=20.0)
    p.add_argument("--events", default=None, help="the subscriber's event log")
    p.add_argument("--tcp", action="store_true", help="never map the publisher's copies")
    args = p.parse_args()
    subscriber = WeightSubscriber(args.endpoint, retry_s=0.05, events=EventLog(args.events, source="follower"),
                                  shared_memory=not args.tcp)
    version = -1
    print("following", flush=True)  # (a job started after this line is followed from its first version)
    with open(args.out, "a", buffering=1) as out:
        while version < args.final:
            try:
                version, state = subscriber.wait_newer(version, timeout=args.patience if version >= 0 else 120)
            except TimeoutError:
                return
            out.write(f"{version} {digest(state)}\n")


if __name__ == "__main__":
    main()
