"""Part (e) of the GPU check: NCCL with surviving peers, which takes two or more GPUs (one NCCL rank each).

- Kill and hang matrix: ``torchpass launch`` jobs of the demo, 2 active ranks + 1 spare on NCCL with
  deterministic algorithms, every rank's full state compared with a failure-free run, every step applied
  once on every rank (zero rollback). The spare's slot is 2, so on 2 GPUs it shares GPU 0 and takes over
  rank 0 (the rank on GPU 0); with 3 or more GPUs rank 1 is struck too. ``stop`` is a hang the agent's
  heartbeat check ends; ``stall`` keeps the heartbeat, so NCCL's own timeout (the collective timeout)
  fails the survivors' collective.
- Group mechanics, two processes driving :class:`~torchpass_plugins.core.process_group.ReconfigurableGroup`
  directly: what a new generation costs (abort of the old communicator, build and connect of the new one,
  a first all-reduce), how long aborting a communicator takes while one of its collectives is stuck on a
  peer that never joins (against the abort deadline), and whether the next generation then works; the
  state a spare receives (``send_state``: device -> host, gloo) against raw NCCL device-to-device sends
  of the same tensors.
- Step time: ``torchpass_ddp`` / Lightning ``ddp`` and ``torchpass_fsdp`` / FSDP2 on 2 GPUs
  (``benchmarks/overhead.py``'s runs with ``--accelerator gpu``), alternated.

``gpu_check.py --on-cpu`` runs the matrix's first case and the group mechanics on CPU tensors over gloo
(gloo groups are abandoned rather than aborted), to check this script where no GPU is.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import REPO

STEPS = 16
SPARE_SLOT = 2


def _device_args(on_cpu: bool) -> tuple[str, ...]:
    if on_cpu:
        return ("--accelerator", "cpu", "--process-group-backend", "gloo")
    return ("--accelerator", "gpu", "--deterministic", "--process-group-backend", "nccl")


def matrix_cases(gpus: int, on_cpu: bool) -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """(label, faults, extra launch flags, extra demo flags) of each case this machine can run."""
    quick = ("--heartbeat-timeout", "5")
    cases = [
        ("kill rank 0 in backward", "kill@rank=0,step=7,phase=backward", (), ()),
        ("kill rank 0 with its gradient all-reduce in flight", "kill@rank=0,step=7,phase=reduce", (), ()),
        ("kill rank 0 before the commit", "kill@rank=0,step=7,phase=commit", (), ()),
        ("hang rank 0 (SIGSTOP) in its all-reduce", "stop@rank=0,step=7,phase=reduce", quick, ()),
        ("stall rank 0 (heartbeat alive): NCCL's timeout", "stall@rank=0,step=7,phase=backward", quick,
         ("--collective-timeout", "20")),
    ]
    if gpus >= SPARE_SLOT + 1:  # the spare has a GPU of its own: any rank can be replaced
        cases.append(("kill rank 1 with its gradient all-reduce in flight", "kill@rank=1,step=7,phase=reduce", (), ()))
    return cases[:1] if on_cpu else cases


def kill_hang_matrix(work: Path, gpus: int, on_cpu: bool, run_job, compare) -> list[str]:
    args = (*_device_args(on_cpu), "--devices", "2", "--num-nodes", "1", "--max-steps", str(STEPS), "--workers", "0")
    expected = run_job(work / "e-reference", 2, 0, args)
    rows = []
    for i, (label, faults, launch, extra) in enumerate(matrix_cases(gpus, on_cpu)):
        try:
            job = run_job(work / f"e-case{i}", 3, 1, (*args, *extra), faults=faults, launch=launch)
        except Exception as exc:
            rows.append(f"(e) NCCL, 2 ranks + 1 spare: {label} | FAILED: {str(exc).splitlines()[0][:300]}")
            continue
        once = all(job.applied(r) == list(range(STEPS)) for r in range(2))
        recovered = [e["seconds"] for e in job.events("recovered")]
        restarts = len(job.events("job_restart"))
        rows.append(f"(e) NCCL, 2 ranks + 1 spare: {label} | {compare(expected, job, 2)}; every step applied once "
                    f"on every rank: {'yes' if once else 'no'}; recovery {max(recovered, default=float('nan')):.2f} s; "
                    f"restarts: {restarts}")
    return rows


# -- group mechanics: two processes, this file run with --worker ------------------------------------------
def group_mechanics(work: Path, on_cpu: bool, megabytes: int) -> list[str]:
    from torchpass_plugins.control.membership import connect_store

    work.mkdir(parents=True, exist_ok=True)
    master = connect_store("127.0.0.1:0", is_master=True, timeout=120)
    device = "cpu" if on_cpu else "cuda"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), f"127.0.0.1:{master.port}", device,
                               str(megabytes), str(work / f"mechanics{rank}.json")],
                              stdout=open(work / f"mechanics{rank}.log", "wb"), stderr=subprocess.STDOUT, env=env)
             for rank in range(2)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        logs = "\n".join((work / f"mechanics{r}.log").read_text(errors="replace")[-1500:] for r in range(2))
        raise RuntimeError(f"group mechanics: exit {codes}\n{logs}")
    r0, r1 = (json.loads((work / f"mechanics{r}.json").read_text()) for r in range(2))
    name = "gloo" if on_cpu else "NCCL"
    ratio = r1["torchpass_s"] / r1["raw_s"]
    return [
        f"(e) {name}: a new generation (abort old, build + connect new, first all-reduce), {len(r0['rebuild_s'])} "
        f"times | median {statistics.median(r0['rebuild_s']) * 1e3:.0f} ms (max "
        f"{max(r0['rebuild_s']) * 1e3:.0f} ms); the first one, with backend start-up: {r0['first_s'] * 1e3:.0f} ms",
        f"(e) {name}: abort with a collective stuck on a peer that never joins | the collective was still pending: "
        f"{'yes' if r0['hung'] else 'no'}; abort returned in {r0['abort_s'] * 1e3:.0f} ms (deadline "
        f"{r0['deadline_s']:.0f} s{'; gloo groups are abandoned, not aborted' if on_cpu else ''}); the next "
        f"generation works: {'yes' if r0['after'] and r1['after'] else 'no'}",
        f"(e) state to a spare, {r1['bytes'] / 2**20:.0f} MiB in {r1['tensors']} tensors | torchpass (staged through "
        f"host, gloo) {r1['torchpass_s']:.3f} s, raw {name} sends {r1['raw_s']:.3f} s: torchpass / raw = "
        f"{ratio:.2f}; received bit-exact: {'yes' if r1['exact'] else 'no'}",
    ]


def _worker(rank: int, endpoint: str, device_type: str, megabytes: int, out: str) -> None:
    from torchpass_plugins.control.membership import Member
    from torchpass_plugins.control.worker_env import WorkerEnv
    from torchpass_plugins.core import backends
    from torchpass_plugins.core.backends import GlooBackend, NcclBackend, prepare_nccl, slot_gpu
    from torchpass_plugins.core.process_group import ReconfigurableGroup
    from torchpass_plugins.core.state_transfer import recv_state, send_state

    env = WorkerEnv(store=endpoint, token="gpu-check", worker_id=f"w{rank}", world_size=2, node_rank=0,
                    local_slot=rank, run_dir="", seed=0, heartbeat_interval=0.5)
    member = Member(env)
    group = ReconfigurableGroup(member, timedelta(seconds=60), name="mechanics")
    if device_type == "cuda":
        device = slot_gpu(rank)
        torch.cuda.set_device(device)
        prepare_nccl()
        backend = NcclBackend(device)
        group.use_backend(backend)
    else:
        device, backend = torch.device("cpu"), GlooBackend()

    def settle() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def both_reached(mark: str) -> None:
        member.store.set(f"{mark}/{rank}", b"1")
        member.store.wait([f"{mark}/{1 - rank}"])

    result: dict = {"deadline_s": backends.ABORT_DEADLINE_S}
    times = []
    for gen in range(6):
        t0 = time.perf_counter()
        group.configure(gen, rank)
        group.all_reduce(torch.ones(1, device=device))
        settle()
        times.append(time.perf_counter() - t0)
    result["first_s"], result["rebuild_s"] = times[0], times[1:]

    group.configure(10, rank)
    if rank == 0:
        stuck = group.allreduce([torch.ones(1, device=device)])  # rank 1 never joins it
        group.track(stuck)  # pending: the replaced group must stay alive until it ends
        time.sleep(1.0)
        result["hung"] = not stuck.is_completed()
        t0 = time.perf_counter()
        group.abort()
        result["abort_s"] = time.perf_counter() - t0
        both_reached("aborted")
    else:
        both_reached("aborted")
        group.abort()
    group.configure(11, rank)
    probe = torch.ones(1, device=device)
    group.all_reduce(probe)
    result["after"] = float(probe.item()) == 2.0

    group.configure(12, rank)
    generator = torch.Generator(device="cpu").manual_seed(0)
    count = 8
    numel = megabytes * 2**20 // 4 // count
    state = {f"layer{i}": torch.randn(numel, generator=generator).to(device) for i in range(count)}
    raw = backend.build(dist.PrefixStore("raw", member.thread_store()), rank, 2, timedelta(seconds=60))
    torchpass_s, raw_s, exact = [], [], True
    for _ in range(3):
        both_reached(f"transfer{len(torchpass_s)}")
        t0 = time.perf_counter()
        if rank == 0:
            send_state(group, state, 1)
        else:
            got, _ = recv_state(group, 0)
            exact = exact and all(torch.equal(got[k], state[k].cpu()) for k in state)
        settle()
        torchpass_s.append(time.perf_counter() - t0)
        landing = [torch.empty_like(t) for t in state.values()]
        both_reached(f"raw{len(raw_s)}")
        t0 = time.perf_counter()
        works = [raw.send([t], 1, 0) if rank == 0 else raw.recv([t], 0, 0)
                 for t in (state.values() if rank == 0 else landing)]
        for w in works:
            w.wait()
        settle()
        raw_s.append(time.perf_counter() - t0)
        if rank == 1:
            exact = exact and all(torch.equal(a, b) for a, b in zip(landing, state.values(), strict=True))
    result.update(torchpass_s=statistics.median(torchpass_s), raw_s=statistics.median(raw_s), exact=exact,
                  bytes=sum(t.numel() * t.element_size() for t in state.values()), tensors=count)
    both_reached("done")
    Path(out).write_text(json.dumps(result))
    if device.type == "cuda":
        raw.abort()
    group.abort()


# -- step time against the plain strategies on GPUs -----------------------------------------------------------
def step_times(work: Path, reps: int = 2) -> list[str]:
    import overhead

    rows = []
    for mine, *_, plain in overhead.PAIRS.values():
        ratios, medians = [], {mine: [], plain: []}
        for rep in range(reps):
            order = (mine, plain) if rep % 2 == 0 else (plain, mine)
            results = {s: overhead.run_once(overhead.SMALL, s, 2, work / f"e-steps-{s}-{rep}", rep,
                                            extra=("--accelerator", "gpu")) for s in order}
            ratios.append(results[mine].median_ms / results[plain].median_ms)
            for s, r in results.items():
                medians[s].append(r.median_ms)
        rows.append(f"(e) step time, 2 GPUs, {overhead.SMALL.params:,}-parameter MLP, {reps} alternated runs each | "
                    f"`{mine}` {statistics.median(medians[mine]):.2f} ms, `{plain}` "
                    f"{statistics.median(medians[plain]):.2f} ms: ratio {statistics.median(ratios):.3f} "
                    f"(runs {', '.join(f'{r:.3f}' for r in ratios)})")
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
