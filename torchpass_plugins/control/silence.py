"""Who has fallen silent: a worker whose heartbeat counter stopped (its agent looks), and the agent of
another node whose beat counter stopped (the coordinating agent looks).

Silence is counted only while the store could be reached. When the observer's store calls take longer
than half the heartbeat timeout, the store was out (etcd without a quorum, say): nobody could beat
meanwhile, so every clock starts again from when it answered. A shorter outage cannot add up to a timeout
on its own. A store outage makes the job wait; it writes nobody off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from torchpass_plugins.control.policy import Action, Policy
from torchpass_plugins.control.protocol import DONE_KEY, NodeLost, agent_beat_key, node_lost_key, send
from torchpass_plugins.observe.events import EventLog


class BeatClocks:
    """Per watched counter: its last value and since when, and the last time the store came back."""

    def __init__(self, timeout: float) -> None:
        self.slow_s = timeout / 2
        self._seen: dict[str, tuple[int, float]] = {}
        self._back = float("-inf")

    @contextmanager
    def store_call(self) -> Iterator[None]:
        """Around the observer's store calls: a slow one restarts every clock."""
        began = time.monotonic()
        yield
        if time.monotonic() - began > self.slow_s:
            self._back = time.monotonic()

    def silent_for(self, name: str, beats: int) -> float:
        """Seconds since counter ``name`` last moved (0 now that it reads ``beats`` for the first time)."""
        now = time.monotonic()
        last = self._seen.get(name)
        if last is None or last[0] != beats:
            self._seen[name] = (beats, now)
            return 0.0
        return now - max(last[1], self._back)

    def forget(self, name: str) -> None:
        """Counter ``name`` starts over (a node written off: if it comes back, its silence counts from then)."""
        self._seen.pop(name, None)


def watch_nodes(store: dist.Store, nodes: list[int], policy: Policy, events: EventLog, interval: float,
                until) -> None:
    """While this agent coordinates (until ``until`` is set): a node whose agent stops counting up its beat
    for the heartbeat timeout is lost with all its workers (a machine that died takes its agent along, and
    only an agent reports its workers' exits): the coordinator replaces them as if each had exited."""
    clocks = BeatClocks(policy.heartbeat_timeout)
    while not until.wait(interval):
        with clocks.store_call():
            if store.check([DONE_KEY]):
                continue
            lost = {n for n in nodes if store.check([node_lost_key(n)])}
            beats = {n: int(store.add(agent_beat_key(n), 0)) for n in nodes if n not in lost}
        for node in lost:
            clocks.forget(f"node{node}")
        for node, count in beats.items():
            decision = policy.silence(clocks.silent_for(f"node{node}", count))
            if count > 0 and decision.action is Action.EVICT:
                why = f"the agent of node {node} was {decision.why}"
                events.emit("node_lost", node=node, why=why)
                store.set(node_lost_key(node), why)
                send(store, NodeLost(node, why))
