"""Shared plumbing for the benchmark drivers: bounded subprocesses, cleanup, ports, machine facts, docs.

Both launchers start their workers in new sessions (``start_new_session=True``), so killing the
launcher's process group is not enough to leave nothing behind. The driver therefore makes itself a
*child subreaper*: every orphan of its subtree is re-parented to it, so walking ``/proc`` from our pid
finds every process we caused, whatever session it moved to, and cleanup can kill them all.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import datetime as dt
import fcntl
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torchpass_plugins.observe.provenance import code_fingerprint, disclose, recorded

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
TRAIN_SCRIPT = BENCH_DIR / "bench_train.py"
DOC = REPO / "docs" / "benchmarks.md"
SMOKE_DOC = BENCH_DIR / "out" / "benchmarks-smoke.md"
_PR_SET_CHILD_SUBREAPER = 36
# Steady-state step times run this many ranks, each pinned to one core (bench scripts' --pin): one per
# core on this 2-core machine, as one process per GPU on a cluster.
STEADY_RANKS = 2
T = TypeVar("T")


class RunFailed(RuntimeError):
    """A benchmark run did not finish as expected (timeout, bad exit code, missing records)."""


# -- processes ------------------------------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may hold spaces, so split after ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


@dataclass(frozen=True)
class MLPSize:
    """The benchmark MLP (``bench_train.py``) and the run bounds every benchmark mode shares."""

    features: int
    hidden: int
    depth: int
    classes: int
    batch_size: int
    reps: int
    timeout_s: float

    @property
    def params(self) -> int:
        first = self.features * self.hidden + self.hidden
        middle = (self.depth - 1) * (self.hidden * self.hidden + self.hidden)
        return first + middle + self.hidden * self.classes + self.classes

    def model_args(self) -> list[str]:
        """``bench_train.py`` flags for this model and batch."""
        return ["--batch-size", str(self.batch_size), "--features", str(self.features), "--hidden", str(self.hidden),
                "--depth", str(self.depth), "--classes", str(self.classes)]


def descendants(root: int | None = None) -> list[int]:
    """Every live process below ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    tree, out, todo = _children_map(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _reap_zombies() -> None:
    """Collect exit statuses of re-parented orphans (we are their subreaper, so they are our children)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_everything(grace_s: float = 3.0) -> list[int]:
    """SIGTERM every descendant, give launchers ``grace_s`` to stop their workers, then SIGKILL the rest.

    Returns the pids that were still alive when SIGKILL was sent (empty on a clean shutdown).
    """
    for pid in descendants():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap_zombies()
        if not [p for p in descendants() if not _is_zombie(p)]:
            break
        time.sleep(0.05)
    stubborn = [p for p in descendants() if not _is_zombie(p)]
    for pid in stubborn:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while descendants() and time.monotonic() < deadline:
        _reap_zombies()
        time.sleep(0.05)
    return stubborn


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def install_cleanup() -> None:
    """Become a subreaper and kill every descendant on exit, SIGTERM, SIGINT or SIGHUP."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    atexit.register(kill_everything)

    def on_signal(signum: int, _frame: Any) -> None:
        kill_everything()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)


