"""Hosts for tests of real network faults: Linux network namespaces joined by veth links to bridges.

Host ``i`` is a namespace with one interface per path: ``eth{p}`` at ``10.(201 + p).0.(i + 1)/24``, whose link's
other end is port ``h{i}`` (path 0) or ``h{i}p{p}`` of bridge ``br{p}`` in a namespace of its own (the switch;
one bridge per path, as separate rails are). Taking a port down is a cable pulled;
a ``tc`` qdisc on it is a slow or bad one. Processes run in a host with :meth:`Hosts.popen`. Every namespace (and
with it every link) is deleted on exit, whatever happened. Needs root and ``ip``/``tc`` (iproute2).
"""

from __future__ import annotations

import itertools
import os
import secrets
import subprocess
from typing import Any

_serial = itertools.count()


class NamespacesUnavailable(RuntimeError):
    """This machine cannot create network namespaces (not root, or no iproute2)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Hosts:
    def __init__(self, count: int, paths: int = 1) -> None:
        self.count, self.paths = count, paths
        self.prefix = f"tp{os.getpid()}-{next(_serial)}-{secrets.token_hex(2)}"  # unique, across containers too
        self.switch = f"{self.prefix}-sw"
        self._made: list[str] = []

    def name(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def address(self, i: int, path: int = 0) -> str:
        return f"10.{201 + path}.0.{i + 1}"

    @staticmethod
    def port(i: int, path: int = 0) -> str:
        return f"h{i}" if path == 0 else f"h{i}p{path}"

    def interfaces(self) -> str:
        """A job's ``--interfaces`` on these hosts: the last path first, so that path 0, which carries the
        store (node 0's path-0 address), is the one the job falls back to."""
        return ",".join(f"eth{path}" for path in reversed(range(self.paths)))

    def preferred_port(self, i: int) -> str:
        """``NAMESPACE/PORT`` of host ``i``'s link of the path jobs prefer (the faults' ``TORCHPASS_FAULT_LINK``)."""
        return f"{self.switch}/{self.port(i, self.paths - 1)}"

    def __enter__(self) -> Hosts:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root: run the tests as root (CI does)")
        try:
            self._add(self.switch)
            for path in range(self.paths):
                _ip("-n", self.switch, "link", "add", f"br{path}", "type", "bridge")
                _ip("-n", self.switch, "link", "set", f"br{path}", "up")
            for i in range(self.count):
                host = self.name(i)
                self._add(host)
                for path in range(self.paths):
                    port = self.port(i, path)
                    _ip("-n", host, "link", "add", f"eth{path}", "type", "veth", "peer", "name", port, "netns",
                        self.switch)
                    _ip("-n", self.switch, "link", "set", port, "master", f"br{path}", "up")
                    _ip("-n", host, "addr", "add", f"{self.address(i, path)}/24", "dev", f"eth{path}")
                    _ip("-n", host, "link", "set", f"eth{path}", "up")
                _ip("-n", host, "link", "set", "lo", "up")
        except FileNotFoundError:
            self.__exit__()
            raise NamespacesUnavailable("network namespaces need iproute2 (`ip`, `tc`)") from None
        except BaseException:
            self.__exit__()
            raise
        return self

    def _add(self, namespace: str) -> None:
        try:
            _ip("netns", "add", namespace)
        except RuntimeError as exc:
            if "permitted" in str(exc):
                raise NamespacesUnavailable(f"network namespaces cannot be created here ({exc}): run the tests as "
                                            "root with CAP_SYS_ADMIN (CI does)") from None
            raise
        self._made.append(namespace)

    def __exit__(self, *exc: Any) -> None:
        left = []
        for namespace in reversed(self._made):  # deleting a namespace deletes its end of every link
            if subprocess.run(["ip", "netns", "del", namespace], capture_output=True).returncode:
                left.append(namespace)
        self._made.clear()
        if left:
            raise RuntimeError(f"network namespaces left behind (delete with `ip netns del`): {left}")

    def popen(self, i: int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Run ``argv`` in host ``i`` (same files, environment and working directory; its own network)."""
        return subprocess.Popen(["ip", "netns", "exec", self.name(i), *argv], **kwargs)

    def link(self, i: int, up: bool, path: int = 0) -> None:
        """Pull (``up=False``) or plug back host ``i``'s cable of ``path``, at the switch: host ``i`` still sees
        its own interface up, as with a cable cut further along."""
        _ip("-n", self.switch, "link", "set", self.port(i, path), "up" if up else "down")

    def qdisc(self, i: int, *spec: str, path: int = 0) -> None:
        """Shape host ``i``'s switch port of ``path``, towards the host: ``qdisc(1, "tbf", "rate", "300mbit", "burst",
        "64kb", "latency", "400ms")`` limits its rate. (Which qdiscs exist depends on the kernel: ``netem``,
        for loss and delay, is a module some kernels lack.)"""
        result = subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev",
                                 self.port(i, path), "root", *spec], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"tc qdisc {' '.join(spec)} on {self.port(i, path)}: {result.stderr.strip()}")
