"""Running real ``torchpass launch`` jobs (for the tests and the chaos matrix): hard timeouts, and every
process accounted for."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchpass_plugins.control.worker_env import VARIABLE as WORKER_VARIABLE
from torchpass_plugins.testing.faults import LINK_VARIABLE
from torchpass_plugins.testing.netns import Hosts

PACKAGE = Path(__file__).resolve().parents[2]
TRAIN = PACKAGE / "demo" / "train.py"
JOB_TIMEOUT = 240.0
# What every job's launcher runs with. OMP_NUM_THREADS: CPU kernels round differently with another thread
# count, and the launcher gives one thread to each of several workers on a node but all threads to a single
# one: jobs whose ranks are spread over nodes in other ways are comparable bit for bit only with the same
# count everywhere. PYTHONFAULTHANDLER: a hung job's workers print every thread's stack on SIGABRT.
JOB_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def free_port() -> int:
    return free_ports(1)[0]


def service_port() -> int:
    """A free port below the system's ephemeral range, as a service's fixed port is: the system never hands
    it to a socket bound to port 0 (a process group's listener), so a server that dies and is replaced can
    bind it again, as a weight publisher's successor does."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1: held open together while chosen, so the system cannot hand
    out one of them twice (ports asked for one at a time, each closed at once, can repeat)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@dataclass
class Job:
    """One ``torchpass launch`` agent (or several, for simulated nodes) and the run directory they share."""

    run_dir: Path
    agents: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    commands: list[tuple[list[str], dict]] = field(default_factory=list)  # each node's command line and environment
    started: float = field(default_factory=time.monotonic)

    @property
    def out(self) -> Path:
        return self.run_dir / "out"

    def events(self, name: str | None = None) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in records if name is None or r["event"] == name]

    def applied(self, rank: int) -> list[int]:
        path = self.out / f"applied_rank{rank}.txt"
        return [int(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []

    def final(self) -> dict:
        return torch.load(self.out / "final.pt", weights_only=True)

    @property
    def full_speed_file(self) -> Path:
        return self.run_dir / "full-speed"

    def full_speed(self) -> None:
        """The faults are done: the demo's workers stop sleeping per step (``--sleep-per-step`` keeps a run long
        enough for faults to land mid-run; the rest need not wait)."""
        self.full_speed_file.touch()

    def state(self, rank: int) -> dict:
        """Logical rank ``rank``'s full state at the end of training (the demo's ``state_rank{r}.pt``)."""
        return torch.load(self.out / f"state_rank{rank}.pt", weights_only=True)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def worker_pids(self) -> dict[str, int]:
        return {e["worker"]: e["pid"] for e in self.events("worker_started")}

    def pid_of_rank(self, rank: int) -> int:
        roster = self.events("roster_published")[-1]
        return self.worker_pids()[roster["ranks"][rank]]

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline or all(a.poll() is not None for a in self.agents):
                raise AssertionError(f"gave up waiting for {what}:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float = JOB_TIMEOUT) -> list[int]:
        """Wait for every agent; on timeout kill everything and fail."""
        deadline = self.started + timeout
        try:
            codes = [a.wait(timeout=max(1.0, deadline - time.monotonic())) for a in self.agents]
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.kill()
            raise AssertionError(f"job exceeded {timeout}s:\n{self.output()[-4000:]}") from None
        return codes

    def dump_stacks(self) -> None:
        """Have every live worker print each thread's Python stack into the log (faulthandler, on SIGABRT):
        where a hung job was stuck."""
        for pid in self.worker_pids().values():
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGABRT)
                except ProcessLookupError:
                    continue
                time.sleep(1.0)  # one worker at a time: their dumps share the log

    def leftovers(self) -> list[int]:
        """Live processes of the job once it ended: any in its agents' sessions (the agents, fork servers),
        every fork server forked by a ``torchpass fork-server`` and every worker it started (each leads a
        session of its own); a second look after 1 s spares
        the processes that were on their way out."""
        left = self._live()
        if left:
            time.sleep(1.0)
            left = self._live()
        return left

    def _live(self) -> list[int]:
        sessions = {agent.pid for agent in self.agents}
        live = {pid for pid in self.worker_pids().values() if alive(pid)}
        live |= {e["pid"] for e in self.events("fork_server_started") if alive(e["pid"])}  # (one forked elsewhere)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) in sessions:
                live.add(int(stat.parent.name))
        return sorted(live)

    def kill_node(self, node: int) -> None:
        """A whole node dies: SIGKILL its agent and every worker it started, at once, so no agent reports
        those workers' exits."""
        workers = [e["pid"] for e in self.events("worker_started") if e["source"] == f"agent{node}"]
        os.killpg(self.agents[node].pid, signal.SIGKILL)
        self.agents[node].wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def start_node(self, node: int) -> None:
        """Start ``node``'s agent again with its command line, as a replacement machine would (its log goes
        on in the same file)."""
        cmd, env = self.commands[node]
        with open(self.logs[node], "ab") as f:
            self.agents[node] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True)

    def kill(self) -> None:
        """SIGKILL everything the job started, agents first."""
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for pid in self._live():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(
    run_dir: Path,
    *,
    nproc: int = 4,
    spares: int = 1,
    train_args: tuple[str, ...] = (),
    launch_args: tuple[str, ...] = (),
    faults: str = "",
    nnodes: int = 1,
    script: Path = TRAIN,
    node_0_first: str | None = None,
    hosts: Hosts | None = None,
    node_args: dict[int, tuple[str, ...]] | None = None,
) -> Job:
    """Start the agents of one job (``nnodes`` simulated nodes on this machine). ``node_0_first``: an event
    node 0 must have logged before the other nodes start (``coordinator_elected``: it coordinates; on a busy
    machine a later node's agent may otherwise win the election). ``hosts``: node ``i`` runs in network
    namespace ``i`` of these, node 0's store at its path-0 address. ``node_args``: launcher options of one node
    only, after ``launch_args`` (the last of an option repeated wins)."""
    env = {**os.environ, **JOB_ENVIRONMENT, "TORCHPASS_FAULTS": faults, "TORCHPASS_JOIN_TOKEN": "test-token"}
    env.pop(WORKER_VARIABLE, None)
    job = Job(run_dir)
    if script == TRAIN and "--sleep-per-step" in train_args:
        train_args = (*train_args, "--sleep-until", str(job.full_speed_file))
    endpoint = f"{hosts.address(0) if hosts else '127.0.0.1'}:{free_port() if nnodes > 1 else 0}"
    for node in range(nnodes):
        log = run_dir / f"agent{node}.log"
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "torchpass_plugins.cli", "launch", "--nproc-per-node", str(nproc),
            "--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv-endpoint", endpoint,
            "--spares", str(spares), "--run-dir", str(run_dir), *launch_args, *(node_args or {}).get(node, ()),
            str(script), "--out", str(run_dir / "out"), *train_args,
        ]  # fmt: skip
        if hosts is not None:
            cmd = ["ip", "netns", "exec", hosts.name(node), *cmd]
        node_env = {**env, LINK_VARIABLE: hosts.preferred_port(node)} if hosts is not None else env
        with open(log, "wb") as f:
            job.agents.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=node_env,
                                               start_new_session=True))
        job.commands.append((cmd, node_env))
        job.logs.append(log)
        if node == 0 and nnodes > 1:
            time.sleep(0.5)  # node 0 hosts the store
            if node_0_first is not None:
                job.wait_until(lambda: any(e["source"] == "agent0" for e in job.events(node_0_first)),
                               f"node 0's {node_0_first}")
    return job


def run_command(run_dir: Path, cmd: list[str], faults: str = "") -> tuple[Job, list[int]]:
    """Run another launcher's command line (torchrun, ``accelerate launch``) as one job, bounded."""
    env = {**os.environ, **JOB_ENVIRONMENT, "TORCHPASS_FAULTS": faults}
    env.pop(WORKER_VARIABLE, None)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "launch.log"
    job = Job(run_dir, logs=[log])
    with open(log, "wb") as out:
        job.agents.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    try:
        return job, job.wait()
    finally:
        job.kill()


def run(run_dir: Path, timeout: float = JOB_TIMEOUT, **kwargs) -> tuple[Job, list[int]]:
    job = start(run_dir, **kwargs)
    try:
        return job, job.wait(timeout)
    finally:
        job.kill()
