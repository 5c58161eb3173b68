"""The per-node agent behind ``torchpass launch``: starts one worker per slot and supervises them.

Unlike torchrun's agent it never tears down healthy workers when one exits. It reports each exit to the
coordinator at once, SIGKILLs a worker whose heartbeat lapses (turning a hang into a crash the peers
see), and by default starts a fresh worker in the freed slot, which joins the spare pool.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from torchpass_plugins.control.coordinator import Coordinator
from torchpass_plugins.control.launch_config import LaunchConfig
from torchpass_plugins.control.leadership import JournaledInbox, QueueInbox, candidacy
from torchpass_plugins.control.lending import SlotLoans
from torchpass_plugins.control.links import LinkWatch
from torchpass_plugins.control.membership import (
    StoreUnusable,
    current_attempt,
    finished_with_store,
    next_incarnation,
    open_job_store,
    prefixed,
    serve_node,
    wait_for_agents,
)
from torchpass_plugins.control.policy import Action, Policy
from torchpass_plugins.control.protocol import (
    ABORT_KEY,
    DONE_KEY,
    LEAVING,
    RESTART_KEY,
    Exit,
    agent_beat_key,
    assign_key,
    borrowed_key,
    evict_key,
    heartbeat_key,
    node_agent_key,
    node_lost_key,
    send,
)
from torchpass_plugins.control.silence import BeatClocks, watch_nodes
from torchpass_plugins.control.slot_devices import Slot, SlotDevices
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.control.zygote import Zygote, worker_command
from torchpass_plugins.errors import with_prefix
from torchpass_plugins.health.watch import HealthWatch
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.observe.metrics import serve

_TICK = 0.05


class Agent(SlotDevices):
    """Supervises the workers of one node. Node 0's agent also hosts the store (a TCPStore) and the
    coordinator; with etcd, the agents elect which one coordinates."""

    def __init__(self, config: LaunchConfig) -> None:
        config.validate()
        self.config = config
        self.token = config.token or secrets.token_hex(16)
        token_seed = int(hashlib.sha256(self.token.encode()).hexdigest()[:8], 16)
        self.seed = config.seed if config.seed is not None else token_seed
        self.events = EventLog(Path(config.run_dir) / "events.jsonl", source=f"agent{config.node_rank}")
        self.slots = [Slot(config.first_slot + i) for i in range(config.nproc_per_node)]
        self._signal: int | None = None
        self.attempt = 0  # restarts of the whole job so far
        self.identity = secrets.token_hex(8)  # this agent among any that serve the node over the job
        self._coordinator_thread: threading.Thread | None = None
        self.unhealthy: set[int] = set()  # slots whose device the health watch moved work off: never refilled
        self._done = threading.Event()
        self.clocks = BeatClocks(config.heartbeat_timeout)  # how long each worker's heartbeat has not moved

    def run(self) -> int:
        cfg = self.config
        try:
            self._client, self.endpoint = open_job_store(cfg)
        except StoreUnusable as exc:
            print(f"torchpass: {exc}", file=sys.stderr)
            return 1
        self.attempt = current_attempt(self._client)  # a node rejoining a restarted job is not at attempt 0
        self._begin_attempt()
        self._install_signals()
        if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
            # As torchrun does: N processes each spawning a thread per core would oversubscribe the node.
            os.environ["OMP_NUM_THREADS"] = "1"
            print("torchpass: OMP_NUM_THREADS set to 1 for each worker (set it yourself to tune)", file=sys.stderr)
        self.events.emit("agent_started", node=cfg.node_rank, endpoint=self.endpoint, slots=cfg.nproc_per_node,
                         spares=cfg.spares, world_size=cfg.world_size)
        self._zygote = Zygote(list(cfg.preload)) if cfg.preload else None
        if self._zygote is not None:
            self.events.emit("fork_server_started", pid=self._zygote.proc.pid, shared=self._zygote.shared)
        self.loans = SlotLoans(lend=cfg.lend, borrow=cfg.borrow, registry=cfg.lend_registry,
                               yield_timeout=cfg.yield_timeout, endpoint=self.endpoint, client=self._client,
                               node=cfg.node_rank, events=self.events) if cfg.lend or cfg.borrow else None
        for slot in self.slots:
            self._spawn(slot)
        threading.Thread(target=HealthWatch(cfg.health).run, args=(self._watched_devices, self._on_device, self._done),
                         name="torchpass-health", daemon=True).start()
        if len(cfg.interfaces) > 1 and cfg.nnodes > 1:
            LinkWatch(cfg.node_rank, cfg.nnodes, list(cfg.interfaces), cfg.link_grace, self._client.clone(),
                      lambda: self.attempt, self.events).start(self._done)
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
            if self.loans is not None:
                self.loans.close(self.slots)
            finished_with_store(self.store, cfg.node_rank)
            if cfg.node_rank == 0 and not cfg.external_store and cfg.store_address is None:
                wait_for_agents(self.store, cfg.nnodes)
            self._stop_coordinator()
        return code

    # -- attempts -------------------------------------------------------------------------------------
    def _begin_attempt(self) -> None:
        """Use the keys of attempt ``self.attempt``, serve this node in it (``serve_node``: a node written off
        comes back), and stand for coordinating it (``leadership``)."""
        cfg = self.config
        self.store = prefixed(self._client, self.attempt)
        if serve_node(self.store, cfg.node_rank, self.identity, max(1, len(cfg.interfaces))):
            self.events.emit("node_rejoined", node=cfg.node_rank)
        self.policy = Policy(restarts_left=cfg.max_restarts - self.attempt, spare_wait_s=cfg.spare_wait,
                             refill=cfg.refill, straggler_migrate=cfg.straggler_migrate,
                             heartbeat_timeout=cfg.heartbeat_timeout, paths=max(1, len(cfg.interfaces)),
                             borrow=cfg.borrow, borrow_wait_s=cfg.yield_timeout + cfg.spare_wait)
        attempt = self.attempt
        self._candidacy = candidacy(lambda: prefixed(self._client.clone(), attempt), cfg.store_address is not None,
                                    cfg.node_rank, cfg.heartbeat_timeout)
        self._coordinator_thread = threading.Thread(target=self._candidacy.run, args=(self._lead,), daemon=True,
                                                    name="torchpass-candidacy")
        self._coordinator_thread.start()

    def _lead(self, store: dist.Store, inbox: QueueInbox | JournaledInbox) -> None:
        """Coordinate the job (restoring a predecessor's state), and watch the other nodes' agents."""
        cfg = self.config
        coordinator = Coordinator(store, self.token, cfg.processes, cfg.world_size, self.events, self.policy,
                                  timer_store=store.clone())
        state = inbox.predecessor_state()
        if state is not None:
            coordinator.restore(state)
        if cfg.store_address is not None:
            self.events.emit("coordinator_elected", node=cfg.node_rank, gen=coordinator.gen,
                             took_over=state is not None)
        term_over = threading.Event()
        if cfg.nnodes > 1 and not cfg.external_store:
            others = [n for n in range(cfg.nnodes) if n != cfg.node_rank]
            threading.Thread(target=watch_nodes, name="torchpass-nodes", daemon=True, args=(
                store.clone(), others, self.policy, self.events, cfg.heartbeat_interval, term_over)).start()
        try:
            coordinator.run(inbox)
        finally:
            term_over.set()

    def _stop_coordinator(self) -> None:
        if self._coordinator_thread is not None:  # the candidacy ends; a term under way saves its state
            self._candidacy.close()
            self._coordinator_thread.join(timeout=5)
            self._coordinator_thread = None

    def _restart(self, message: str, grace: float = 5.0) -> None:
        """The coordinator found a failure no spare can fix: start every worker afresh, under new keys."""
        self.attempt += 1
        print(f"{with_prefix(message)}\ntorchpass: restarting the job (restart {self.attempt} of "
              f"{self.config.max_restarts}): it resumes from its newest snapshot if it writes them, else from "
              "the start", file=sys.stderr, flush=True)
        self.events.emit("job_restarting", attempt=self.attempt, message=message)
        deadline = time.monotonic() + grace  # survivors leave on their own, recording how far they got
        while any(s.proc is not None and s.proc.poll() is None for s in self.slots) and time.monotonic() < deadline:
            time.sleep(_TICK)
        self._kill_all()
        self._stop_coordinator()
        self._begin_attempt()
        self._give_back_loans()
        for slot in self.slots:
            if slot.lent_for is None:
                self._spawn(slot)

    # -- workers --------------------------------------------------------------------------------------
    def _spawn(self, slot: Slot) -> None:
        cfg = self.config
        slot.incarnation = next_incarnation(self._client, cfg.node_rank, slot.index)
        slot.worker_id = f"n{cfg.node_rank}-s{slot.index}-i{slot.incarnation}"
        env = WorkerEnv(
            store=self.endpoint, token=self.token, worker_id=slot.worker_id, world_size=cfg.world_size,
            node_rank=cfg.node_rank, local_slot=slot.index, run_dir=str(Path(cfg.run_dir).resolve()),
            seed=self.seed, heartbeat_interval=cfg.heartbeat_interval, attempt=self.attempt,
            straggler_window=cfg.straggler_window, straggler_factor=cfg.straggler_factor,
            agent_pid=self._zygote.proc.pid if self._zygote is not None else os.getpid(), interfaces=cfg.interfaces,
            protect=cfg.protect, spares=cfg.spares, snapshot_dir=cfg.snapshot_dir, snapshot_every=cfg.snapshot_every,
            borrow=cfg.borrow,
        )
        worker_env = {**os.environ, **env.to_env(), "PYTHONUNBUFFERED": "1"}
        if slot.loan is not None:  # (marked before its worker can join: the coordinator reads it then)
            worker_env["CUDA_VISIBLE_DEVICES"] = slot.loan.device
            self.store.set(borrowed_key(slot.worker_id), slot.loan.device)
        if self._zygote is not None:
            slot.proc = self._zygote.spawn(list(cfg.command), worker_env)
        else:
            slot.proc = subprocess.Popen(worker_command(list(cfg.command)), env=worker_env, start_new_session=True)
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
                with self.clocks.store_call():
                    restart, aborted = self.store.check([RESTART_KEY]), self.store.check([ABORT_KEY])
                    written_off = self.store.check([node_lost_key(cfg.node_rank)]) or self.store.get(
                        node_agent_key(cfg.node_rank)).decode() != self.identity
                    self.store.add(agent_beat_key(cfg.node_rank), 1)
                    done = self.store.check([DONE_KEY])
                if restart:
                    self._restart(self.store.get(RESTART_KEY).decode())
                    done, next_check = False, 0.0
                    continue
                if self.loans is not None:
                    self.loans.tend(self.slots, self.store, self.unhealthy, self._yield, self._spawn,
                                    self._start_borrowed)
                if aborted:
                    print(f"torchpass: job aborted: {self.store.get(ABORT_KEY).decode()}", file=sys.stderr, flush=True)
                    return 1
                if written_off:
                    print("torchpass: the job wrote this node off (its agent was silent too long) or another agent "
                          "serves it now; stopping its workers", file=sys.stderr, flush=True)
                    return 1
            alive = 0
            for slot in list(self.slots):
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
                if slot.loan is not None:
                    self._drop_borrowed(slot)
                    continue
                healthy = slot.index not in self.unhealthy and slot.lent_for is None
                joined = int(self.store.add(heartbeat_key(slot.worker_id), 0)) > 0  # (it beats once joined)
                slot.failed_starts = slot.failed_starts + 1 if code > 0 and not joined else 0
                decision = self.policy.worker_exited(code, job_done=done, device_healthy=healthy,
                                                     failed_starts=slot.failed_starts)
                if decision.action is Action.NOTHING and decision.why:
                    self.events.emit("refill_stopped", slot=slot.index, why=decision.why)
                    print(f"torchpass: slot {slot.index}: {decision.why}", file=sys.stderr, flush=True)
                if decision.action is Action.ABORT:
                    key = assign_key(slot.worker_id)
                    answer = json.loads(self.store.get(key)) if self.store.check([key]) else {}
                    print(f"torchpass: the job's coordinator at {self.endpoint} refused this node's workers: "
                          f"{answer.get('reject', decision.why)}", file=sys.stderr, flush=True)
                    return 1
                next_check = 0.0  # look at the verdict soon after an exit
                if decision.action is Action.REFILL:
                    self._spawn(slot)
                    alive += 1
            if alive == 0 and (done or all(s.lent_for is None for s in self.slots)):  # (a lent slot comes back)
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

    def _check_heartbeat(self, slot: Slot) -> None:
        evicted = evict_key(slot.worker_id)
        if self.store.check([evicted]):  # alive, but it stalled the others: replaced
            self.events.emit("worker_evicted", worker=slot.worker_id, why=self.store.get(evicted).decode())
        else:
            with self.clocks.store_call():
                beats = int(self.store.add(heartbeat_key(slot.worker_id), 0))
            silent_s = self.clocks.silent_for(slot.worker_id, beats)
            if not (0 < beats < LEAVING and self.policy.silence(silent_s).action is Action.EVICT):
                return
            self.events.emit("hang_detected", worker=slot.worker_id, silent_s=silent_s)
        slot.proc.kill()
        slot.proc.wait()

    def _report_exit(self, slot: Slot, code: int) -> None:
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        self.events.emit("worker_exited", worker=slot.worker_id, code=code, why=why)
        send(self.store, Exit(slot.worker_id, code, why))

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
