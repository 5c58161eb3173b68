"""How one recovery's cost grows with the world size, on each store, with members that speak the protocol.

A real coordinator on a real store (node 0's TCPStore, or a real 3-member etcd cluster on 127.0.0.1 through
the elected leader's fenced store and journaled inbox, as an agent runs it) admits `world + 1` members. Each
member is a thread with its own store client, as a worker has, doing what a worker does: it writes its join
token and ``Join``, waits for its assignment, and a rank then waits in its roster watch while the spare waits
for an assignment. The threads live in a few spawned processes (this machine cannot hold 16,385 processes).
Then one rank's exit is reported, and the benchmark times: until the coordinator has published the next
roster (assignment and every member's wake-up written), and until the last member has woken and read it.
It counts the requests the coordinator made to the store meanwhile (etcd: HTTP requests).

Above ``WAITING_MEMBERS_UP_TO`` members of a store, the members only join (a few threads write their
joins): this machine cannot keep that many waiting (on etcd every waiting member is a Python HTTP client
looking again every few seconds, and thousands of them spend both cores handing interpreter locks to each
other before etcd sees their requests). The coordinator's side, what a recovery costs the store, is then
measured the same way; the wake-up is not.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from _harness import bench_args, command_line, fresh_work_root, install_cleanup, machine, machine_lines, publish

from torchpass_plugins.control.coordinator import Coordinator
from torchpass_plugins.control.etcd_gateway import Gateway, address
from torchpass_plugins.control.leadership import LEADER_KEY, JournaledInbox, QueueInbox
from torchpass_plugins.control.membership import Member, connect_store, prefixed
from torchpass_plugins.control.protocol import Exit, Join, join_key, send, watch_key
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing.etcd_cluster import EtcdCluster

FULL = {"tcpstore": (1024, 16384), "etcd": (1024, 16384)}
SMOKE = {"tcpstore": (64,), "etcd": (64,)}
WAITING_MEMBERS_UP_TO = {"tcpstore": 16384, "etcd": 1024}
_THREADS_PER_HOST = 1024  # member threads per process: thousands in one interpreter spend the cores on its lock
_JOINERS = 8  # threads per process writing the joins of members that do not wait
_STACK = 512 * 1024  # each member thread's stack: 16,385 threads must fit in this machine's memory
_WAIT = timedelta(seconds=900)
_TOKEN = "tok"


class Counting:
    """The coordinator's store, counting the operations it asks of it (etcd: its HTTP requests instead)."""

    def __init__(self, store) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


class CountingGateway:
    """Counts every HTTP request the gateways of this process make (``Gateway`` is per client)."""

    requests = 0

    @classmethod
    def install(cls) -> None:
        for name in ("call", "watch_for_put"):
            method = getattr(Gateway, name)

            def counted(self, *args, _method=method, **kwargs):
                cls.requests += 1
                return _method(self, *args, **kwargs)

            setattr(Gateway, name, counted)


@dataclass
class Result:
    store: str
    world: int
    rep: int
    published_s: float  # failure report -> roster, assignment and wake-ups written
    all_woken_s: float | None  # failure report -> the last member has read the new roster (if they wait)
    ops: int


def _member(where: str, worker: str, ready: list, woke: list) -> None:
    """One worker's part, through the worker's own ``Member``: it joins, waits for its assignment, and a rank
    then waits in its roster watch (one wait, as ``Member``'s watch thread; no heartbeat thread: this
    machine's threads are counted) and reads what the new roster changed, as the runtime does."""
    member = Member(_env(where, worker))
    _join(member.store, worker)
    assignment = member.wait_assignment()
    if assignment["gen"] == 0:
        ready.append(worker)
        member.store.wait([watch_key(worker, 1)], _WAIT)
    member.change(1)
    woke.append(time.time())


def _joiner(where: str, workers: list[str], ready: list) -> None:
    """The members that do not wait: their joins only, one after another through one client."""
    store = Member(_env(where, workers[0])).store
    for worker in workers:
        _join(store, worker)
        ready.append(worker)


def _env(where: str, worker: str) -> WorkerEnv:
    return WorkerEnv(store=where, token=_TOKEN, worker_id=worker, world_size=0, node_rank=0, local_slot=0,
                     run_dir="", seed=0, heartbeat_interval=3600.0)


def _join(store, worker: str) -> None:
    store.set(join_key(worker), _TOKEN)
    send(store, Join(worker))


def _host(where: str, workers: list[str], reports, waits: bool) -> None:
    """A process of members: a thread each if they wait, else ``_JOINERS`` threads that write their joins.
    Reports how many are ready (joined, and in their roster wait if they wait), then when the last woke."""
    try:
        threading.stack_size(_STACK)
        ready, woke = [], []
        if waits:
            runs = [(_member, (where, worker, ready, woke)) for worker in workers]
        else:
            runs = [(_joiner, (where, workers[i::_JOINERS], ready)) for i in range(_JOINERS)]
        threads = [threading.Thread(target=target, args=args, daemon=True) for target, args in runs]
        for t in threads:
            t.start()
        reported = -1
        while any(t.is_alive() for t in threads):
            if len(ready) != reported:
                reported = len(ready)
                reports.put(("ready", os.getpid(), reported))
            time.sleep(0.2)
        reports.put(("ready", os.getpid(), len(ready)))
        if len(woke if waits else ready) != len(workers):
            raise RuntimeError(f"{len(workers) - len(woke if waits else ready)} members failed")
        reports.put(("woke", os.getpid(), max(woke, default=0.0)))
    except BaseException:
        reports.put(("error", os.getpid(), traceback.format_exc()))


