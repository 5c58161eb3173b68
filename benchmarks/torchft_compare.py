"""torchpass hot swap next to TorchFT on the same MLP, data and failure schedule, on CPU with gloo.

*torchpass*: ``regain.py``'s torchpass run (``torchpass launch --nproc-per-node 4 --spares 1``,
``torchpass_ddp``, logical rank 1 SIGKILLed inside the gradient all-reduce of step K), saving the final
weights. *TorchFT* (``torchft-nightly``, the optional extra ``bench-torchft``): ``bench_torchft.py``, one
replica group of one process per rank (3; smoke: 2), TorchFT's lighthouse (``torchft_lighthouse`` with
the settings of TorchFT's README), its ``Manager``, reconfigurable ``ProcessGroupGloo``, ``Optimizer``
wrapper and sampler; replica group 1 SIGKILLs itself in step K after its backward, before its gradients
are all-reduced. This driver then restarts that group at once, as the scheduler TorchFT relies on
(torchelastic, torchx, Slurm) would; the new process heals from a peer and takes part again.

Measured per run: regain (kill -> every surviving rank has completed step K again), when the job is back at
full strength (torchpass: the same moment; TorchFT: the replacement's first committed step), steps rolled
back, step attempts thrown away, replica-steps missing (TorchFT trains on with fewer groups: their batches are
never seen), and the final weights' distance from a failure-free run of the same approach.

Run ``python benchmarks/torchft_compare.py`` (full) or ``--smoke``. Needs ``pip install -e ".[bench-torchft]"``;
without TorchFT it says so, leaves the published section alone and exits 0 (an optional extra).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from _harness import (
    BENCH_DIR,
    REPO,
    RunFailed,
    attempt,
    bench_args,
    command_line,
    free_port,
    fresh_work_root,
    install_cleanup,
    kill_everything,
    machine,
    machine_lines,
    publish,
    read_steps,
    run_bounded,
    summarize,
    tail,
    torchpass_cmd,
    worker_env,
)
from regain import FULL, KILL_RANK, SMOKE, Size, run_torchpass, script_args

TORCHPASS, TORCHFT = "torchpass", "torchft"
# The lighthouse as TorchFT's README starts it (min 1 replica, 100 ms ticks, 10 s join timeout); its
# heartbeat timeout (5 s) is the default, which is what finds a dead replica group.
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
# Long enough after the kill for a TorchFT replacement (a fresh interpreter, ~10 s here) to get back in.
FULL_CMP = replace(FULL, max_steps=70, timeout_s=600)
SMOKE_CMP = replace(SMOKE, max_steps=12, timeout_s=180)


@dataclass
class Result:
    mode: str
    rep: int
    regain_s: float
    full_strength_s: float | None  # None: the replacement was not back before the end
    rolled_back: int
    discarded: int
    replica_steps_missing: int
    max_abs_diff: float = float("nan")
    rel_l2_diff: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)


def torchft_available() -> str | None:
    """None when TorchFT imports and its lighthouse binary is on PATH, else the reason."""
    try:
        import torchft  # noqa: F401
    except Exception as exc:  # any import failure is a reason to skip, reported as such
        return f"import torchft failed: {type(exc).__name__}: {exc}"
    if shutil.which("torchft_lighthouse") is None:
        return "torchft_lighthouse is not on PATH"
    return None


def weight_distance(a: Path, b: Path) -> tuple[float, float]:
    """(max |a - b|, ||a - b|| / ||b||) over every tensor of two saved state dicts."""
    import torch

    sa, sb = torch.load(a), torch.load(b)
    diff = torch.cat([(sa[k].double() - sb[k].double()).flatten() for k in sb])
    ref = torch.cat([sb[k].double().flatten() for k in sb])
    return float(diff.abs().max()), float(diff.norm() / ref.norm())


# -- torchpass ------------------------------------------------------------------------------------------
def torchpass_reference(size: Size, work: Path) -> Path:
    """The failure-free torchpass run; returns its final weights."""
    out = work / "out"
    args = [*script_args(replace(size, kill_step=-1), out, "torchpass_ddp", ckpt=False), "--save-weights"]
    code = run_bounded(torchpass_cmd(size.devices + 1, 1, work / "run", args), worker_env(), size.timeout_s,
                       work / "launcher.log")
    if code != 0:
        raise RunFailed(f"torchpass reference exited {code}\n{tail(work / 'launcher.log')}")
    return out / "weights_rank0.pt"


def torchpass_run(size: Size, work: Path, rep: int) -> Result:
    r = run_torchpass(size, work, rep, extra=["--save-weights"])
    return Result(TORCHPASS, rep, r.regain_s, r.regain_s, r.steps_recomputed, 0, 0,
                  extra={"per_rank_s": r.per_rank_s, **r.extra})


# -- TorchFT --------------------------------------------------------------------------------------------
def torchft_once(size: Size, work: Path, kill: bool) -> Path:
    """Lighthouse + 3 replica groups (+ the replacement of a killed one); returns the out directory."""
    import torch.distributed as dist

    out = work / "out"
    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = free_port()
    logs: list[Any] = []

    def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
        logs.append(open(log, "ab"))
        return subprocess.Popen(cmd, env=worker_env(), cwd=REPO, stdout=logs[-1], stderr=subprocess.STDOUT,
                                start_new_session=True)

    def replica(r: int, restarted: bool) -> subprocess.Popen:
        cmd = [sys.executable, str(BENCH_DIR / "bench_torchft.py"), "--replica", str(r), "--groups", str(size.devices),
               "--lighthouse", f"http://127.0.0.1:{port}", "--store", f"127.0.0.1:{store.port}",
               "--max-steps", str(size.max_steps), "--accumulate", str(size.accumulate), *size.model_args(),
               "--out", str(out)]
        if kill:
            cmd += ["--kill-rank", str(KILL_RANK), "--kill-step", str(size.kill_step)]
        return spawn(cmd + (["--restarted"] if restarted else []), work / f"replica{r}.log")

    deadline = time.monotonic() + size.timeout_s
    try:
        spawn(["torchft_lighthouse", "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE_FLAGS], work / "lighthouse.log")
        procs = {r: replica(r, False) for r in range(size.devices)}
        finished: dict[int, int] = {}
        while len(finished) < size.devices:
            if time.monotonic() > deadline:
                raise RunFailed(f"torchft: timed out after {size.timeout_s:.0f}s\n{tail(work / 'replica0.log')}")
            for r, proc in procs.items():
                code = proc.poll()
                if code is None or r in finished:
                    continue
                if code == -9 and kill:  # the scheduler's part: start the group again, at once
                    procs[r] = replica(r, True)
                elif code != 0:
                    raise RunFailed(f"torchft: replica {r} exited {code}\n{tail(work / f'replica{r}.log')}")
                else:
                    finished[r] = code
            time.sleep(0.02)
    finally:
        kill_everything()
        for log in logs:
            log.close()
    return out


def torchft_run(size: Size, work: Path, rep: int) -> Result:
    out = torchft_once(size, work, kill=True)
    marks = (out / f"kill_marks_rank{KILL_RANK}.txt").read_text().split()
    if not marks:
        raise RunFailed("torchft: no kill mark: the fault never fired")
    kill, victim_pid = float(marks[1]), int(marks[2])
    records = read_steps(out)
    survivors = [r for r in range(size.devices) if r != KILL_RANK]
    per_rank = {}
    for r in survivors:
        done = [t for step, t, _, _ in records[r] if step == size.kill_step and t > kill]
        if not done:
            raise RunFailed(f"torchft: rank {r} never completed step {size.kill_step} after the kill")
        per_rank[r] = done[0] - kill
    back = [t for step, t, _, pid in records.get(KILL_RANK, []) if pid != victim_pid and step >= size.kill_step]
    discarded = max(len((out / f"discarded_rank{r}.txt").read_text().splitlines()) for r in survivors)
    counts = [int(line.split()[1]) for line in (out / "participants_rank0.txt").read_text().splitlines()]
    before = {step for step, t, _, _ in records[0] if t <= kill}
    rolled_back = len(before & {step for step, t, _, _ in records[0] if t > kill})
    return Result(TORCHFT, rep, max(per_rank.values()), (min(back) - kill) if back else None, rolled_back, discarded,
                  sum(size.devices - n for n in counts), extra={"per_rank_s": per_rank})


# -- report ---------------------------------------------------------------------------------------------
def training_move(size: Size, weights: Path) -> float:
    """||w - w0|| / ||w||: how far training moved the weights from their (shared) initial values, for scale."""
    import torch
    from bench_torchft import build_mlp

    init = build_mlp(size.features, size.hidden, size.depth, size.classes, seed=7).state_dict()
    final = torch.load(weights)
    diff = torch.cat([(final[k].double() - init[k].double()).flatten() for k in final])
    return float(diff.norm() / torch.cat([final[k].double().flatten() for k in final]).norm())


def render(size: Size, results: list[Result], failures: list[str], smoke: bool, info: dict[str, str],
           versions: dict[str, str], moved: dict[str, float]) -> str:
    lines = ["## torchpass hot swap and TorchFT, same job and failure (`benchmarks/torchft_compare.py`)", ""]
    if smoke:
        lines += ["> **Smoke run**: tiny model, one repetition; the times are not a measurement.", ""]
    lines += machine_lines(info, command_line())
    lines += [
        f"- TorchFT: `torchft-nightly` {versions.get('torchft', '?')} beside torch {info['torch']}; lighthouse "
        f"`torchft_lighthouse {' '.join(LIGHTHOUSE_FLAGS)}` (TorchFT's README settings; heartbeat timeout: its "
        "default, 5 s).",
        f"- Job: {size.devices} ranks / replica groups of one process; MLP {size.features} -> "
        f"{size.hidden}x{size.depth} -> {size.classes} ({size.params:,} parameters), batch {size.batch_size} per "
        f"rank, gradient accumulation {size.accumulate}, AdamW, gloo, {size.max_steps} steps; rank 1 SIGKILLed in "
        f"step {size.kill_step} before "
        "its gradients reach the others (torchpass: inside the all-reduce; TorchFT: after backward, before "
        "`manager.allreduce`). torchpass: a hot spare takes the rank over. TorchFT: the survivors' commit of the "
        "step fails, a new quorum forms without the dead group once its heartbeat lapses, they go on without it; "
        "the driver restarts the dead group at once (as torchelastic/torchx would), it heals from a peer "
        "over TorchFT's checkpoint transport and resumes its data shard at the healed step.",
        "- Regain: from the victim's mark until every surviving rank has completed the step in flight. Full "
        "strength: until all ranks train again (torchpass: the same moment). Rolled back: steps completed "
        "before and after the kill. Attempts thrown away: failed commits on a survivor. Replica-steps missing: "
        f"steps x groups that ran with fewer than {size.devices} groups (their batches are never trained on). "
        "Distance: final weights of rank 0 against a failure-free run of the same approach (max |diff|, "
        "||diff|| / ||w||).",
        "",
        "| Approach | Runs | Regain (s), median (min-max) | Full strength (s), median | Rolled back | "
        "Attempts thrown away | Replica-steps missing | Max abs weight diff | Relative L2 diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, label in ((TORCHPASS, "torchpass hot swap"), (TORCHFT, "TorchFT")):
        rs = [r for r in results if r.mode == mode]
        if not rs:
            continue
        reg, lo, hi = summarize(r.regain_s for r in rs)
        backs = [r.full_strength_s for r in rs if r.full_strength_s is not None]
        full = f"{summarize(backs)[0]:.2f}" if backs else "not back before the end"
        med = {k: summarize(getattr(r, k) for r in rs)[0] for k in ("rolled_back", "discarded",
                                                                     "replica_steps_missing", "max_abs_diff",
                                                                     "rel_l2_diff")}
        lines.append(f"| {label} | {len(rs)} | {reg:.2f} ({lo:.2f}-{hi:.2f}) | {full} | {med['rolled_back']:.0f} | "
                     f"{med['discarded']:.0f} | {med['replica_steps_missing']:.0f} | {med['max_abs_diff']:.3g} | "
                     f"{med['rel_l2_diff']:.3g} |")
    lines += ["", "TorchFT's regain is mostly its lighthouse's heartbeat timeout (5 s by default): until it lapses, "
              "the dead group still counts as healthy and the survivors' quorum waits for it. A shorter timeout "
              "shortens that wait (not measured here). torchpass's agent sees the exit itself and replaces the "
              "rank at once; its spare replays the step in flight, so nothing is lost and the weights are "
              "those of the failure-free run, bit for bit."]
    if moved:
        lines += ["", "For scale, training moved rank 0's weights from their initial values by ||w - w0|| / ||w|| = "
                  + ", ".join(f"{v:.3g} ({k}, failure-free)" for k, v in moved.items()) + ".", ""]
    else:
        lines += ["", "Smoke run: no failure-free runs, so no weight distances (nan).", ""]
    if failures:
        lines += [f"Failed runs ({len(failures)}), left out:", ""] + [f"- {f.splitlines()[0]}" for f in failures]
        lines.append("")
    return "\n".join(lines)


def judged(r: Result, work: Path, reference: Path | None) -> Result:
    """``r`` with the distance of its final weights from the failure-free run's (when there is one)."""
    weights = work / "out" / "weights_rank0.pt"
    if not weights.exists():
        raise RunFailed(f"{r.mode}: no final weights in {weights.parent}")
    if reference is not None:
        try:
            r.max_abs_diff, r.rel_l2_diff = weight_distance(weights, reference)
        except OSError as exc:
            raise RunFailed(f"{r.mode}: cannot read weights: {exc}") from exc
    return r


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__, argv)
    install_cleanup()
    size = SMOKE_CMP if args.smoke else FULL_CMP
    reps = args.reps or size.reps
    info = machine()
    work_root = fresh_work_root("torchft", args.smoke)
    reason = torchft_available()
    if reason is not None:  # an optional extra: skip, and leave the published section as it is
        print(f"[torchft] skipped: {reason}; install it with pip install -e \".[bench-torchft]\"", file=sys.stderr)
        return 0
    from importlib.metadata import version

    versions = {"torchft": version("torchft-nightly")}
    results: list[Result] = []
    failures: list[str] = []
    ref: dict[str, Path] = {}
    try:
        if not args.smoke:  # smoke: no failure-free runs (half the time), so no distances
            print("[torchft] failure-free references ...", flush=True)
            ref = {TORCHPASS: torchpass_reference(size, work_root / "ref-torchpass"),
                   TORCHFT: torchft_once(replace(size, kill_step=-1), work_root / "ref-torchft", kill=False)
                   / "weights_rank0.pt"}
    except RunFailed as exc:
        print(f"[torchft] reference FAILED: {exc}", file=sys.stderr)
        return 1
    for rep in range(reps):
        for mode, fn in ((TORCHPASS, torchpass_run), (TORCHFT, torchft_run)):
            work = work_root / f"rep{rep}-{mode}"
            r = attempt(f"[torchft] rep {rep} {mode}", lambda: judged(fn(size, work, rep), work, ref.get(mode)),  # noqa: B023
                        failures, strict=args.smoke)
            if r is not None:
                results.append(r)
                print(f"[torchft] rep {rep} {mode}: {asdict(r)}", flush=True)
    moved = {mode: training_move(size, path) for mode, path in ref.items()}
    body = render(size, results, failures, args.smoke, info, versions, moved)
    raw = {"machine": info, "size": asdict(size), "versions": versions, "moved": moved,
           "results": [asdict(r) for r in results], "failures": failures}
    publish("torchft", args.doc, body, work_root, raw)
    return 0 if {r.mode for r in results} == {TORCHPASS, TORCHFT} else 1


if __name__ == "__main__":
    sys.exit(main())
