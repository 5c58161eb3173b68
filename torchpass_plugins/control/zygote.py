"""A fork server per node: heavy modules are imported once, and every worker is a fork of that process.

Importing torch and Lightning costs seconds of CPU per process; a job starts a worker per slot, and a
fresh one for every failure (refill) and every restart. The zygote imports the ``preload`` modules once,
single-threaded and without touching CUDA, then forks a worker per request: the worker starts in
milliseconds and runs the training script as ``__main__``, as ``python script.py`` would. The agent
talks to it over a socket pair: ``{"spawn", "argv", "env"}`` -> ``{"pid"}``; ``{"exited", "code"}`` when a
worker ends (the zygote is the workers' parent, so it reaps them).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from torchpass_plugins._compat.interpreter import run_exit_steps
from torchpass_plugins.control import fork_server

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def worker_command(argv: list[str]) -> list[str]:
    """The command line of a worker started as a fresh interpreter (nothing preloaded): ``python argv...``
    through the worker's entry, :func:`torchpass_plugins.control.worker.run_as_worker`."""
    entry = ("import sys; from torchpass_plugins.control.worker import run_as_worker; "
             "sys.exit(run_as_worker(sys.argv[1:]))")
    return [sys.executable, "-u", "-c", entry, *argv]


def _run_worker(argv: list[str], env: dict[str, str]) -> None:
    """In the forked child: become ``python argv...`` (through the worker's entry, imported here rather than
    in the zygote, which imports only what it preloads) and leave as its interpreter would."""
    os.setsid()
    _die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    from torchpass_plugins.control.worker import run_as_worker

    code = run_as_worker(argv)
    # What the interpreter does at exit, short of tearing down modules that the fork shares.
    run_exit_steps()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def serve(fd: int, preload: list[str], with_parent: bool = True) -> None:
    """The zygote's loop (its own process): fork on request, report exits; ends when the agent goes (and,
    ``with_parent``, when its parent does: the agent that started it, not a ``torchpass fork-server``)."""
    if with_parent:
        _die_with_parent()
    conn = socket.socket(fileno=fd)
    for module in preload:
        try:
            __import__(module)
        except ImportError:
            pass
    if threading.active_count() != 1:
        print("torchpass: the preloaded modules started threads; forking workers from them is unsafe",
              file=sys.stderr, flush=True)
    reader = conn.makefile("r")
    while True:
        ready, _, _ = select.select([conn], [], [], 0.05)
        if ready:
            line = reader.readline()
            if not line:  # the agent is done (or gone): leave without tearing down torch and co.
                sys.stdout.flush()
                os._exit(0)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                conn.close()
                _run_worker(request["argv"], request["env"])
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn.sendall((json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n").encode())


class Worker:
    """What the agent holds for a forked worker: the ``subprocess.Popen`` methods it uses."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def _signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still this worker's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)


class _Forked:
    """A zygote that a ``torchpass fork-server`` forked for this agent: not its child, so it is watched
    through a pidfd, and its exit status is its parent's to know (-1 here)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._fd], [], [], 0)[0]:
            self.returncode = -1
            os.close(self._fd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout)
        return self.poll()

    def kill(self) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)


def _forked(server: str, preload: list[str]) -> tuple[_Forked, socket.socket] | None:
    """A zygote that the ``torchpass fork-server`` at ``server`` forked, and the connection to it; None where
    it did not. (A fresh connection for each try: one whose end the server received, but answered too late,
    may be served by a zygote that then ends with it.)"""
    ours, theirs = socket.socketpair()
    with theirs:
        pid = fork_server.ask(server, preload, theirs)
    try:
        if pid:
            return _Forked(pid), ours
    except OSError:  # gone already, or no pidfds (Linux before 5.3)
        pass
    ours.close()
    return None


def _started(preload: list[str]) -> tuple[subprocess.Popen, socket.socket]:
    """A zygote started here, and the connection to it."""
    ours, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-c", "import sys; from torchpass_plugins.control.zygote import serve; "
             f"serve({theirs.fileno()}, sys.argv[1:])", *preload],
            pass_fds=[theirs.fileno()],
        )
    return proc, ours


class Zygote:
    """The agent's side: starts the fork server (or has a ``torchpass fork-server`` fork it), asks it for
    workers, learns of their exits."""

    def __init__(self, preload: list[str]) -> None:
        server = os.environ.get(fork_server.VARIABLE)
        forked = _forked(server, preload) if server else None
        self.shared = forked is not None  # forked from a torchpass fork-server
        self.proc: subprocess.Popen | _Forked
        self.proc, self._conn = forked or _started(preload)
        self._lock = threading.Lock()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._spawned = threading.Condition()
        threading.Thread(target=self._read, name="torchpass-zygote", daemon=True).start()

    def _read(self) -> None:
        for line in self._conn.makefile("r"):
            message = json.loads(line)
            with self._spawned:
                if "pid" in message:
                    self._pids.append(message["pid"])
                else:
                    self._exits[message["exited"]] = message["code"]
                self._spawned.notify_all()
        with self._spawned:  # the zygote died: so did its workers (they die with their parent)
            for pid in self._pids:
                self._exits.setdefault(pid, -signal.SIGKILL)
            self._spawned.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], timeout: float = 600.0) -> Worker:
        with self._lock, self._spawned:
            known = len(self._pids)
            self._conn.sendall((json.dumps({"argv": argv, "env": env}) + "\n").encode())
            if not self._spawned.wait_for(lambda: len(self._pids) > known or self.proc.poll() is not None, timeout):
                raise RuntimeError("torchpass: the fork server did not answer")
            if len(self._pids) == known:
                raise RuntimeError(f"torchpass: the fork server exited ({self.proc.returncode})")
            return Worker(self._pids[known], self)

    def exit_code(self, pid: int) -> int | None:
        with self._spawned:
            return self._exits.get(pid)

    def close(self) -> None:
        self._conn.shutdown(socket.SHUT_RDWR)  # EOF for the zygote now (the reader's file still holds the fd)
        self._conn.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
