"""Publishing weights to rollout replicas: what it costs the trainer, how fast a version arrives, and how
stale the replicas are.

- *Stall*: ``torchpass_ddp`` on ``STEADY_RANKS`` pinned ranks publishing every step to two follower
  processes, publishing to none, and not publishing, runs alternating. Per publication, the training
  loop's stall (the ``stall_s`` of each ``weights_published`` event: starting the copy into host memory
  and its fence before the optimizer step) over the median step time of the job without publishing; and
  the jobs' median step times side by side, which also carry what the background copy, the sends and the
  followers themselves take from the machine's cores.
- *Staleness*: in those jobs, for each version a follower received, how many newer versions rank 0 had
  published by then (a follower that falls behind skips to the newest).
- *Latency*: in one process, the time from ``publish`` to a subscriber process holding the version whole,
  on each path: over TCP (copy, checksum, send, receive, checksum), against a raw copy of the same bytes
  into host memory and a raw send to a process that receives them into a buffer; and through the
  publisher's mapped copy (copy, copy out), against a raw copy into shared memory that a process copies
  out of: each the same transfer without versions, checks or holds. Each transfer starts half a second
  after the receiver asked for it, as a replica waits for the next version.

Run ``python benchmarks/weight_push.py`` (full) or ``--smoke`` (tiny, checks the pipeline only).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _harness import (
    STEADY_NOTE,
    STEADY_RANKS,
    MLPSize,
    RunFailed,
    bench_args,
    command_line,
    free_port,
    fresh_work_root,
    in_turn,
    install_cleanup,
    machine,
    machine_lines,
    median_ci,
    publish,
    read_events,
    read_steps,
    run_bounded,
    tail,
    torchpass_cmd,
    worker_env,
)

from torchpass_plugins.core.peer_memory import Segment, SegmentId, map_peer
from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.weights import WeightPublisher, WeightSubscriber, wire

TOKEN = "weight-push-benchmark"
FOLLOWERS = 2


@dataclass(frozen=True)
class Size(MLPSize):
    name: str
    steps: int
    warmup: int


SIZES = (Size(features=1024, hidden=1024, depth=4, classes=10, batch_size=64, reps=3, timeout_s=600, name="small",
              steps=60, warmup=10),
         Size(features=1024, hidden=4096, depth=7, classes=10, batch_size=64, reps=3, timeout_s=900, name="~105M",
              steps=16, warmup=4))
SMOKE = (Size(features=32, hidden=64, depth=2, classes=4, batch_size=8, reps=1, timeout_s=240, name="tiny", steps=12,
              warmup=4),)


@dataclass
class Job:
    step_ms: float
    stall_ms: list[float]
    staleness: list[int]
    published: int
    received: int


CONTENDERS = (FOLLOWERS, 0, None)  # followers of a job that publishes; None: it does not publish


def train(size: Size, work: Path, followers: int | None) -> Job:
    out, run_dir = work / "out", work / "run"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    args = ["--strategy", "torchpass_ddp", "--devices", str(STEADY_RANKS), "--max-steps", str(size.steps),
            *size.model_args(), "--out", str(out), "--pin",
            *(["--publish-weights", endpoint] if followers is not None else [])]
    env = {**worker_env(steady=True), wire.TOKEN_VARIABLE: TOKEN}
    replicas = [subprocess.Popen([sys.executable, __file__, "_follow", endpoint, str(run_dir / "events.jsonl"),
                                   str(i)], env=env, stdout=subprocess.PIPE, text=True) for i in range(followers or 0)]
    try:
        for replica in replicas:  # (a small model's job can end before a follower has imported torch)
            assert replica.stdout.readline().strip() == "following"
        code = run_bounded(torchpass_cmd(STEADY_RANKS, 0, run_dir, args), env, size.timeout_s, work / "launcher.log")
    finally:
        for replica in replicas:
            replica.kill()
            replica.wait()
    if code != 0:
        raise RunFailed(f"{size.name} followers={followers}: launcher exited {code}\n{tail(work / 'launcher.log')}")
    perf = {step: p for step, _, p, _ in read_steps(out).get(0, [])}
    if len(perf) != size.steps:
        raise RunFailed(f"rank 0 recorded {len(perf)} steps, expected {size.steps}")
    step_ms = statistics.median((perf[k] - perf[k - 1]) * 1e3 for k in range(size.warmup + 1, size.steps))
    events = read_events(run_dir)
    published = sorted((e["time"], e["version"]) for e in events if e["event"] == "weights_published")
    received = [(e["time"], e["version"]) for e in events if e["event"] == "weights_received"]
    staleness = [max(v for t, v in published if t <= when) - version for when, version in received]
    stall_ms = [e["stall_s"] * 1e3 for e in events if e["event"] == "weights_published" and e["version"] > size.warmup]
    if followers is not None and (not stall_ms or (followers and not received)):
        raise RunFailed(f"{size.name}: {len(stall_ms)} publications, {len(received)} receptions")
    return Job(step_ms, stall_ms, staleness, len(published), len(received))


def follow(endpoint: str, events: str, index: str) -> None:
    """A follower: receive newer versions until the job ends (which kills it). Patient: the first step of the
    larger model alone takes several seconds."""
    subscriber = WeightSubscriber(endpoint, token=TOKEN, retry_s=0.05, events=EventLog(events, f"replica{index}"))
    print("following", flush=True)
    version = -1
    while True:
        version, _ = subscriber.wait_newer(version, timeout=600)


PATHS = ("tcp", "shared_memory")
SETTLE_S = 0.5


def latency(nbytes: int, reps: int, path: str) -> tuple[list[float], list[float]]:
    """Seconds from ``publish`` to a subscriber process holding the version whole on ``path``, and from the
    start of a raw copy to a raw receiver holding the same bytes; ``reps`` of each, in turn."""
    source = {"weights": torch.randn(nbytes // 4)}
    raw_transfer = _RawSend(nbytes) if path == "tcp" else _RawMapped(nbytes)
    published, raw = [], []
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN) as publisher:
        subscriber = subprocess.Popen([sys.executable, __file__, "_subscribe", publisher.endpoint, path],
                                      stdout=subprocess.PIPE, text=True)
        try:
            for version in range(reps + 1):  # version 0 warms both paths up
                assert subscriber.stdout.readline().strip() == f"waiting {version - 1}"
                time.sleep(SETTLE_S)  # both receivers are waiting, as a replica does for the next version
                started = time.monotonic()
                publisher.publish(source, version)
                done = float(subscriber.stdout.readline())
                time.sleep(SETTLE_S)
                started_raw = time.monotonic()
                done_raw = raw_transfer.transfer(source["weights"].view(torch.uint8))
                if version:
                    published.append(done - started)
                    raw.append(done_raw - started_raw)
        finally:
            subscriber.kill()
            raw_transfer.close()
    return published, raw


class _RawSend:
    """A copy into host memory sent over TCP to a process that receives it into a buffer of its own."""

    def __init__(self, nbytes: int) -> None:
        self.receiver = subprocess.Popen([sys.executable, __file__, "_receive_raw"], stdout=subprocess.PIPE, text=True)
        self.sock = socket.create_connection(("127.0.0.1", int(self.receiver.stdout.readline())))
        self.staging = torch.empty(nbytes, dtype=torch.uint8)

    def transfer(self, source: torch.Tensor) -> float:
        self.staging.copy_(source)
        self.sock.sendall(self.staging.numel().to_bytes(8, "little"))
        self.sock.sendall(memoryview(self.staging.numpy()))
        return float(self.receiver.stdout.readline())

    def close(self) -> None:
        self.sock.close()
        self.receiver.kill()


class _RawMapped:
    """A copy into shared memory that a process, told through a pipe, copies out into a buffer of its own."""

    def __init__(self, nbytes: int) -> None:
        self.segment = Segment(nbytes)
        self.receiver = subprocess.Popen([sys.executable, __file__, "_copy_out", json.dumps(self.segment.id.to_list()),
                                          str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def transfer(self, source: torch.Tensor) -> float:
        self.segment.tensor.copy_(source)
        self.receiver.stdin.write("go\n")
        self.receiver.stdin.flush()
        return float(self.receiver.stdout.readline())

    def close(self) -> None:
        self.receiver.kill()
        self.segment.close()


def copy_out(segment: str, nbytes: str) -> None:
    mapped = map_peer(SegmentId(*json.loads(segment)), int(nbytes))
    for _ in sys.stdin:
        torch.empty(int(nbytes), dtype=torch.uint8).copy_(mapped)
        print(time.monotonic(), flush=True)


def subscribe(endpoint: str, path: str) -> None:
    subscriber = WeightSubscriber(endpoint, token=TOKEN, shared_memory=path == "shared_memory")
    version = -1
    while True:
        print(f"waiting {version}", flush=True)
        version, _ = subscriber.wait_newer(version, timeout=120)
        print(time.monotonic(), flush=True)


def receive_raw() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    sock, _ = listener.accept()
    lines = wire.Lines(sock)
    while True:
        size = bytearray(8)
        lines.receive_into(memoryview(size))
        buffer = torch.empty(int.from_bytes(size, "little"), dtype=torch.uint8)
        lines.receive_into(memoryview(buffer.numpy()))
        print(time.monotonic(), flush=True)


def render(sizes: tuple[Size, ...], jobs: dict[str, dict[int | None, list[Job]]], latencies: dict[str, tuple],
           smoke: bool, info: dict[str, str]) -> str:
    lines = [f"## Publishing weights (`benchmarks/weight_push.py{' --smoke' if smoke else ''}`)", "",
             *machine_lines(info, command_line()), "",
             f"`torchpass_ddp` on {STEADY_RANKS} pinned ranks publishing every step to {FOLLOWERS} follower "
             "processes on the same machine (which map the publisher's copies), publishing to none, and not "
             "publishing, runs alternating. Stall: "
             "per publication, what the training loop waits for (starting the copy into host memory, and its "
             "fence before the optimizer step), over the median step time of the job without publishing. Step "
             "ratios: median step times side by side, which also carry what the background copy, the sends and "
             "the followers themselves take from the machine's cores. Staleness: for each version a follower "
             "received, how many newer ones rank 0 had published by then. " + STEADY_NOTE, "",
             "| Model | Weights | Stall / step, publishing to none (median, max) | Stall / step, publishing to "
             f"{FOLLOWERS} (median, max) | Step, publishing to none / not (95% interval) | Step, publishing to "
             f"{FOLLOWERS} / not | Staleness in versions (median, max) | Versions received / published |",
             "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        runs = jobs[size.name]
        off = runs[None]
        step_off = statistics.median(j.step_ms for j in off)
        stalls = {f: [s / step_off for j in runs[f] for s in j.stall_ms] for f in (0, FOLLOWERS)}
        ratios = {f: median_ci([a.step_ms / b.step_ms for a, b in zip(runs[f], off, strict=True)])
                  for f in (FOLLOWERS, 0)}
        stale = [s for j in runs[FOLLOWERS] for s in j.staleness]
        cells = [f"**{r:.3f}** ({lo:.3f}-{hi:.3f})" for r, lo, hi in (ratios[0], ratios[FOLLOWERS])]
        stall_cells = [f"{statistics.median(stalls[f]):.2%}, {max(stalls[f]):.2%}" for f in (0, FOLLOWERS)]
        lines.append(f"| {size.name} | {size.params * 4 / 1e6:.0f} MB | {stall_cells[0]} | {stall_cells[1]} | "
                     f"{cells[0]} | {cells[1]} | {statistics.median(stale):.0f}, {max(stale)} | "
                     f"{sum(j.received for j in runs[FOLLOWERS])} / "
                     f"{sum(j.published for j in runs[FOLLOWERS]) * FOLLOWERS} |")
    lines += ["", "Latency: from `publish` to a subscriber process holding the version whole, on each path: TCP "
              "against a raw copy of the same bytes into host memory and a raw TCP send to a process receiving "
              "them into a buffer; the publisher's mapped copy (a subscriber on its host) against a raw copy into "
              "shared memory that another process copies out of into a buffer (median of the repetitions; ratio: "
              "raw / publication, 1 = as fast as the raw transfer). Each transfer starts half a second after the "
              "receiver asked for it, as a replica waits for the next version.", "",
              "| Bytes | Path | Publication (ms) | Raw transfer (ms) | Raw / publication |", "|---|---|---|---|---|"]
    for (name, path), (nbytes, published, raw) in latencies.items():
        pub_ms, raw_ms = statistics.median(published) * 1e3, statistics.median(raw) * 1e3
        lines.append(f"| {name}: {nbytes / 1e6:.0f} MB | {path.replace('_', ' ')} | {pub_ms:.1f} | {raw_ms:.1f} | "
                     f"**{raw_ms / pub_ms:.2f}** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    roles = {"_follow": follow, "_subscribe": subscribe, "_receive_raw": receive_raw, "_copy_out": copy_out}
    if argv and argv[0] in roles:
        roles[argv[0]](*argv[1:])
        return 0
    args = bench_args(__doc__, argv)
    install_cleanup()
    sizes = SMOKE if args.smoke else SIZES
    info = machine()
    work_root = fresh_work_root("weights", args.smoke)
    jobs: dict[str, dict[int | None, list[Job]]] = {s.name: {f: [] for f in CONTENDERS} for s in sizes}
    latencies = {}
    for size in sizes:
        reps = args.reps or size.reps
        for rep in range(reps):
            for followers in in_turn(CONTENDERS, rep):
                print(f"[weights] {size.name} rep {rep} followers={followers} ...", flush=True)
                job = train(size, work_root / f"{size.name}-rep{rep}-{followers}", followers)
                jobs[size.name][followers].append(job)
                print(f"[weights] step {job.step_ms:.1f} ms, {job.published} published, {job.received} received",
                      flush=True)
        nbytes = size.params * 4
        for path in PATHS:
            published, raw = latency(nbytes, 3 if args.smoke else 10, path)
            latencies[size.name, path] = (nbytes, published, raw)
            print(f"[weights] {size.name} latency over {path}: publication {statistics.median(published) * 1e3:.1f} "
                  f"ms, raw {statistics.median(raw) * 1e3:.1f} ms", flush=True)
    body = render(sizes, jobs, latencies, args.smoke, info)
    raw_results = {"machine": info, "jobs": {k: {str(p): [asdict(j) for j in v] for p, v in d.items()}
                                             for k, d in jobs.items()},
                   "latency_s": {f"{name} {path}": value for (name, path), value in latencies.items()}}
    publish("weights", args.doc, body, work_root, raw_results)
    return 0


if __name__ == "__main__":
    os.environ.setdefault(wire.TOKEN_VARIABLE, TOKEN)
    sys.exit(main())
