"""How the coordinator's work per recovery grows with the world size, on each store.

A real coordinator on a real store (node 0's TCPStore, or a real 3-member etcd cluster on 127.0.0.1 with
the leader's fenced store and journaled inbox, as an elected agent runs it) admits `world + 1` simulated
members: their join tokens and ``Join`` messages are written to the store, as workers write them. Then one
rank's exit is reported, and the benchmark times the coordinator from taking that report off the inbox to
having published the next roster, assignment and every member's wake-up key (when every member can go on),
and counts the store operations it made (its inbox's included). The members are simulated by those
writes: no process per member (this machine cannot hold 16,384 processes), so what is measured is the
coordinator's side only.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from _harness import bench_args, command_line, fresh_work_root, install_cleanup, machine, machine_lines, publish

from torchpass_plugins.control.coordinator import Coordinator
from torchpass_plugins.control.etcd_store import EtcdStore
from torchpass_plugins.control.leadership import LEADER_KEY, JournaledInbox, QueueInbox
from torchpass_plugins.control.membership import connect_store, prefixed
from torchpass_plugins.control.protocol import Exit, Join, join_key, roster_key, send
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing.etcd_cluster import EtcdCluster

FULL = {"tcpstore": (1024, 16384), "etcd": (1024, 4096, 16384)}
SMOKE = {"tcpstore": (64,), "etcd": (64,)}
_WRITERS = 8  # threads writing the members' joins, each on a connection of its own


class Counting:
    """The coordinator's store, counting the operations it asks of it."""

    def __init__(self, store) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


@dataclass
class Result:
    store: str
    world: int
    rep: int
    recovery_s: float
    ops: int


def _join_all(clients, workers: list[str]) -> None:
    def write(client, part):
        for w in part:
            client.set(join_key(w), "tok")
            send(client, Join(w))

    threads = [threading.Thread(target=write, args=(c, workers[i::len(clients)])) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_once(kind: str, world: int, rep: int, etcd: EtcdCluster | None) -> Result:
    if etcd is None:
        server = connect_store("127.0.0.1:0", is_master=True, timeout=600)
        store = prefixed(server)
        clients = [prefixed(server.clone()) for _ in range(_WRITERS)]
        inbox_of = QueueInbox
    else:
        root = EtcdStore(etcd.endpoints, prefix=f"scale/{world}-{rep}", timeout=timedelta(seconds=120))
        created = root.create_leased(LEADER_KEY, "bench", root.grant_lease(600))
        store = root.fenced(LEADER_KEY, created)
        clients = [root.clone() for _ in range(_WRITERS)]

        def inbox_of(s):
            return JournaledInbox(s, threading.Event())
    counting = Counting(store)
    coordinator = Coordinator(counting, "tok", processes=world + 1, world_size=world, events=EventLog(None))
    inbox = inbox_of(counting)
    workers = [f"n{i}-s0-i0" for i in range(world + 1)]
    _join_all(clients, workers)
    while coordinator.gen < 0:  # admits the members, publishes the first roster
        coordinator.handle(inbox.take())
        inbox.handled(coordinator.state())
    send(clients[0], Exit(workers[3], -9, "signal 9"))
    counting.ops = 0
    began = time.perf_counter()
    coordinator.handle(inbox.take())
    inbox.handled(coordinator.state())
    took = time.perf_counter() - began
    assert store.check([roster_key(1)]), "no roster after the failure"
    return Result(kind, world, rep, took, counting.ops)


def render(results: list[Result], smoke: bool, info: dict) -> str:
    lines = ["## Coordinator: one recovery at scale (`benchmarks/coordinator_scale.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny sizes, one repetition; the times are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        "- Setup: a real coordinator on each store (node 0's TCPStore; a 3-member etcd cluster on this machine, "
        "through the elected leader's fenced store and journaled inbox) admits `world + 1` simulated members "
        "(their join writes only, no process each); one rank's exit is reported. Recovery: from taking that "
        "report off the inbox to the next roster, the spare's assignment and every member's wake-up key "
        "written, and the state saved. Store operations: what the coordinator asked of the store meanwhile.",
        "",
        "| Store | World size | Runs | Recovery, median (s) | Store operations | Operations per member |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("tcpstore", "etcd"):
        for world in sorted({r.world for r in results if r.store == kind}):
            rs = [r for r in results if r.store == kind and r.world == world]
            ops = statistics.median(r.ops for r in rs)
            lines.append(f"| {kind} | {world:,} | {len(rs)} | {statistics.median(r.recovery_s for r in rs):.3f} "
                         f"| {ops:,.0f} | {ops / world:.2f} |")
    lines += ["", "A recovery writes one wake-up key per member of the old and new roster, so its cost grows "
              "linearly with the world size; etcd's cost per operation is a replicated transaction over HTTP, "
              "which makes it the larger per member.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__, argv)
    install_cleanup()
    sizes = SMOKE if args.smoke else FULL
    reps = args.reps or (1 if args.smoke else 3)
    info = machine()
    work_root = fresh_work_root("coordinator", args.smoke)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp, EtcdCluster(Path(tmp)) as etcd:
        for rep in range(reps):
            for kind, worlds in sizes.items():
                for world in worlds:
                    r = run_once(kind, world, rep, etcd if kind == "etcd" else None)
                    print(f"[coordinator] {kind} world {world} rep {rep}: {r.recovery_s:.3f} s, {r.ops} ops",
                          flush=True)
                    results.append(r)
    work_root.mkdir(parents=True, exist_ok=True)
    publish("coordinator", args.doc, render(results, args.smoke, info), work_root,
            {"machine": info, "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
