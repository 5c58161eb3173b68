"""A fork server that outlives jobs, so that successive jobs on a machine skip the heavy imports.

Each node's agent starts a zygote (:mod:`~torchpass_plugins.control.zygote`) that imports torch and Lightning once
per job: seconds of CPU, paid again by every job of a Hydra sweep or a test suite. Where ``TORCHPASS_FORK_SERVER``
names the socket of a running ``torchpass fork-server``, the agent asks that server for its zygote instead: the
server forks a child that already holds the imports, hands it the agent's end of the zygote connection, its
standard streams, working directory and CPU affinity, and the child serves the agent as a zygote it started itself
would. What a zygote cannot be given after it imported torch must be the same for both: the modules preloaded, the
namespaces, the control groups, and the environment variables that libraries read as they load (``OMP_NUM_THREADS``
sizes OpenMP's pool then; :data:`READ_AT_IMPORT`), except those the imports set themselves. Where anything differs
(or the server runs as another user, from another Python, or with torchpass's files changed since it started), or
no server is there, the agent starts its own zygote, as without the variable (the server's output says why). A
server running as root is the exception for the network, mount, UTS and IPC namespaces: its child enters the
agent's (a network namespace standing for another host, ``ip netns exec``), where a zygote started by the agent
would be. A zygote forked by the server leads a session of its own and does not end with the server: it ends when
its agent does.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import select
import socket
import struct
import sys

from torchpass_plugins.control import zygote

VARIABLE = "TORCHPASS_FORK_SERVER"
_NAMESPACES = ("mnt", "net", "pid", "user", "uts", "ipc")
_ENTERABLE = ("net", "mnt", "uts", "ipc")  # a child of a root server can move into these (setns); not pid, user
_STREAMS = 3  # stdin, stdout, stderr
_AGENT_WAIT_S = 30.0  # how long an agent waits for the server's answer
_REQUEST_S = 2.0  # how long the server waits for a request's bytes (one at a time: a stalled agent is dropped)
# Prefixes of the variables that shape a process as torch is imported (NCCL's are read as communicators are
# made, in the workers, whose environment the agent sets).
READ_AT_IMPORT = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_", "LD_", "PYTHON", "TORCH_", "PYTORCH_",
                  "TORCHINDUCTOR_", "TORCHDYNAMO_", "CUDA_", "NVIDIA_")
_READ_LATER = ("TORCH_NCCL_",)


def _namespaces(pid: int | str) -> dict[str, int | str]:
    """A process's namespaces and control groups (a Slurm job's, say): a zygote forked elsewhere would run
    its workers in the server's."""
    with open(f"/proc/{pid}/cgroup") as groups:
        return {**{name: os.stat(f"/proc/{pid}/ns/{name}").st_ino for name in _NAMESPACES}, "cgroup": groups.read()}


def _to_enter(pid: int) -> tuple[list[str], list[str]]:
    """The namespaces of process ``pid`` that differ from this one's: those a child of this server can enter,
    and those it cannot (any, where the server is not root)."""
    theirs, ours = _namespaces(pid), _namespaces("self")
    differ = [name for name in theirs if theirs[name] != ours[name]]
    enterable = [name for name in _ENTERABLE if name in differ] if os.geteuid() == 0 else []
    return enterable, [name for name in differ if name not in enterable]


def _enter(fds: list[int]) -> None:
    """(In the forked child, single-threaded.) Move into the namespaces that ``fds`` (``/proc/PID/ns/*``) name."""
    libc = ctypes.CDLL(None, use_errno=True)
    for fd in fds:
        if libc.setns(fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        os.close(fd)


def read_at_import() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name.startswith(READ_AT_IMPORT) and not name.startswith(_READ_LATER)}


