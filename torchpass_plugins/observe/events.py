"""The run's event log: one JSON object per line in ``RUN_DIR/events.jsonl``, shared by all processes.

Each event is written with a single ``write`` on a file opened for appending, so lines from different
processes never interleave.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends events; ``EventLog(None)`` is the silent log used when nobody asked for one."""

    def __init__(self, path: str | os.PathLike | None, source: str = "") -> None:
        self.path = Path(path) if path else None
        self.source = source
        self._lock = threading.Lock()
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, "source": self.source, **fields}
        self._write(record)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        if self.path:
            line = (json.dumps(record, default=str) + "\n").encode()
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)


class HeldEvents(EventLog):
    """Events held back until ``release``. The coordinator logs what it decided about a batch of reports
    once the batch is saved: a batch that a successor handles again (its predecessor died before saving
    it) is then logged once."""

    def __init__(self, log: EventLog) -> None:
        super().__init__(log.path, log.source)
        self._held: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, "source": self.source, **fields}
        self._held.append(record)
        return record

    def release(self) -> None:
        for record in self._held:
            self._write(record)
        self._held.clear()


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
