"""One audit worker, one per device: joins the audit's group, measures with the others, and leaves its numbers
in the store for node 0 (``python -m torchpass_plugins.audit.worker``; the audit of each node starts them)."""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpass_plugins.audit import probes
from torchpass_plugins.health.watch import HealthConfig, HealthThresholds

GROUP_TIMEOUT_S = 300


def result_key(rank: int) -> str:
    return f"audit/result/{rank}"


def _health(source: str, device_index: int) -> dict:
    """This device's reading (under load, right after the burn-in) and its critical findings; where no source
    can read (no NVML here), ``available`` is False and the reason is said."""
    try:
        opened = HealthConfig(source=source, interval_s=1.0).open()
    except ValueError as exc:
        return {"available": False, "why": str(exc)}
    if opened is None:
        return {"available": False, "why": f"health source {source!r}: not available on this machine"}
    try:
        [reading] = opened.read([device_index])
    finally:
        opened.close()
    findings = HealthThresholds().classify(reading)
    return {"available": True, "reading": asdict(reading),
            "critical": [f.why for f in findings if f.severity == "critical"],
            "degraded": [f.why for f in findings if f.severity == "degraded"]}


def measure(options: dict, rank: int, world: int, node: int, local_rank: int) -> dict:
    """Every measurement of this rank, in the same order on every rank (the collectives pair up)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # each worker stands for one device: one core's worth, not every core each
        torch.set_num_threads(1)
    result: dict = {"rank": rank, "node": node, "local_rank": local_rank, "host": socket.gethostname(),
                    "device": str(device)}
    dist.barrier()
    size = options["matmul_size"] or (4096 if cuda else 256)
    rate, drop = probes.burn_in(device, options["duration"], size)
    result["compute_gflops"], result["compute_drop"] = rate, drop
    result["health"] = _health(options["health_source"], local_rank)
    dist.barrier()
    if local_rank == 0:  # one per host: the copies of several would share its memory bandwidth
        result["memory_gbps"] = probes.memory_bandwidth(options["memory_mb"])
    dist.barrier()
    nbytes = options["message_mb"] << 20
    result["links"] = {}
    for round_ in probes.pair_rounds(world):
        for a, b in round_:
            if rank in (a, b):
                peer = b if rank == a else a
                latency, bandwidth = probes.exchange(rank, peer, device, nbytes)
                result["links"][str(peer)] = {"latency_ms": latency, "gbps_from_peer": bandwidth}
        dist.barrier()
    result["allreduce_busbw_gbps"] = probes.allreduce_bus_bandwidth(device, nbytes, world)
    return result


def main() -> int:
    host, port, rank, world, node, local_rank = sys.argv[1:7]
    options = json.loads(sys.argv[7])
    rank, world, local_rank = int(rank), int(world), int(local_rank)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore("audit/group", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = measure(options, rank, world, int(node), local_rank)
    except Exception as exc:  # said in the audit's verdict, named by rank
        result = {"rank": rank, "node": int(node), "local_rank": local_rank, "host": socket.gethostname(),
                  "error": f"{type(exc).__name__}: {exc}"}
    store.set(result_key(rank), json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
