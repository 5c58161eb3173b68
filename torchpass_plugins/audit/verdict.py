"""What an audit's measurements say: pure functions over the numbers, so every threshold is tested in-process.

A part is judged against its peers measured in the same run (the median of the others, not a datasheet):
what a cluster of one kind can do is what most of its parts do. A device computing far slower than the
others, a link carrying far less, or answering far later, is an outlier; so is a part worse than the same
part in a baseline run (``--baseline``: an earlier good audit of this cluster), and any critical health
reading. Each finding names the part, the value, the value it was held against, and why it failed.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

# A device's sustained matmul rate under 60% of its peers' median, or one whose rate fell during the burn-in by
# 25 points more than theirs (throttling under load); host memory bandwidth under 50% of the other nodes'.
COMPUTE_RATIO, COMPUTE_DROP, MEMORY_RATIO = 0.6, 0.25, 0.5
# A link carrying under 30% of the median link's bandwidth, or answering over 5 times later plus 1 ms. Links
# within a node and between nodes are held against their own kind.
BANDWIDTH_RATIO, LATENCY_FACTOR, LATENCY_FLOOR_MS = 0.3, 5.0, 1.0
BASELINE_RATIO = 0.7  # worse than 70% of the baseline's value for the same part


@dataclass(frozen=True)
class Finding:
    check: str  # "compute", "compute drop", "memory", "bandwidth", "latency", "health", "drill", "baseline"
    part: str  # "node 1 device 0", "link 0->2", "node 2", ...
    value: float | None
    expected: float | None  # the peers' median (or the baseline's value, or the limit)
    why: str

    def as_dict(self) -> dict:
        return asdict(self)


def _others_median(values: dict, key) -> float | None:
    """The median of the other parts, where there are at least two: against one other, no part can be told
    the odd one out (two devices that differ: which is slow?)."""
    others = [v for k, v in values.items() if k != key]
    return statistics.median(others) if len(others) >= 2 else None


def _against_peers(values: dict[str, float], fails: Callable[[float, float], bool], check: str,
                   why: Callable[[float, float], str]) -> list[Finding]:
    """The parts whose value ``fails`` against the median of the others (where there are two or more)."""
    found = []
    for part, value in values.items():
        median = _others_median(values, part)
        if median is not None and fails(value, median):
            found.append(Finding(check, part, value, median, why(value, median)))
    return found


def low_outliers(values: dict[str, float], ratio: float, check: str, unit: str) -> list[Finding]:
    """The parts whose value is under ``ratio`` times the median of the others."""
    return _against_peers(values, lambda v, m: v < ratio * m, check, lambda v, m: (
        f"{v:.3g} {unit}, under {ratio:.0%} of the others' median ({m:.3g} {unit})"))


def high_outliers(values: dict[str, float], factor: float, floor: float, check: str, unit: str) -> list[Finding]:
    """The parts whose value is over ``factor`` times the median of the others, plus ``floor``."""
    return _against_peers(values, lambda v, m: v > factor * m + floor, check, lambda v, m: (
        f"{v:.3g} {unit}, over {factor:g}x the others' median ({m:.3g} {unit}) + {floor:g}"))


def compute_findings(rates: dict[str, float], drops: dict[str, float], tolerance: float = 1.0) -> list[Finding]:
    """Devices: ``rates`` (GFLOP/s sustained) and ``drops`` (the burn-in's last third against its first).
    ``tolerance`` loosens every limit (ratios divided by it, margins multiplied): a shared, busy machine."""
    points = COMPUTE_DROP * tolerance
    return low_outliers(rates, COMPUTE_RATIO / tolerance, "compute", "GFLOP/s") + _against_peers(
        drops, lambda d, m: d > m + points, "compute drop", lambda d, m: (
            f"its rate fell by {d:.0%} during the burn-in, the others' by {m:.0%} (median): throttling under load"))


def link_findings(bandwidth: dict[tuple[int, int], float], latency: dict[tuple[int, int], float],
                  node_of: dict[int, int], tolerance: float = 1.0) -> list[Finding]:
    """Links between ranks: ``bandwidth`` (GB/s, per direction src -> dst) and ``latency`` (round trip, ms, per
    pair), each held against the other links of its kind (within a node, or between nodes)."""
    found = []
    for within in (True, False):
        def kind(pair: tuple[int, int], within: bool = within) -> bool:
            return (node_of[pair[0]] == node_of[pair[1]]) == within

        found += low_outliers({f"link {a}->{b}": v for (a, b), v in bandwidth.items() if kind((a, b))},
                              BANDWIDTH_RATIO / tolerance, "bandwidth", "GB/s")
        found += high_outliers({f"link {a}<->{b}": v for (a, b), v in latency.items() if kind((a, b))},
                               LATENCY_FACTOR * tolerance, LATENCY_FLOOR_MS * tolerance, "latency", "ms")
    return found


def culprit_nodes(findings: list[Finding], node_of: dict[int, int], nodes: int) -> dict[int, str]:
    """The nodes the findings blame, each with why. A device, a node's memory, a health reading or a worker
    blames its node. A slow link blames whichever of its two nodes has more slow links (its NIC, cable or
    switch port; with two nodes, or as many on each side, both)."""
    blamed: dict[int, str] = {}
    links = []
    for f in findings:
        if f.part.startswith("link "):
            a, b = (node_of[int(e)] for e in f.part[len("link "):].replace("<->", "->").split("->"))
            links.append((f, a, b))
        elif f.part.startswith("node "):
            blamed.setdefault(int(f.part.split()[1]), f"{f.check}: {f.why}")
    bad = Counter(node for _, a, b in links for node in {a, b})
    for f, a, b in links:
        ends = [a, b] if bad[a] == bad[b] or nodes <= 2 else [a if bad[a] > bad[b] else b]
        for node in ends:
            blamed.setdefault(node, f"{f.check} of {f.part}: {f.why}")
    return blamed


# Whether more is better, per check: a baseline is worse when its figure drops (or, for latency, rises).
HIGHER_IS_BETTER = {"compute": True, "memory": True, "bandwidth": True, "latency": False, "allreduce": True}


def baseline_findings(now: dict[str, float], before: dict[str, float], tolerance: float = 1.0) -> list[Finding]:
    """Parts worse than in the baseline run: under :data:`BASELINE_RATIO` of its figure, or for latency over
    its figure divided by that ratio plus :data:`LATENCY_FLOOR_MS` (keys: ``check|part``)."""
    found = []
    for key, value in now.items():
        old = before.get(key)
        if not old:
            continue
        check, part = key.split("|", 1)
        ratio = BASELINE_RATIO / tolerance
        worse = value < ratio * old if HIGHER_IS_BETTER[check] else value > old / ratio + LATENCY_FLOOR_MS * tolerance
        if worse:
            found.append(Finding("baseline", part, value, old, f"{check} {value:.3g}, against {old:.3g} in the "
                                 "baseline run"))
    return found
