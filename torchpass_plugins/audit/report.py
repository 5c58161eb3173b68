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
    measured = [r for r in audit["results"] if "error" not in r]
    if measured:
        _heatmap(measured, out / "bandwidth.png")
        _compute(measured, out / "compute.png")
    _print(audit, out)


def _print(audit: dict, out: Path) -> None:
    console = wide_console()
    measured = [r for r in audit["results"] if "error" not in r]
    table = Table(title=f"torchpass audit: {audit['nodes']} node(s) x {audit['workers_per_node']} device(s)")
    for column in ("check", "measured"):
        table.add_column(column)
    if measured:
        rates = [r["compute_gflops"] for r in measured]
        table.add_row("compute (GFLOP/s per device, burn-in)", f"median {statistics.median(rates):.3g}, "
                      f"min {min(rates):.3g}, max {max(rates):.3g}")
        memory = [r["memory_gbps"] for r in measured if "memory_gbps" in r]
        table.add_row("host memory copy (GB/s per node)", f"median {statistics.median(memory):.3g}")
        links = [link["gbps_from_peer"] for r in measured for link in r["links"].values()]
        trips = [link["latency_ms"] for r in measured for link in r["links"].values()]
        if links:
            table.add_row("links, under concurrent load (GB/s)", f"median {statistics.median(links):.3g}, "
                          f"min {min(links):.3g}")
            table.add_row("links, round trip (ms)", f"median {statistics.median(trips):.3g}, max {max(trips):.3g}")
        table.add_row("all-reduce bus bandwidth (GB/s)", f"{audit['figures'].get('allreduce|all ranks', 0):.3g}")
        health = [r["health"] for r in measured]
        table.add_row("device health", "not available: " + health[0]["why"] if not health[0]["available"] else
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


def _heatmap(measured: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = max(r["rank"] for r in measured) + 1
    grid = [[float("nan")] * world for _ in range(world)]
    for r in measured:
        for peer, link in r["links"].items():
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