def run_bounded(cmd: Sequence[str], env: dict[str, str], timeout_s: float, log_path: Path) -> int:
    """Run ``cmd`` (its output to ``log_path``) with a hard timeout; afterwards nothing of it survives.

    On timeout the whole subtree is killed and ``RunFailed`` is raised with the log's tail.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(list(cmd), env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_everything()
            proc.wait()
            raise RunFailed(f"timed out after {timeout_s:.0f}s: {shlex.join(cmd)}\n{tail(log_path)}") from None
    leftovers = kill_everything()
    if leftovers:
        print(f"  note: killed {len(leftovers)} process(es) left behind by {cmd[0]}", file=sys.stderr)
    return code


def attempt(tag: str, run: Callable[[], T], failures: list[str], strict: bool) -> T | None:
    """One benchmark run, announced and reported under ``tag``; a failed run (``RunFailed``) is printed and
    added to ``failures``, and gives None, or, if ``strict`` (smoke mode: any failure fails it), raises."""
    print(f"{tag} ...", flush=True)
    try:
        return run()
    except RunFailed as exc:
        failures.append(f"{tag}: {exc}")
        print(f"{tag} FAILED: {exc}", file=sys.stderr, flush=True)
        if strict:
            raise
        return None


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_port() -> int:
    """A port that was free a moment ago (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc keeps the memory a step frees for the next step instead of unmapping it (no mmap for large blocks,
# no trim): a CPU step then faults in no fresh pages. Otherwise each step of the ~105M model faulted in
# ~300,000 pages (gradients and AdamW temporaries), 40% of a single-process step, with a cost that swung
# between runs and hid the differences being measured; on a GPU those tensors come from CUDA's caching
# allocator, which never faults. Set for both contenders of a steady-state comparison alike.
STEADY_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
STEADY_NOTE = ("glibc keeps freed memory for reuse in every worker of both contenders (`MALLOC_MMAP_MAX_=0`, "
               "`MALLOC_TRIM_THRESHOLD_=2^40`: no page faults per step; see `STEADY_MALLOC` in `_harness.py`)")


def worker_env(restarts: bool = False, steady: bool = False) -> dict[str, str]:
    """Environment for both launchers: one intra-op thread per worker (torchrun's default), no fault
    injection unless asked for, the repo importable; ``restarts``: see ``torchrun_cmd``; ``steady``:
    steady-state step times (``STEADY_MALLOC``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "BENCH_", "MALLOC_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    if steady:
        env.update(STEADY_MALLOC)
    if restarts:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def torchpass_cmd(nproc: int, spares: int, run_dir: Path, script_args: Sequence[str]) -> list[str]:
    """``torchpass launch`` (port 0: the agent binds a free port for its store itself)."""
    return [sys.executable, "-m", "torchpass_plugins.cli", "launch", "--nproc-per-node", str(nproc),
            "--spares", str(spares), "--run-dir", str(run_dir), str(TRAIN_SCRIPT), *script_args]


def torchrun_cmd(nproc: int, script_args: Sequence[str], max_restarts: int = 0) -> list[str]:
    """Plain ``torchrun`` (default 0.1 s monitor interval) on a port found free by binding.

    Without restarts: static rendezvous on ``--master-port``. With restarts: c10d rendezvous on that port,
    plus ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (set by ``worker_env(restarts=True)``). By default
    torchrun hands the workers its own store, which outlives a restart, so the restarted ranks read the
    dead group's gloo addresses: "Gloo connectFullMesh failed ... Connection refused" (static backend) or
    a hang in init (c10d); pytorch/pytorch#135712. Opting out gives every restart round a fresh store.
    """
    port = str(free_port())
    if max_restarts:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}"]
    else:
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", port]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc), *rdzv,
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", str(TRAIN_SCRIPT), *script_args]


# -- records written by bench_train.py -------------------------------------------------------------------
def read_steps(out_dir: Path) -> dict[int, list[tuple[int, float, float, int]]]:
    """Per logical rank: (step, unix time, perf_counter, pid) for every optimizer step applied."""
    records: dict[int, list[tuple[int, float, float, int]]] = {}
    for path in sorted(out_dir.glob("steps_rank*.txt")):
        rank = int(re.findall(r"\d+", path.stem)[0])
        rows = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:  # a worker SIGKILLed mid-write leaves at most one partial line
                rows.append((int(parts[0]), float(parts[1]), float(parts[2]), int(parts[3])))
        records[rank] = rows
    return records


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- reporting -------------------------------------------------------------------------------------------
def machine() -> dict[str, str]:
    """What a reader needs to judge the numbers: cores, CPU model, versions, load when we started."""
    import lightning
    import torch

    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu": f"{os.cpu_count()} cores, {model}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "os": f"{platform.system()} {platform.release()}",
        "load": "{:.2f} / {:.2f} / {:.2f}".format(*load),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "provenance": recorded(),
    }


def machine_lines(info: dict[str, str], command: str) -> list[str]:
    return [
        f"- Command: `{command}`",
        f"- Date: {info['date']}; {info['provenance']}",
        f"- Machine: {info['cpu']}; {info['os']}; load average (1/5/15 min) at start {info['load']}",
        f"- Software: Python {info['python']}, torch {info['torch']}, lightning {info['lightning']}",
    ]


def command_line() -> str:
    return shlex.join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


def summarize(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, min, max); NaNs when there is nothing to summarize."""
    vals = list(values)
    if not vals:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(vals), min(vals), max(vals)


def in_turn(contenders: Sequence[T], rep: int) -> list[T]:
    """The order in which repetition ``rep`` runs ``contenders``: reversed every other repetition (A B, B A,
    ...), so that a drift of the machine during a repetition is not charged to whichever side runs first."""
    return list(contenders) if rep % 2 == 0 else list(reversed(contenders))


def median_ci(values: Iterable[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): a distribution-free confidence interval for the median, from the order
    statistics (the count of samples below the true median is binomial(n, 1/2)); it assumes only that
    the samples are independent. With fewer than 6 samples no interval reaches 95%: (min, max) then."""
    vals = sorted(values)
    n = len(vals)
    k = 0  # the interval is [vals[k], vals[n - 1 - k]]
    while k + 1 < n - 1 - k and 2 * sum(math.comb(n, i) for i in range(k + 2)) / 2**n <= 1 - level:
        k += 1
    return statistics.median(vals), vals[k], vals[n - 1 - k]


_DOC_HEADER = """# Benchmarks

Generated by the scripts in `benchmarks/` (see `benchmarks/README.md`); each section is rewritten by
the script named in it, between its markers. Do not edit inside the markers by hand.
"""


def update_section(doc: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``doc`` (appending
    the section if it is missing), leaving every other section as it was."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    doc.parent.mkdir(parents=True, exist_ok=True)
    (BENCH_DIR / "out").mkdir(exist_ok=True)
    with open(BENCH_DIR / "out" / ".publish.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # scripts of the smoke suite run side by side
        text = doc.read_text() if doc.exists() else _DOC_HEADER
        if start in text and end in text:
            before, rest = text.split(start, 1)
            after = rest.split(end, 1)[1]
            text = before + block + after
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
        text = disclose(text, code_fingerprint())  # this section's note on older code goes, the others' stay
        tmp = doc.with_suffix(doc.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(doc)


def bench_args(
    description: str, argv: list[str] | None, extra: Callable[[argparse.ArgumentParser], object] | None = None
) -> argparse.Namespace:
    """The flags every benchmark takes: ``--smoke``, ``--reps`` (>= 3 in full mode), ``--doc``; ``extra``
    adds a script's own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(p)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition; asserts only that rows came out")
    p.add_argument("--reps", type=int, default=None, help="repetitions per contender (default: the script's; smoke: 1)")
    p.add_argument("--doc", type=Path, default=None,
                   help="markdown file to update (default: docs/benchmarks.md; smoke: benchmarks/out/...-smoke.md)")
    args = p.parse_args(argv)
    if not args.smoke and args.reps is not None and args.reps < 3:
        p.error("full mode needs --reps >= 3 (the table reports medians)")
    args.doc = args.doc or (SMOKE_DOC if args.smoke else DOC)
    return args


def begin(description: str, argv: list[str] | None, name: str, full: T, smoke: T
          ) -> tuple[argparse.Namespace, T, int, dict[str, str], Path]:
    """What a benchmark's ``main`` starts with: its flags (:func:`bench_args`), the clean-up of whatever it
    starts, its size (``full``, or ``smoke`` with ``--smoke``; each has ``reps``), the repetitions, the
    machine's description and a fresh work directory ``out/NAME``."""
    args = bench_args(description, argv)
    install_cleanup()
    size = smoke if args.smoke else full
    return args, size, args.reps or size.reps, machine(), fresh_work_root(name, args.smoke)


def fresh_work_root(name: str, smoke: bool) -> Path:
    root = BENCH_DIR / "out" / (f"{name}-smoke" if smoke else name)
    shutil.rmtree(root, ignore_errors=True)
    return root


def publish(name: str, doc: Path, body: str, work_root: Path, raw: dict[str, Any]) -> None:
    """Write the table into its section of ``doc`` and the raw results beside the run directories."""
    update_section(doc, name, body)
    raw_path = work_root.parent / f"{work_root.name}.json"
    raw_path.write_text(json.dumps(raw, indent=2))
    print(body)
    print(f"[{name}] wrote section {name!r} of {doc} and raw results {raw_path}")
