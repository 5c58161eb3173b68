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


def _open_health(source: str):
    """The health watch's source (opened before the burn-in: NVML counts the XIDs raised from then on), or
    why there is none (no NVML here, or ``off``)."""
    try:
        opened = HealthConfig(source=source, interval_s=1.0).open()
    except ValueError as exc:
        return None, str(exc)
    return opened, (None if opened is not None else
                    "turned off (--health-source off)" if source == "off" else f"{source}: not available here")


def _health(opened, why: str | None, device_index: int) -> dict:
    """This device's reading and its findings, critical or degraded."""
    if opened is None:
        return {"available": False, "why": why}
    [reading] = opened.read([device_index])
    findings = HealthThresholds().classify(reading)
    return {"available": True, "reading": asdict(reading),
            "critical": [f.why for f in findings if f.severity == "critical"],
            "degraded": [f.why for f in findings if f.severity == "degraded"]}


def _barrier() -> None:
    """Between the phases: a rank that does not arrive is named (on rank 0), not waited for in silence."""
    dist.monitored_barrier(timeout=timedelta(seconds=GROUP_TIMEOUT_S), wait_all_ranks=True)


def measure(options: dict, rank: int, world: int, local_rank: int, result: dict) -> None:
    """Every measurement of this rank, into ``result`` as it goes (a failure keeps what came before), in the
    same order on every rank (the collectives pair up). The links and the all-reduce run on host memory over
    gloo (TCP): gloo sends no CUDA tensors."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    threads = torch.get_num_threads()
    if cuda:
        torch.cuda.set_device(device)
    else:  # each worker stands for one device: one core's worth, not every core each
        torch.set_num_threads(1)
    result["device"] = str(device)
    health, why = _open_health(options["health_source"])
    _barrier()
    size = options["matmul_size"] or (4096 if cuda else 256)
    try:  # the reading is taken in the burn-in's last window, under load
        rate, drop, reading = probes.burn_in(device, options["duration"], size,
                                             at_the_end=lambda: _health(health, why, local_rank))
    finally:
        if health is not None:
            health.close()
    result.update(compute_gflops=rate, compute_drop=drop, health=reading)
    _barrier()
    if local_rank == 0:  # one per host, every host at once, with all of its cores
        torch.set_num_threads(threads)
        result["memory_gbps"] = probes.memory_bandwidth(options["memory_mb"])
        torch.set_num_threads(1 if not cuda else threads)
    _barrier()
    nbytes = options["message_mb"] << 20
    result["links"] = {}
    for round_ in probes.pair_rounds(world):
        for a, b in round_:
            if rank in (a, b):
                peer = b if rank == a else a
                latency, bandwidth = probes.exchange(rank, peer, nbytes)
                result["links"][str(peer)] = {"latency_ms": latency, "gbps_from_peer": bandwidth}
        _barrier()
    result["allreduce_busbw_gbps"] = probes.allreduce_bus_bandwidth(nbytes, world)


def main() -> int:
    host, port, rank, world, node, local_rank = sys.argv[1:7]
    options = json.loads(sys.argv[7])
    rank, world, local_rank = int(rank), int(world), int(local_rank)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore("audit/group", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    result = {"rank": rank, "node": int(node), "local_rank": local_rank, "host": socket.gethostname()}
    try:
        measure(options, rank, world, local_rank, result)
    except Exception as exc:  # said in the audit's verdict, named by rank, with what was measured before
        result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    store.set(result_key(rank), json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
