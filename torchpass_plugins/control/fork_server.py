"""A fork server that outlives jobs, so that successive jobs on a machine skip the heavy imports.

Each node's agent starts a zygote (:mod:`~torchpass_plugins.control.zygote`) that imports torch and Lightning
once per job: seconds of CPU, paid again by every job of a Hydra sweep or a test suite. Where
``TORCHPASS_FORK_SERVER`` names the socket of a running ``torchpass fork-server``, the agent asks that server
for its zygote instead: the server forks a child that already holds the imports, hands it the agent's end of
the zygote connection, its standard streams, working directory and CPU affinity, and the child serves the
agent as a zygote it started itself would. What a zygote cannot be given after it imported torch must be
the same for both: the modules preloaded, the namespaces (a network namespace stands for another host),
the control groups, and the environment variables that libraries read as they load (``OMP_NUM_THREADS``
sizes OpenMP's pool then; :data:`READ_AT_IMPORT`), except those the imports set themselves. Where anything
differs, or no server is there, the agent starts its own zygote, as without the variable (the server's
output says why).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys

from torchpass_plugins.control import zygote

VARIABLE = "TORCHPASS_FORK_SERVER"
_NAMESPACES = ("mnt", "net", "pid", "user", "uts", "ipc")
_STREAMS = 3  # stdin, stdout, stderr
# Prefixes of the variables that shape a process as torch is imported (NCCL's are read as communicators are
# made, in the workers, whose environment the agent sets).
READ_AT_IMPORT = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_", "LD_", "PYTHON", "TORCH_", "PYTORCH_",
                  "TORCHINDUCTOR_", "TORCHDYNAMO_", "CUDA_", "NVIDIA_")
_READ_LATER = ("TORCH_NCCL_",)


def namespaces() -> list[int | str]:
    """This process's namespaces and control groups (a Slurm job's, say): a zygote forked elsewhere would
    run its workers in that process's."""
    with open("/proc/self/cgroup") as groups:
        return [os.stat(f"/proc/self/ns/{name}").st_ino for name in _NAMESPACES] + [groups.read()]


def read_at_import() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name.startswith(READ_AT_IMPORT) and not name.startswith(_READ_LATER)}


def ask(path: str, preload: list[str], zygote_end: socket.socket) -> int | None:
    """The pid of a zygote that the server at ``path`` forked to serve ``zygote_end`` for this process; None
    where it cannot (no server there; other preloaded modules, namespaces or variables read at import)."""
    request = {"preload": preload, "namespaces": namespaces(), "environment": read_at_import(), "cwd": os.getcwd(),
               "umask": _umask(), "affinity": sorted(os.sched_getaffinity(0))}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10.0)
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
    environment = read_at_import()
    for module in preload:
        __import__(module)
    # What the imports set themselves (torch sets TORCHINDUCTOR_CACHE_DIR) an agent has too, after importing torch.
    own = {name for name, value in read_at_import().items() if environment.get(name) != value}
    environment = {name: value for name, value in environment.items() if name not in own}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(f"torchpass fork server at {path}, {','.join(preload)} imported", flush=True)
    while True:
        if select.select([listener], [], [], 0.5)[0]:
            conn, _ = listener.accept()
            with conn:
                _answer(listener, conn, preload, environment, own)
        while True:  # reap the zygotes that ended (their agents did)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _answer(listener: socket.socket, conn: socket.socket, preload: list[str], environment: dict[str, str],
            own: set[str]) -> None:
    conn.settimeout(10.0)
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1 + _STREAMS)
    request = json.loads(message)
    theirs = {name: value for name, value in request["environment"].items() if name not in own}
    differs = sorted(name for name in theirs.keys() | environment.keys() if theirs.get(name) != environment.get(name))
    refused = ("its standard streams are not all open" if len(fds) != 1 + _STREAMS else
               "other namespaces or control groups" if request["namespaces"] != namespaces() else
               f"it preloads {request['preload']}" if request["preload"] != preload else
               f"variables read at import differ: {', '.join(differs)}" if differs else None)
    if refused:
        for fd in fds:
            os.close(fd)
        print(f"torchpass fork server: an agent starts its own: {refused}", flush=True)
        conn.sendall(b"{}\n")
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        zygote_fd, streams = fds[0], fds[1:]
        for target, fd in enumerate(streams):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.sched_setaffinity(0, request["affinity"])
        sys.path[0] = ""  # the working directory, as for the zygote an agent starts itself (python -c)
        zygote.serve(zygote_fd, preload)  # exits, never returns
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
