"""What one audit worker measures on its device, its host and its links; the numbers only, judged elsewhere
(:mod:`~torchpass_plugins.audit.verdict`).

Every rank measures at the same time as the others, as a job would load the cluster: the burn-in runs on every
device at once, and the links are measured a round at a time, every pair of a round exchanging at once
(:func:`pair_rounds`), so that a link that holds up idle but not under load shows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_WINDOW_S = 0.25  # the burn-in's rate is measured over windows this long
_APART_S = 0.05  # between repeats of a measurement (the best counts): a moment the host was busy spoils one


def pair_rounds(world: int) -> list[list[tuple[int, int]]]:
    """Rounds in which every pair of ranks meets once and no rank is in two pairs of a round (the circle
    method: one rank fixed, the others turning around it; with an odd count, one rank sits each round out)."""
    ranks = list(range(world)) + ([None] if world % 2 else [])
    n, rounds = len(ranks), []
    for _ in range(n - 1):
        pairs = [(ranks[i], ranks[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def burn_in(device: torch.device, seconds: float, size: int,
            at_the_end: Callable[[], Any]) -> tuple[float, float, Any]:
    """Matmuls of ``size`` x ``size`` for ``seconds``: the sustained rate (GFLOP/s, the median window), its
    drop (the last third of the windows against the first, 0 when it did not fall), and what ``at_the_end``
    returned, called during the last window, under load."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    rates, end, read = [], time.perf_counter() + seconds, False
    while not read:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < _WINDOW_S:
            torch.mm(a, b)
            count += 1
            if device.type == "cuda" and count % 16 == 0:
                _sync(device)
        if end - time.perf_counter() < _WINDOW_S:  # the last window
            reading, read = at_the_end(), True  # (the queued matmuls keep the device busy meanwhile)
        _sync(device)
        rates.append(2 * size ** 3 * count / (time.perf_counter() - start) / 1e9)
    rates = rates[1:] or rates  # the first window warms up (allocations, caches)
    third = max(1, len(rates) // 3)  # medians: a window the host spent elsewhere is not a trend
    first, last = statistics.median(rates[:third]), statistics.median(rates[-third:])
    return statistics.median(rates), max(0.0, 1 - last / first), reading


def memory_bandwidth(megabytes: int) -> float:
    """The host's copy bandwidth (GB/s, read and write counted): the best of five copies of ``megabytes``,
    apart in time."""
    src = torch.ones(megabytes << 18)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
        time.sleep(_APART_S)
    return 2 * src.numel() * 4 / best / 1e9


def exchange(rank: int, peer: int, nbytes: int, pings: int = 20,
             repeats: int = 3) -> tuple[float, float]:
    """With ``peer``: the round trip of a one-element message (ms, the median of ``pings``), and the bandwidth
    from ``peer`` to this rank (GB/s, the best of ``repeats`` transfers of ``nbytes``). Each direction is
    measured alone (a link's acknowledgements ride the other direction: a slow inbound link would slow the
    outbound transfer too). A degraded link is never fast; a healthy one is, at least once."""
    one = torch.zeros(1)
    trips = []
    for _ in range(pings):
        start = time.perf_counter()
        if rank < peer:
            dist.send(one, peer)
            dist.recv(one, peer)
        else:
            dist.recv(one, peer)
            dist.send(one, peer)
        trips.append((time.perf_counter() - start) * 1e3)
    data = torch.zeros(nbytes // 4)
    best = float("inf")
    for sender in sorted((rank, peer)):
        for _ in range(repeats):
            if rank == sender:
                dist.recv(one, peer)  # the receiver is ready
                dist.send(data, peer)
            else:
                start = time.perf_counter()
                dist.send(one, peer)
                dist.recv(data, peer)
                best = min(best, time.perf_counter() - start)
                time.sleep(_APART_S)
    return statistics.median(trips), nbytes / best / 1e9


def allreduce_bus_bandwidth(nbytes: int, world: int, repeats: int = 5) -> float:
    """The all-reduce bus bandwidth of the whole set (GB/s): size x 2(n-1)/n over the time, the best of
    ``repeats`` (the figure NCCL's tests print, comparable across set sizes)."""
    data = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(data)
        best = min(best, time.perf_counter() - start)
    return nbytes * 2 * (world - 1) / world / best / 1e9