def run_once(kind: str, world: int, rep: int, etcd: EtcdCluster | None) -> Result:
    if etcd is None:
        server = connect_store("127.0.0.1:0", is_master=True, timeout=_WAIT.total_seconds())
        where = f"127.0.0.1:{server.port}"
        store = prefixed(server)
        inbox_of = QueueInbox
    else:
        where = address(",".join(etcd.endpoints), f"scale-{world}-{rep}")
        root = prefixed(connect_store(where, timeout=_WAIT.total_seconds()))
        store = root.fenced(LEADER_KEY, root.create_leased(LEADER_KEY, "bench", root.grant_lease(3600)))

        def inbox_of(s):
            return JournaledInbox(s, threading.Event())
    counting = Counting(store)
    coordinator = Coordinator(counting, _TOKEN, processes=world + 1, world_size=world, events=EventLog(None))
    inbox = inbox_of(counting)
    workers = [f"n{i // 8}-s{i % 8}-i0" for i in range(world + 1)]
    context = mp.get_context("spawn")
    reports = context.Queue()
    waits = world <= WAITING_MEMBERS_UP_TO[kind]
    n_hosts = -(-len(workers) // _THREADS_PER_HOST)
    hosts = [context.Process(target=_host, args=(where, workers[i::n_hosts], reports, waits), daemon=True)
             for i in range(n_hosts)]
    for h in hosts:
        h.start()
    try:
        while coordinator.gen < 0:  # admits the members, publishes the first roster
            coordinator.handle(inbox.take())
            inbox.handled(coordinator.state())
        ready: dict[int, int] = {}
        while sum(ready.values()) < (world if waits else world + 1):
            _take(reports, "ready", ready)
        time.sleep(2.0)  # every rank is inside its roster wait
        failed = coordinator.ranks[3]
        reporter = prefixed(connect_store(where, timeout=_WAIT.total_seconds()))
        counting.ops, CountingGateway.requests = 0, 0
        began = time.time()
        send(reporter, Exit(failed, -9, "signal 9"))
        while coordinator.gen < 1:
            coordinator.handle(inbox.take())
            inbox.handled(coordinator.state())
        published = time.time() - began
        ops = counting.ops if etcd is None else CountingGateway.requests - 1  # not the report itself
        woke: dict[int, float] = {}
        while waits and len(woke) < n_hosts:
            _take(reports, "woke", woke)
    finally:
        for h in hosts:
            h.kill()
            h.join()
    return Result(kind, world, rep, published, max(woke.values()) - began if waits else None, ops)


def _take(reports, wanted: str, into: dict) -> None:
    """The next report of the member processes, kept in ``into`` by process if it is a ``wanted`` one."""
    what, pid, value = reports.get(timeout=_WAIT.total_seconds())
    if what == "error":
        raise RuntimeError(f"a member process failed:\n{value}")
    if what == wanted:
        into[pid] = value


def render(results: list[Result], smoke: bool, info: dict) -> str:
    lines = ["## Coordinator: one recovery at scale (`benchmarks/coordinator_scale.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny sizes, one repetition; the times are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        "- Setup: a real coordinator on each store (node 0's TCPStore; a 3-member etcd cluster on this machine, "
        "through the elected leader's fenced store and journaled inbox) and `world + 1` members, each a thread "
        f"with its own store client (up to {_THREADS_PER_HOST:,} in a process) that joins, waits for its "
        "assignment and then in its roster watch, as a worker does. One rank's exit is reported. Published: from "
        "the report to the next roster, the spare's assignment and every member's wake-up written. All woken: "
        "from the report until the last member has read the new roster. Requests: what the coordinator asked "
        "of the store meanwhile (TCPStore: store calls; etcd: HTTP requests, its inbox polls included).",
        "- The members share this machine's 2 cores: waking 16,385 threads at once is part of what *All woken* "
        "measures here; on a cluster each member is a process on its own node.",
        "",
        "| Store | World size | Runs | Published, median (s) | All woken, median (s) | Coordinator requests "
        "| Requests per member |",
        "|---|---|---|---|---|---|---|",
    ]
    joined_only = [f"{n:,} members on {k}" for k, n in WAITING_MEMBERS_UP_TO.items()
                   if any(r.store == k and r.world > n for r in results)]
    if joined_only:
        lines[-3:-3] = [
            f"- *Not simulated*: above {', '.join(joined_only)}, the members only join (a few threads write their "
            "joins): this machine cannot keep more of them waiting (each is a Python HTTP client whose looks, "
            "thousands at once, spend both cores on handing the interpreter's lock around). The coordinator's "
            "side is measured as above; the wake-up is not."]
    for kind in ("tcpstore", "etcd"):
        for world in sorted({r.world for r in results if r.store == kind}):
            rs = [r for r in results if r.store == kind and r.world == world]
            ops = statistics.median(r.ops for r in rs)
            woken = [r.all_woken_s for r in rs if r.all_woken_s is not None]
            woken_cell = f"{statistics.median(woken):.3f}" if woken else "not simulated"
            lines.append(f"| {kind} | {world:,} | {len(rs)} | {statistics.median(r.published_s for r in rs):.3f} "
                         f"| {woken_cell} | {ops:,.0f} | {ops / world:.3f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__, argv)
    install_cleanup()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a TCPStore holds a connection per member
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    CountingGateway.install()
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
                    print(f"[coordinator] {kind} world {world} rep {rep}: published {r.published_s:.3f} s, all "
                          f"woken {r.all_woken_s} s, {r.ops} requests", flush=True)
                    results.append(r)
    work_root.mkdir(parents=True, exist_ok=True)
    publish("coordinator", args.doc, render(results, args.smoke, info), work_root,
            {"machine": info, "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