def ask(path: str, preload: list[str], zygote_end: socket.socket) -> int | None:
    """The pid of a zygote that the server at ``path`` forked to serve ``zygote_end`` for this process; None
    where it did not (no server there, or it refused: see the module docstring)."""
    request = {"preload": preload, "environment": read_at_import(), "executable": sys.executable,
               "cwd": os.getcwd(), "umask": _umask(), "affinity": sorted(os.sched_getaffinity(0))}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(_AGENT_WAIT_S)
            conn.connect(path)
            socket.send_fds(conn, [json.dumps(request).encode()], [zygote_end.fileno(), *range(_STREAMS)])
            reply = json.loads(conn.makefile("r").readline() or "{}")
    except (OSError, ValueError):
        return None
    return reply.get("pid")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run(path: str, preload: list[str]) -> None:
    """The server's loop: import ``preload``, then fork a zygote per request; ends when killed."""
    for fd, stream in ((1, "stdout"), (2, "stderr")):  # unbuffered, as the zygote an agent starts (python -u)
        setattr(sys, stream, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                              errors="backslashreplace"))
    environment = read_at_import()
    for module in preload:
        __import__(module)
    # What the imports set themselves (torch sets TORCHINDUCTOR_CACHE_DIR) an agent has too, after importing torch.
    own = {name for name, value in read_at_import().items() if environment.get(name) != value}
    environment = {name: value for name, value in environment.items() if name not in own}
    server = _Server(preload, environment, own, _code_files())
    listener = _listen(path)
    print(f"torchpass fork server at {path}, {','.join(preload)} imported", flush=True)
    while True:
        if select.select([listener], [], [], 0.5)[0]:
            conn, _ = listener.accept()
            with conn:
                try:
                    server.answer(listener, conn)
                except (OSError, ValueError, KeyError, TypeError) as exc:  # (that agent starts its own zygote)
                    print(f"torchpass fork server: a request failed: {exc!r}", flush=True)
        while True:  # reap the zygotes that ended (their agents did)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _listen(path: str) -> socket.socket:
    """Listen at ``path``, taking it over from a server that is gone (its socket file left behind)."""
    if os.path.exists(path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)
            else:
                raise SystemExit(f"torchpass fork-server: another server listens at {path}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    return listener


def _code_files() -> dict[str, int]:
    """The files of the torchpass modules this process imported, and of torch's and Lightning's packages,
    with their modification times: a change means the server would fork stale code."""
    files = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and (name.startswith(("torchpass_plugins", "hydra_plugins")) or name in ("torch", "lightning")):
            files[path] = os.stat(path).st_mtime_ns
    return files


class _Server:
    def __init__(self, preload: list[str], environment: dict[str, str], own: set[str], code: dict[str, int]) -> None:
        self.preload, self.environment, self.own, self.code = preload, environment, own, code

    def answer(self, listener: socket.socket, conn: socket.socket) -> None:
        conn.settimeout(_REQUEST_S)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1 + _STREAMS)
        namespaces: list[int] = []  # the agent's, to enter: opened now, while the agent surely lives
        try:
            request = json.loads(message)
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            enter, foreign = _to_enter(pid)
            refused = self._refusal(uid, foreign, request, fds)
            if refused:
                print(f"torchpass fork server: an agent starts its own: {refused}", flush=True)
                conn.sendall(b"{}\n")
                return
            namespaces = [os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name in enter]
            pid = os.fork()
            if pid == 0:
                _become_zygote(listener, conn, request, fds, namespaces, self.preload)
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        finally:
            for fd in fds + namespaces:
                os.close(fd)

    def _refusal(self, uid: int, foreign: list[str], request: dict, fds: list[int]) -> str | None:
        theirs = {name: value for name, value in request["environment"].items() if name not in self.own}
        differs = sorted(name for name in theirs.keys() | self.environment.keys()
                         if theirs.get(name) != self.environment.get(name))
        changed = [path for path, mtime in self.code.items() if _mtime(path) != mtime]
        return ("its standard streams are not all open" if len(fds) != 1 + _STREAMS else
                "it runs as another user" if uid != os.getuid() else
                f"other namespaces or control groups: {', '.join(foreign)}" if foreign else
                f"it runs {request['executable']}" if request["executable"] != sys.executable else
                f"it preloads {request['preload']}" if request["preload"] != self.preload else
                f"variables read at import differ: {', '.join(differs)}" if differs else
                f"files changed since this server started (restart it): {changed[0]}" if changed else None)


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _become_zygote(listener: socket.socket, conn: socket.socket, request: dict, fds: list[int],
                   namespaces: list[int], preload: list[str]) -> None:
    """(In the forked child.) Take the agent's namespaces, streams and place, and serve it; never returns."""
    try:
        listener.close()
        conn.close()
        _enter(namespaces)
        os.setsid()  # signals to the server's session or process group are not for the agents' jobs
        zygote_fd, streams = fds[0], fds[1:]
        for target, fd in enumerate(streams):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.sched_setaffinity(0, request["affinity"])
        sys.path[0] = ""  # the working directory, as for the zygote an agent starts itself (python -c)
        zygote.serve(zygote_fd, preload, with_parent=False)  # ends the process
    finally:
        os._exit(1)
