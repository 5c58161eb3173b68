"""Hosts for tests of real network faults: Linux network namespaces joined by veth links to one bridge.

Host ``i`` is a namespace with one interface, ``eth0``, at ``10.201.0.(i + 1)/24``; its link's other end is
port ``h{i}`` of a bridge in a namespace of its own (the switch). Taking that port down is a cable pulled;
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
    def __init__(self, count: int) -> None:
        self.count = count
        self.prefix = f"tp{os.getpid()}-{next(_serial)}-{secrets.token_hex(2)}"  # unique, across containers too
        self.switch = f"{self.prefix}-sw"
        self._made: list[str] = []

    def name(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def address(self, i: int) -> str:
        return f"10.201.0.{i + 1}"

    def __enter__(self) -> Hosts:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root: run the tests as root (CI does)")
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.count):
                host = self.name(i)
                self._add(host)
                _ip("-n", host, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up")
                _ip("-n", host, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", host, "link", "set", "eth0", "up")
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

    def link(self, i: int, up: bool) -> None:
        """Pull (``up=False``) or plug back host ``i``'s cable, at the switch: host ``i`` still sees its own
        interface up, as with a cable cut further along."""
        _ip("-n", self.switch, "link", "set", f"h{i}", "up" if up else "down")

    def qdisc(self, i: int, *spec: str) -> None:
        """Shape host ``i``'s switch port, towards the host: ``qdisc(1, "tbf", "rate", "300mbit", "burst",
        "64kb", "latency", "400ms")`` limits its rate. (Which qdiscs exist depends on the kernel: ``netem``,
        for loss and delay, is a module some kernels lack.)"""
        result = subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", f"h{i}", "root",
                                 *spec], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"tc qdisc {' '.join(spec)} on h{i}: {result.stderr.strip()}")
