"""The per-node agent behind ``torchpass launch``: starts one worker per slot and supervises them.

Unlike torchrun's agent it never tears down healthy workers when one exits. It reports each exit to the
coordinator at once, SIGKILLs a worker whose heartbeat lapses (turning a hang into a crash the peers
see), and by default starts a fresh worker in the freed slot, which joins the spare pool.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from torchpass_plugins.control.coordinator import Coordinator
from torchpass_plugins.control.membership import (
    ABORT_KEY,
    CONFIG_ERROR_EXIT,
    DONE_KEY,
    INBOX,
    LEAVING,
    REJECTED_EXIT,
    RESTART_KEY,
    UNRECOVERABLE_EXIT,
    WorkerEnv,
    agent_beat_key,
    connect_store,
    evict_key,
    heartbeat_key,
    node_lost_key,
    prefixed,
)
from torchpass_plugins.control.zygote import Zygote
from torchpass_plugins.health.watch import HealthConfig, is_source
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.observe.metrics import serve

_TICK = 0.05
_AGENTS_DONE = "agents_done"


@dataclass
class LaunchConfig:
    """The flags of ``torchpass launch`` (torchrun-like, plus spares and supervision)."""

    command: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = "127.0.0.1:0"
    rdzv_timeout: float = 300.0  # how long an agent tries to reach node 0's store
    spares: int = 0
    run_dir: str = "torchpass_runs/latest"
    heartbeat_timeout: float = 30.0
    heartbeat_interval: float = 0.5
    refill: bool = True
    token: str = ""
    seed: int | None = None
    max_restarts: int = 3
    spare_wait: float = 20.0  # seconds to wait for a refilled spare when more ranks are lost than spares free
    health: HealthConfig = field(default_factory=HealthConfig)
    straggler_window: int = 50
    straggler_factor: float = 1.5
    straggler_migrate: bool = False
    metrics_addr: str | None = None  # HOST:PORT of node 0's Prometheus endpoint
    # imported once per node by a fork server, which forks every worker (empty: a fresh interpreter each)
    preload: tuple[str, ...] = ("torch", "lightning.pytorch")
    first_slot: int = 0  # index of this agent's first slot (its workers' local rank / GPU)
    external_store: bool = False  # the store at --rdzv-endpoint is someone else's (torchrun's): only connect

    @property
    def processes(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def world_size(self) -> int:
        return self.processes - self.spares

    def validate(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError("--nproc-per-node and --nnodes must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.spares < 0:
            raise ValueError(f"--spares must be >= 0, got {self.spares}")
        if self.spares >= self.processes:
            raise ValueError(
                f"--spares {self.spares} leaves no active rank among {self.processes} processes "
                f"({self.nnodes} node(s) x {self.nproc_per_node}); use fewer spares or more processes"
            )
        if self.spare_wait < 0:
            raise ValueError(f"--spare-wait must be >= 0, got {self.spare_wait}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("--heartbeat-timeout must exceed the heartbeat interval")
        if self.nnodes > 1 and not self.token:
            raise ValueError("multi-node jobs need the same join token on every node: set TORCHPASS_JOIN_TOKEN")
        if self.nnodes > 1 and self.rdzv_endpoint.endswith(":0"):
            raise ValueError("multi-node jobs need a fixed --rdzv-endpoint HOST:PORT reachable from every node")
        if not self.command:
            raise ValueError("no training script given")
        if self.straggler_window < 0 or self.straggler_factor <= 1.0:
            raise ValueError("--straggler-window must be >= 0 (0: off) and --straggler-factor > 1")
        if self.health.interval_s <= 0:
            raise ValueError("--health-interval must be > 0")
        if self.metrics_addr is not None:
            if importlib.util.find_spec("prometheus_client") is None:
                raise ValueError("--metrics-addr needs prometheus-client: pip install 'torchpass-plugins[metrics]'")
            if not self.metrics_addr.rpartition(":")[2].isdigit():
                raise ValueError(f"--metrics-addr must be HOST:PORT, not {self.metrics_addr!r}")
        if not is_source(self.health.source):
            raise ValueError(f"--health-source must be nvml, file:PATH or off, not {self.health.source!r}")


@dataclass
class _Slot:
    index: int
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    worker_id: str = ""
    beats: int = 0
    last_change: float = field(default_factory=time.monotonic)


class Agent:
    """Supervises the workers of one node; node 0's agent also hosts the store and the coordinator."""

    def __init__(self, config: LaunchConfig) -> None:
        config.validate()
        self.config = config
        self.token = config.token or secrets.token_hex(16)
        token_seed = int(hashlib.sha256(self.token.encode()).hexdigest()[:8], 16)
        self.seed = config.seed if config.seed is not None else token_seed
        self.events = EventLog(Path(config.run_dir) / "events.jsonl", source=f"agent{config.node_rank}")
        self.slots = [_Slot(config.first_slot + i) for i in range(config.nproc_per_node)]
        self._signal: int | None = None
        self.attempt = 0  # restarts of the whole job so far
        self._coordinator_thread: threading.Thread | None = None
        self.unhealthy: set[int] = set()  # slots whose device the health watch moved work off: never refilled
        self._done = threading.Event()

    def run(self) -> int:
        cfg = self.config
        try:
            self._client = connect_store(cfg.rdzv_endpoint, is_master=cfg.node_rank == 0 and not cfg.external_store,
                                         timeout=cfg.rdzv_timeout)
        except (dist.DistError, OSError) as exc:
            what = str(exc).splitlines()[0]
            print(f"torchpass: no store at {cfg.rdzv_endpoint} within {cfg.rdzv_timeout:g} s ({what}): start node "
                  "0's agent first, and check --rdzv-endpoint and that this node can reach it (node 0: that HOST "
                  "is one of its addresses and PORT is free)", file=sys.stderr)
            return 1
        self.endpoint = f"{cfg.rdzv_endpoint.rsplit(':', 1)[0]}:{self._client.port}"
        self._begin_attempt()
        self._install_signals()
        if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
            # As torchrun does: N processes each spawning a thread per core would oversubscribe the node.
            os.environ["OMP_NUM_THREADS"] = "1"
            print("torchpass: OMP_NUM_THREADS set to 1 for each worker (set it yourself to tune)", file=sys.stderr)
        self.events.emit("agent_started", node=cfg.node_rank, endpoint=self.endpoint, slots=cfg.nproc_per_node,
                         spares=cfg.spares, world_size=cfg.world_size)
        self._zygote = Zygote(list(cfg.preload)) if cfg.preload else None
        for slot in self.slots:
            self._spawn(slot)
        watch = threading.Thread(target=self._watch_health, name="torchpass-health", daemon=True)
        watch.start()
        if cfg.node_rank == 0 and cfg.nnodes > 1 and not cfg.external_store:
            threading.Thread(target=self._watch_nodes, name="torchpass-nodes", daemon=True).start()
        metrics = serve(cfg.metrics_addr, cfg.run_dir) if cfg.metrics_addr and cfg.node_rank == 0 else None
        try:
            code = self._supervise()
        finally:
            self._done.set()
            if metrics is not None:
                metrics.shutdown()
            if self._zygote is not None:
                self._zygote.close()
            self._kill_all()
            self.store.add(_AGENTS_DONE, 1)
            if cfg.node_rank == 0 and not cfg.external_store:
                self._wait_other_agents()
            self._stop_coordinator()
        return code

    # -- attempts -------------------------------------------------------------------------------------
    def _begin_attempt(self) -> None:
        """Use the keys of attempt ``self.attempt``; node 0 starts its coordinator."""
        cfg = self.config
        self.store = prefixed(self._client, self.attempt)
        if cfg.node_rank == 0:
            self.coordinator = Coordinator(prefixed(self._client.clone(), self.attempt), self.token, cfg.processes,
                                           cfg.world_size, self.events, restarts_left=cfg.max_restarts - self.attempt,
                                           timer_store=prefixed(self._client.clone(), self.attempt),
                                           spare_wait_s=cfg.spare_wait if cfg.refill else 0.0)
            self._coordinator_thread = threading.Thread(target=self.coordinator.run, daemon=True)
            self._coordinator_thread.start()

    def _stop_coordinator(self) -> None:
        if self._coordinator_thread is not None:
            self.store.queue_push(INBOX, json.dumps({"stop": 1}))
            self._coordinator_thread.join(timeout=5)
            self._coordinator_thread = None

    def _restart(self, message: str, grace: float = 5.0) -> None:
        """The coordinator found a failure no spare can fix: start every worker afresh, under new keys."""
        self.attempt += 1
        said = message if message.startswith("torchpass") else f"torchpass: {message}"
        print(f"{said}\ntorchpass: restarting the job (restart {self.attempt} of "
              f"{self.config.max_restarts}): it resumes from its newest snapshot if it writes them, else from "
              "the start", file=sys.stderr, flush=True)
        self.events.emit("job_restarting", attempt=self.attempt, message=message)
        deadline = time.monotonic() + grace  # survivors leave on their own, recording how far they got
        while any(s.proc is not None and s.proc.poll() is None for s in self.slots) and time.monotonic() < deadline:
            time.sleep(_TICK)
        self._kill_all()
        self._stop_coordinator()
        self._begin_attempt()
        for slot in self.slots:
            slot.incarnation += 1
            self._spawn(slot)

    # -- workers --------------------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        cfg = self.config
        slot.worker_id = f"n{cfg.node_rank}-s{slot.index}-i{slot.incarnation}"
        env = WorkerEnv(
            store=self.endpoint, token=self.token, worker_id=slot.worker_id, world_size=cfg.world_size,
            node_rank=cfg.node_rank, local_slot=slot.index, run_dir=str(Path(cfg.run_dir).resolve()),
            seed=self.seed, heartbeat_interval=cfg.heartbeat_interval, attempt=self.attempt,
            straggler_window=cfg.straggler_window, straggler_factor=cfg.straggler_factor,
            straggler_migrate=cfg.straggler_migrate,
        )
        parent = self._zygote.proc.pid if self._zygote is not None else os.getpid()
        worker_env = {**os.environ, **env.to_env(), "PYTHONUNBUFFERED": "1", "TORCHPASS_AGENT_PID": str(parent)}
        if self._zygote is not None:
            slot.proc = self._zygote.spawn(list(cfg.command), worker_env)
        else:
            slot.proc = subprocess.Popen([sys.executable, "-u", *cfg.command], env=worker_env, start_new_session=True)
        slot.beats, slot.last_change = 0, time.monotonic()
        self.events.emit("worker_started", worker=slot.worker_id, pid=slot.proc.pid, slot=slot.index)

    def _supervise(self) -> int:
        """Every tick: reap exited workers (a syscall each). Every heartbeat interval: the store's verdict
        and the heartbeats (store round trips), so that supervision costs the workers' cores little."""
        cfg = self.config
        done, next_check = False, 0.0
        while True:
            if self._signal is not None:
                self.events.emit("agent_signalled", signal=self._signal)
                return 128 + self._signal
            check = time.monotonic() >= next_check
            if check:
                next_check = time.monotonic() + cfg.heartbeat_interval
                if self.store.check([RESTART_KEY]):
                    self._restart(self.store.get(RESTART_KEY).decode())
                    done, next_check = False, 0.0
                    continue
                if self.store.check([ABORT_KEY]):
                    message = self.store.get(ABORT_KEY).decode()
                    print(f"torchpass: job aborted: {message}", file=sys.stderr, flush=True)
                    return 1
                if self.store.check([node_lost_key(cfg.node_rank)]):
                    print("torchpass: the job wrote this node off (its agent was silent too long); stopping its "
                          "workers", file=sys.stderr, flush=True)
                    return 1
                self.store.add(agent_beat_key(cfg.node_rank), 1)
                done = self.store.check([DONE_KEY])
            alive = 0
            for slot in self.slots:
                if slot.proc is None:
                    continue
                code = slot.proc.poll()
                if code is None:
                    alive += 1
                    if check:
                        self._check_heartbeat(slot)
                    continue
                self._report_exit(slot, code)
                slot.proc = None
                if code == REJECTED_EXIT:
                    print(f"torchpass: the job's coordinator at {self.endpoint} refused this node's workers (wrong "
                          "join token): set the same TORCHPASS_JOIN_TOKEN on every node of the job", file=sys.stderr,
                          flush=True)
                    return 1
                next_check = 0.0  # look at the verdict soon after an exit
                refill = cfg.refill and not done and slot.index not in self.unhealthy
                if code not in (0, CONFIG_ERROR_EXIT, UNRECOVERABLE_EXIT) and refill:
                    slot.incarnation += 1
                    self._spawn(slot)
                    alive += 1
            if alive == 0:
                code = self._outcome()
                if code is not None:
                    return code
                next_check = 0.0  # the verdict was a restart: the next check performs it
            time.sleep(_TICK)

    def _outcome(self, grace: float = 10.0) -> int | None:
        """All local workers are gone: wait for the coordinator's verdict on the exits just reported
        (None: the verdict is a restart)."""
        deadline = time.monotonic() + grace
        while not self.store.check([DONE_KEY]) and time.monotonic() < deadline:
            if self.store.check([RESTART_KEY]):
                return None
            self.store.add(agent_beat_key(self.config.node_rank), 1)  # still here, waiting
            time.sleep(_TICK)
        outcome = self.store.get(DONE_KEY).decode() if self.store.check([DONE_KEY]) else "no verdict"
        if outcome != "done":
            print(f"torchpass: job ended without success: {outcome}", file=sys.stderr, flush=True)
        return 0 if outcome == "done" else 1

    # -- other nodes ----------------------------------------------------------------------------------
    def _watch_nodes(self) -> None:
        """Node 0: a node whose agent stops counting up its beat for ``heartbeat_timeout`` is lost with all
        its workers (a machine that died takes its agent along, and only an agent reports its workers'
        exits): the coordinator replaces them as if each had exited."""
        cfg = self.config
        seen: dict[int, tuple[int, float]] = {}
        lost: set[int] = set()
        attempt, store = -1, None
        while not self._done.wait(cfg.heartbeat_interval):
            if attempt != self.attempt:  # every attempt counts anew, under its own keys
                attempt, store, seen = self.attempt, prefixed(self._client.clone(), self.attempt), {}
            if store.check([DONE_KEY]):
                continue
            now = time.monotonic()
            for node in range(1, cfg.nnodes):
                if node in lost:
                    continue
                beats = int(store.add(agent_beat_key(node), 0))
                if beats == 0 or seen.get(node, (None,))[0] != beats:
                    seen[node] = (beats, now)
                elif now - seen[node][1] > cfg.heartbeat_timeout:
                    lost.add(node)
                    why = f"the agent of node {node} was silent for {now - seen[node][1]:.1f} s"
                    self.events.emit("node_lost", node=node, why=why)
                    store.set(node_lost_key(node), why)
                    store.queue_push(INBOX, json.dumps({"node_lost": node, "why": why}))

    # -- device health --------------------------------------------------------------------------------
    def _watch_health(self) -> None:
        """Every interval: read the device of each slot (slot i uses GPU i, as its local rank says) and
        act on the policy: log a warning, or ask the coordinator to move the slot's worker to a spare."""
        health = self.config.health
        source = health.open()
        if source is None:
            return
        warned: dict[tuple[int, str], float] = {}
        try:
            while not self._done.wait(health.interval_s):
                slots = [s for s in self.slots if s.proc is not None and s.index not in self.unhealthy]
                for slot, reading in zip(slots, source.read([s.index for s in slots]), strict=True):
                    for action, why in health.policy.evaluate(reading):
                        if action == "migrate":
                            self._move_off(slot, why)
                            break
                        kind = why.split(" (")[0].split(" at ")[0]
                        if time.monotonic() - warned.get((slot.index, kind), -1e9) > 60:
                            warned[(slot.index, kind)] = time.monotonic()
                            self.events.emit("health_warning", worker=slot.worker_id, device=slot.index, why=why)
        finally:
            source.close()

    def _move_off(self, slot: _Slot, why: str) -> None:
        self.unhealthy.add(slot.index)
        self.events.emit("health_migrate", worker=slot.worker_id, device=slot.index, why=why)
        print(f"torchpass: moving worker {slot.worker_id} off its device: {why}", file=sys.stderr, flush=True)
        store = prefixed(self._client.clone(), self.attempt)  # this thread's own connection
        store.queue_push(INBOX, json.dumps({"migrate": slot.worker_id, "why": why}))

    def _check_heartbeat(self, slot: _Slot) -> None:
        if self.store.check([evict_key(slot.worker_id)]):  # alive, but it stalled the others: replaced
            why = self.store.get(evict_key(slot.worker_id)).decode()
            self.events.emit("worker_evicted", worker=slot.worker_id, why=why)
            slot.proc.kill()
            slot.proc.wait()
            return
        beats = int(self.store.add(heartbeat_key(slot.worker_id), 0))
        now = time.monotonic()
        if beats != slot.beats:
            slot.beats, slot.last_change = beats, now
        elif 0 < beats < LEAVING and now - slot.last_change > self.config.heartbeat_timeout:
            self.events.emit("hang_detected", worker=slot.worker_id, silent_s=now - slot.last_change)
            slot.proc.kill()
            slot.proc.wait()

    def _report_exit(self, slot: _Slot, code: int) -> None:
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        self.events.emit("worker_exited", worker=slot.worker_id, code=code, why=why)
        self.store.queue_push(INBOX, json.dumps({"exit": slot.worker_id, "code": code, "why": why}))

    def _kill_all(self) -> None:
        procs = [s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _wait_other_agents(self, timeout: float = 60.0) -> None:
        """Node 0 hosts the store: keep it up until every agent has finished with it."""
        deadline = time.monotonic() + timeout
        while int(self.store.add(_AGENTS_DONE, 0)) < self.config.nnodes and time.monotonic() < deadline:
            time.sleep(_TICK)

    def _install_signals(self) -> None:
        def handler(signum, _frame) -> None:
            self._signal = signum

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)


def launch(config: LaunchConfig) -> int:
    try:
        return Agent(config).run()
    except dist.DistStoreError as exc:
        print(f"torchpass: the job's store at {config.rdzv_endpoint} failed: {exc}", file=sys.stderr)
        return 1
