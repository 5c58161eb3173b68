"""The optional Prometheus endpoint: metrics folded from the event log, scraped over real HTTP."""

from __future__ import annotations

import time
import urllib.request

import torch
from jobs import free_port

from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.observe.metrics import serve
from torchpass_plugins.weights import WeightPublisher, WeightSubscriber


def test_the_endpoint_serves_what_the_event_log_says(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", source="agent0")
    log.emit("failure_detected", worker="n0-s1-i0", rank=1, code=-9, why="signal 9", gen=0)
    log.emit("roster_published", gen=1, ranks=["a", "b"], promoted={"b": 1}, spares=0, reason="replace rank(s) [1]")
    address = f"127.0.0.1:{free_port()}"
    server = serve(address, tmp_path)
    try:
        log.emit("progress", rank=1, step=7)
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        assert 'torchpass_events_total{event="failure_detected"} 1.0' in body
        assert 'torchpass_step{rank="1"} 7.0' in body and "torchpass_spares 0.0" in body
        log.emit("failure_detected", worker="n0-s2-i0", rank=2, code=-9, why="signal 9", gen=1)
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        assert 'torchpass_events_total{event="failure_detected"} 2.0' in body  # each line counted once
    finally:
        server.shutdown()


def test_the_weights_gauges_follow_the_publisher_and_each_subscriber(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", source="rank0")
    address = f"127.0.0.1:{free_port()}"
    server = serve(address, tmp_path)
    state = {"w": torch.zeros(4)}
    try:
        with WeightPublisher("tcp://127.0.0.1:0", token="t", events=log) as publisher:
            for version in range(3):
                publisher.publish(state, version)
            with WeightSubscriber(publisher.endpoint, token="t", name="replica-a") as subscriber:
                assert subscriber.latest(timeout=10)[0] == 2
            publisher.publish(state, 3)
            deadline = time.monotonic() + 30
            while True:  # the publisher logs a send just after its last byte, maybe after latest() returned
                body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
                if "torchpass_weights_lag" in body or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert "torchpass_weights_version 3.0" in body
        assert 'torchpass_weights_lag{subscriber="replica-a"} 1.0' in body
    finally:
        server.shutdown()
