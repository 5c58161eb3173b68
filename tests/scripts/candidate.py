"""An agent's candidacy alone, in a process of its own that a test can pause (SIGSTOP) as a partition
would cut it off: while it leads it publishes its name under ``published`` through its fenced store."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from torchpass_plugins.control.etcd_store import EtcdStore
from torchpass_plugins.control.leadership import Election


def lead(store, inbox) -> None:
    print("elected", flush=True)
    while not inbox.over.is_set():
        store.set("published", sys.argv[2])
        time.sleep(0.05)


if __name__ == "__main__":
    store = EtcdStore(sys.argv[1].split(","), prefix="candidates", timeout=timedelta(seconds=30))
    Election(store, node=int(sys.argv[2]), ttl=float(sys.argv[3])).run(lead)
