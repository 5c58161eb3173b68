"""Optional Prometheus endpoint (``torchpass launch --metrics-addr HOST:PORT``, needs ``prometheus-client``).

Node 0's agent serves metrics folded from the event log at scrape time: the workers write nothing more
and open no port. ``torchpass_events_total{event}`` counts every event (failures, recoveries,
migrations, snapshots...), ``torchpass_step{rank}`` is each rank's last reported step,
``torchpass_spares`` the size of the spare pool, and for a job that publishes weights
``torchpass_weights_version`` the newest version published and ``torchpass_weights_lag{subscriber}`` how
many versions each subscriber's newest is behind it.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class EventMetrics:
    """A Prometheus collector over ``events.jsonl``, read incrementally (each line once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: Counter[str] = Counter()
        self.steps: dict[int, int] = {}
        self.spares: int | None = None
        self.weights_version: int | None = None
        self.subscribers: dict[str, int] = {}  # the newest version sent to each subscriber
        self._offset = 0
        self._lock = threading.Lock()

    def _fold(self, e: dict[str, Any]) -> None:
        self.counts[e["event"]] += 1
        if e["event"] == "progress":
            self.steps[e["rank"]] = e["step"]
        if "spares" in e and isinstance(e["spares"], int):
            self.spares = e["spares"]
        if e["event"] == "weights_published":
            self.weights_version = max(e["version"], self.weights_version or 0)
        elif e["event"] == "weights_sent":
            self.subscribers[e["subscriber"]] = max(e["version"], self.subscribers.get(e["subscriber"], -1))

    def update(self) -> None:
        with self._lock:
            if not self.path.exists():
                return
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
            self._offset += len(complete)
            for line in complete.splitlines():
                if line.strip():
                    self._fold(json.loads(line))

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.update()
        events = CounterMetricFamily("torchpass_events", "Events in the run's event log", labels=["event"])
        for name, count in sorted(self.counts.items()):
            events.add_metric([name], count)
        yield events
        step = GaugeMetricFamily("torchpass_step", "Last step boundary each logical rank reported", labels=["rank"])
        for rank, value in sorted(self.steps.items()):
            step.add_metric([str(rank)], value)
        yield step
        if self.spares is not None:
            yield GaugeMetricFamily("torchpass_spares", "Workers waiting in the spare pool", value=self.spares)
        if self.weights_version is not None:
            yield GaugeMetricFamily("torchpass_weights_version", "Newest weights version published",
                                    value=self.weights_version)
            lag = GaugeMetricFamily("torchpass_weights_lag", "Versions each subscriber's newest is behind the "
                                    "newest published", labels=["subscriber"])
            for name, version in sorted(self.subscribers.items()):
                lag.add_metric([name], self.weights_version - version)
            yield lag


def serve(address: str, run_dir: str | Path):
    """Start the endpoint on ``HOST:PORT``; returns the server (``shutdown()`` stops it)."""
    from prometheus_client import CollectorRegistry, start_http_server

    host, port = address.rsplit(":", 1)
    registry = CollectorRegistry()
    registry.register(EventMetrics(Path(run_dir) / "events.jsonl"))
    server, _thread = start_http_server(int(port), addr=host, registry=registry)
    return server
