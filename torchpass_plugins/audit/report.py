"""An audit's report: a table in the terminal, ``audit.json`` (what ``--baseline`` reads back), and two PNGs,
the bandwidth of every link as a heatmap and every device's compute rate against the median."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.table import Table

from torchpass_plugins.observe.report import wide_console


def write_report(audit: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(audit, indent=1))
    burnt = [r for r in audit["results"] if "compute_gflops" in r]
    if burnt:
        _heatmap(audit["results"], out / "bandwidth.png")
        _compute(burnt, out / "compute.png")
    _print(audit, out)


def _spread(values: list[float], extreme: str = "min") -> str:
    if not values:
        return "not measured"
    far = min(values) if extreme == "min" else max(values)
    return f"median {statistics.median(values):.3g}, {extreme} {far:.3g}"


def _print(audit: dict, out: Path) -> None:
    console = wide_console()
    results = audit["results"]
    table = Table(title=f"torchpass audit: {audit['nodes']} node(s) x {audit['workers_per_node']} device(s)")
    for column in ("check", "measured"):
        table.add_column(column)
    links = [link for r in results for link in r.get("links", {}).values()]
    table.add_row("compute (GFLOP/s per device, burn-in)", _spread([r["compute_gflops"] for r in results
                                                                     if "compute_gflops" in r]))
    table.add_row("host memory copy (GB/s per node)", _spread([r["memory_gbps"] for r in results
                                                                if "memory_gbps" in r]))
    table.add_row("links, under concurrent load (GB/s)", _spread([link["gbps_from_peer"] for link in links]))
    table.add_row("links, round trip (ms)", _spread([link["latency_ms"] for link in links], "max"))
    allreduce = audit["figures"].get("allreduce|all ranks")
    table.add_row("all-reduce bus bandwidth (GB/s)", "not measured" if allreduce is None else f"{allreduce:.3g}")
    health = [r["health"] for r in results if "health" in r]
    table.add_row("device health", "not measured" if not health else
                  f"not available: {health[0]['why']}" if not health[0]["available"] else
                  f"{sum(len(h['critical']) for h in health)} critical, "
                  f"{sum(len(h['degraded']) for h in health)} degraded reading(s)")
    drill = audit["drill"]
    table.add_row("live drill (a worker SIGKILLed, a spare in its place)", "skipped (--no-drill)" if drill is None else
                  f"bit-exact on every rank: {'yes' if drill['bit_exact'] else 'no'}; every step applied once: "
                  f"{'yes' if drill['applied_once'] else 'no'}; regain {drill['regain_s']:.2f} s")
    console.print(table)
    if audit["findings"]:
        failed = Table(title="Failed", title_style="bold red")
        for column in ("check", "part", "why"):
            failed.add_column(column)
        for f in audit["findings"]:
            failed.add_row(f["check"], f["part"], f["why"])
        console.print(failed)
        for node, why in sorted(audit["blamed_nodes"].items()):
            console.print(f"[red]node {node}[/]: {why}")
    console.print(("[green]passed" if audit["passed"] else "[red]FAILED") +
                  f"[/]: {out / 'audit.json'}, {out / 'bandwidth.png'}, {out / 'compute.png'}")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _heatmap(results: list[dict], path: Path) -> None:
    plt = _pyplot()
    world = max(r["rank"] for r in results) + 1
    grid = [[float("nan")] * world for _ in range(world)]
    for r in results:
        for peer, link in r.get("links", {}).items():
            grid[int(peer)][r["rank"]] = link["gbps_from_peer"]
    fig, ax = plt.subplots(figsize=(2 + 0.5 * world, 1.5 + 0.5 * world))
    image = ax.imshow(grid, cmap="viridis")
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.set_title("link bandwidth under load (GB/s)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _compute(measured: list[dict], path: Path) -> None:
    plt = _pyplot()
    names = [f"n{r['node']}d{r['local_rank']}" for r in measured]
    rates = [r["compute_gflops"] for r in measured]
    fig, ax = plt.subplots(figsize=(2 + 0.4 * len(names), 3))
    ax.bar(names, rates)
    ax.axhline(statistics.median(rates), color="black", linestyle="--", label="median")
    ax.set_ylabel("GFLOP/s (burn-in)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
