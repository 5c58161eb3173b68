"""The failure model behind ``goodput.py``: one policy per approach, a Monte Carlo run and a closed form.

Time is in seconds of wall clock. A job makes progress at rate 1 (one second of training work per second)
unless it is paused (detection, recovery, restart) or, for TorchFT, running with some replica groups out.
Failures form a Poisson process of rate 1 / MTTF for the whole job, in every state (also during a restart,
as in Daly's model). ETTR = training work kept at the end of the horizon / the horizon.

Policies (``Policy.kind``):

- ``ckpt``: checkpoint-restart. Segments of ``tau`` seconds of work, each followed by a blocking checkpoint of
  ``cost`` seconds; a failure throws away the work since the last complete checkpoint and the whole job
  restarts (``restart_s``; a failure during the restart starts it over).
- ``torchpass``: a failure of one worker takes a free spare and pauses every rank for ``swap_s`` (nothing is
  recomputed). A failure that takes a whole host (its agent with it) needs ``host_spares`` free spares on
  other hosts and pauses every rank for ``host_swap_s`` (``host_spares == 0``: a lost host is not survived
  live). A share ``fatal_share`` of failures (the host whose agent holds the job's store) always falls back.
  A used spare comes back after ``refill_s``. Fallback (no spare, or not survivable): the whole job restarts
  from the newest *written* snapshot, like ``ckpt`` but with background snapshots (``cost`` = the stall, and a
  snapshot is restorable ``write_s`` after its boundary); the restarted job gets its full pool of spares.
- ``torchft``: ``groups`` replica groups. A failure anywhere drops its group: every group pauses
  ``pause_s`` (detection, quorum change, the step in flight discarded); the dropped group comes back
  ``rejoin_s`` later (new host, process start, weights from a peer), which pauses everyone ``rejoin_pause_s``
  (the quorum grows again). With ``k`` groups out, progress runs at ``(groups - k) / groups``. No
  checkpoint is ever restored (a whole-job failure is outside this model).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str  # "ckpt" | "torchpass" | "torchft"
    tau: float = math.inf  # seconds of work between checkpoints / snapshots
    cost: float = 0.0  # stall per checkpoint / snapshot
    write_s: float = 0.0  # from a snapshot's boundary until it can be restored
    restart_s: float = 0.0  # whole-job restart
    swap_s: float = 0.0  # torchpass: pause for a live swap of one worker
    host_swap_s: float = 0.0  # torchpass: pause for a live swap of a lost host's workers
    spares: int = 0
    host_spares: int = 0  # spares a lost host needs (0: a lost host is not survived live)
    refill_s: float = 0.0
    host_share: float = 0.0  # share of failures that take a whole host
    fatal_share: float = 0.0  # share of failures that always end in a restart (part of host_share)
    groups: int = 1
    pause_s: float = 0.0  # torchft: pause of every group per failure
    rejoin_s: float = 0.0
    rejoin_pause_s: float = 0.0


def young_daly(cost: float, mtbf: float) -> float:
    """Young's first-order optimum checkpoint interval, sqrt(2 C M) (Daly's first term)."""
    return math.sqrt(2.0 * cost * mtbf)


def erlang_b(servers: int, load: float) -> float:
    """Blocking probability of an Erlang loss system: the chance a failure finds no free spare (Poisson
    failures, any refill-time distribution with that mean)."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def daly_ettr(tau: float, cost: float, restart: float, mtbf: float) -> float:
    """Exact ETTR of checkpoint-restart under exponential failures that also strike restarts and re-execution:
    a segment of ``tau`` work + ``cost`` checkpoint takes M e^{R/M} (e^{(tau+C)/M} - 1) on average (Daly 2006)."""
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + cost) / mtbf))


def short_of_spares(spares: int, need: int, worker_load: float, host_load: float, per_host: int) -> float:
    """Chance that fewer than ``need`` of ``spares`` are free, with spares held by worker failures (one each,
    ``worker_load`` = rate x refill) and host losses (``per_host`` each): the held count of an M^X/G/inf system,
    Poisson worker and host terms (it ignores that a blocked failure takes none, so it errs high)."""
    limit = spares - need  # blocked when more than this many are held
    if limit < 0:
        return 1.0
    p_host, short, h = math.exp(-host_load), 0.0, 0
    while h * per_host <= limit:
        left = limit - h * per_host
        p_w, cdf = math.exp(-worker_load), 0.0
        for w in range(left + 1):
            cdf += p_w
            p_w *= worker_load / (w + 1)
        short += p_host * (1 - cdf)
        h += 1
        p_host *= host_load / h
    return short + max(0.0, 1 - sum(math.exp(-host_load) * host_load**k / math.factorial(k) for k in range(h)))


def swap_rates(p: Policy, mttf: float) -> tuple[float, float, float]:
    """(worker swaps, host swaps, fallbacks) per second (torchpass), to first order."""
    worker, host, fatal = (1 - p.host_share) / mttf, (p.host_share - p.fatal_share) / mttf, p.fatal_share / mttf
    if not p.host_spares:
        ok = worker * (1 - erlang_b(p.spares, worker * p.refill_s))
        return ok, 0.0, worker - ok + host + fatal
    loads = (worker * p.refill_s, host * p.refill_s, p.host_spares)
    ok_w = worker * (1 - short_of_spares(p.spares, 1, *loads))
    ok_h = host * (1 - short_of_spares(p.spares, p.host_spares, *loads))
    return ok_w, ok_h, worker - ok_w + host - ok_h + fatal


def fallback_rate(p: Policy, mttf: float) -> float:
    """Failures per second that end in a whole-job restart (torchpass), to first order."""
    return swap_rates(p, mttf)[2]


def closed_form(p: Policy, mttf: float) -> float:
    """ETTR in closed form: exact for ``ckpt``; first order (rare overlaps) for the other two."""
    lam = 1.0 / mttf
    if p.kind == "ckpt":
        return daly_ettr(p.tau, p.cost, p.restart_s, mttf)
    if p.kind == "torchpass":
        worker_swaps, host_swaps, fallbacks = swap_rates(p, mttf)
        restarts = daly_ettr(p.tau, p.cost, p.restart_s, 1 / fallbacks) if fallbacks > 0 else p.tau / (p.tau + p.cost)
        return restarts / (1 + worker_swaps * p.swap_s + host_swaps * p.host_swap_s)
    out = lam * p.rejoin_s  # groups out on average (Little's law), valid while << groups
    return max(0.0, 1 - out / p.groups) / (1 + lam * (p.pause_s + p.rejoin_pause_s))


class _Ledger:
    """Work done and the newest restorable checkpoint, for runs that checkpoint every ``tau`` of work."""

    def __init__(self, tau: float, cost: float, write_s: float) -> None:
        self.tau, self.seg, self.write_s = tau, tau + cost, write_s
        self.base = 0.0  # work at the start of the current segment
        self.u = 0.0  # productive wall time spent in the current segment
        self.kept = 0.0  # newest checkpoint known to be restorable
        self.recent: list[tuple[float, float]] = []  # (work, restorable from) of the last two boundaries

    @property
    def work(self) -> float:
        return self.base + min(self.u, self.tau)

    def advance(self, a: float, b: float) -> None:
        """Productive wall interval [a, b]."""
        if math.isinf(self.tau):
            self.u += b - a
            return
        total = self.u + (b - a)
        n = int(total // self.seg)
        if n:
            end = a + n * self.seg - self.u  # wall time the last completed segment ended
            for k in (1, 0):  # the last two boundaries; any older one was written before the newest ended
                if n - k >= 1:
                    self.recent.append((self.base + (n - k) * self.tau, end - k * self.seg + self.write_s))
            older = [w for w, _ in self.recent[:-2]] + ([self.base + (n - 2) * self.tau] if n >= 3 else [])
            self.kept = max([self.kept, *older])
            self.recent = self.recent[-2:]
            self.base += n * self.tau
        self.u = total - n * self.seg

    def rollback(self, now: float) -> float:
        """Back to the newest checkpoint restorable at ``now``; returns the work thrown away."""
        for work, ready in self.recent:
            if ready <= now:
                self.kept = max(self.kept, work)
        lost = self.work - self.kept
        self.base, self.u, self.recent = self.kept, 0.0, []
        return lost


def simulate(p: Policy, mttf: float, horizon: float, seed: str) -> dict[str, float]:
    """One run of ``horizon`` seconds; returns its ETTR and what happened. Failure times come from their own
    stream, so every approach of a case meets the same failures at the same times (common random numbers)."""
    rng, kinds = random.Random(f"{seed}/times"), random.Random(f"{seed}/kinds")
    ledger = _Ledger(p.tau, p.cost, p.write_s) if p.kind != "torchft" else None
    ft_work, out = 0.0, 0
    t, busy_until, restart_until = 0.0, 0.0, -1.0
    spares = p.spares
    returns: list[tuple[float, int]] = []  # (time, what comes back): spares (torchpass) or a group (torchft)
    next_fail = rng.expovariate(1 / mttf)
    counts = {"failures": 0, "swaps": 0, "fallbacks": 0, "lost_s": 0.0}
    while True:
        nxt = min(next_fail, returns[0][0] if returns else math.inf, horizon)
        a = max(t, busy_until)
        if nxt > a:
            if ledger is not None:
                ledger.advance(a, nxt)
            else:
                ft_work += (nxt - a) * (p.groups - out) / p.groups
        t = nxt
        if t >= horizon:
            break
        if returns and returns[0][0] <= next_fail:
            _, n = heapq.heappop(returns)
            if p.kind == "torchft":
                out -= 1
                busy_until = max(busy_until, t + p.rejoin_pause_s)
            else:
                spares += n
            continue
        counts["failures"] += 1
        next_fail = t + rng.expovariate(1 / mttf)
        if p.kind == "torchft":
            busy_until = max(busy_until, t + p.pause_s)
            if out < p.groups:
                out += 1
                heapq.heappush(returns, (t + p.rejoin_s, 1))
            continue
        need, pause = 1, p.swap_s
        if p.kind == "torchpass":
            what = kinds.random()
            if what < p.fatal_share:
                need = p.spares + 1  # never enough: this one always restarts the job
            elif what < p.host_share:
                need, pause = p.host_spares or p.spares + 1, p.host_swap_s  # 0: not survivable live
        if p.kind == "torchpass" and t >= restart_until and spares >= need:
            spares -= need
            heapq.heappush(returns, (t + p.refill_s, need))
            busy_until = max(busy_until, t + pause)
            counts["swaps"] += 1
            continue
        counts["fallbacks"] += 1
        counts["lost_s"] += ledger.rollback(t)
        busy_until = restart_until = t + p.restart_s  # a failure during a restart starts it over
        spares, returns = p.spares, []
    work = ledger.work if ledger is not None else ft_work
    return {"ettr": work / horizon, **counts}


# -- the inputs, and the four approaches built from them ------------------------------------------------
DIP_STEPS = 3  # snapshot_stall.py's dip window
# Llama 3 (section 3.3.4, Table 5): 419 unexpected interruptions, 54 days, 16,384 GPUs. Root causes that take a
# whole host (and so its torchpass agent) down: network switch/cable 35, host maintenance 32, NIC 7, SSD 3,
# power supply 3, server chassis 2, IO expansion board 2, CPU 2, system memory 2 = 88.
LLAMA3_INTERRUPTIONS, LLAMA3_HOURS, LLAMA3_GPUS, LLAMA3_HOST_LEVEL = 419, 54 * 24, 16_384, 88


@dataclass
class Measured:
    """Costs measured on this machine by the other benchmarks; ``source`` says where each value came from."""

    tp_regain_s: float = 0.56  # regain.py: torchpass, kill -> every rank past the step in flight
    cr_restart_s: float = 13.82  # regain.py: checkpoint-restart, kill -> first step after restart + restore
    sync_stall_s: float = 2.0804  # snapshot_stall.py: synchronous save of the state below
    tp_stall_s: float = 0.0019  # snapshot_stall.py: torchpass snapshot stall
    tp_write_s: float = 2.0804  # background write of a torchpass snapshot (default: the sync save, a proxy)
    dip: float = 1.032  # snapshot_stall.py: step time after a snapshot / without
    step_ms: float = 970.4  # snapshot_stall.py: the step those are relative to
    snapshot_bytes: float = 504e6
    transfer_gbps: float = 0.83  # state_transfer.py: torchpass, largest size
    ft_regain_s: float = 5.14  # torchft_compare.py: TorchFT, kill -> survivors past the step in flight
    tp_overhead: float = 1.017  # overhead.py: torchpass_ddp / ddp step time, whole runs, ~105M model
    source: dict[str, str] = field(default_factory=dict)


@dataclass
class Assumed:
    """What this machine cannot measure. Each is a flag of this script."""

    state_gb: float = 4.0  # per GPU: Llama 3 checkpoints "1 MB to 4 GB per GPU"; the top of that range
    restart_min: float = 10.0  # whole-job restart at scale: requeue, healthy hosts, start, NCCL init, load
    detect_s: float = 10.0  # on NCCL, on top of what was measured on gloo: a dead peer may hang a collective
    heartbeat_s: float = 30.0  # torchpass: a silent host's agent is written off after this (--heartbeat-timeout)
    rebuild_s: float = 30.0  # abort the NCCL communicators and initialise new ones across the job
    step_s: float = 5.0  # one training step at scale (the step in flight is redone / discarded)
    spares_per_1024: int = 8  # torchpass: one spare host (8 GPUs) per 128 active hosts
    refill_h: float = 4.0  # until a used spare slot is back (its host repaired or replaced)
    host_share: float = LLAMA3_HOST_LEVEL / LLAMA3_INTERRUPTIONS
    gpus_per_host: int = 8
    ft_group_gpus: int = 64  # TorchFT: one replica group = 8 hosts (HSDP: FSDP inside, replicated across)
    snapshot_max_min: float = 60.0  # torchpass: a snapshot at least this often, whatever Young/Daly says
    ft_overhead: float = 1.0  # TorchFT's steady-state step time / plain HSDP's: not measured here
    horizon_days: float = 30.0


@dataclass(frozen=True)
class Scenario:
    label: str
    gpus: int
    mttf_h: float
    origin: str


def scenarios() -> list[Scenario]:
    per_gpu = LLAMA3_INTERRUPTIONS / (LLAMA3_HOURS * LLAMA3_GPUS)  # failures per GPU-hour
    return [
        Scenario("Meta, 1,024 GPUs", 1024, 7.9, "Meta's reported job MTTF"),
        Scenario("Meta, 16,384 GPUs", 16384, 1.8, "Meta's reported job MTTF"),
        Scenario("Llama 3 rate, 1,024 GPUs", 1024, 1 / (per_gpu * 1024), "Llama 3 per-GPU rate x 1,024"),
        Scenario("Llama 3 rate, 16,384 GPUs", 16384, 1 / (per_gpu * 16384), "Llama 3, as observed"),
    ]


def policies(sc: Scenario, m: Measured, a: Assumed) -> list[Policy]:
    """The four approaches for one scenario, every cost in seconds."""
    mttf = sc.mttf_h * 3600
    state = a.state_gb * 1e9
    scale = state / m.snapshot_bytes  # each rank writes its own state, in parallel, at the rate measured here
    restart = a.restart_min * 60 + m.cr_restart_s
    c_cr = m.sync_stall_s * scale
    # A dip under 1 (steps after a snapshot measured faster than without) is noise: no negative cost.
    c_tp = (m.tp_stall_s + DIP_STEPS * max(0.0, m.dip - 1) * m.step_ms / 1e3) * scale
    write = m.tp_write_s * scale
    transfer = state / (m.transfer_gbps * 1e9)
    swap = a.detect_s + a.rebuild_s + m.tp_regain_s + transfer + a.step_s
    spares = max(1, round(a.spares_per_1024 * sc.gpus / 1024))
    common = {"cost": c_tp, "write_s": write, "restart_s": restart, "swap_s": swap,
              "host_swap_s": swap + a.heartbeat_s, "host_spares": a.gpus_per_host, "refill_s": a.refill_h * 3600,
              "host_share": a.host_share, "fatal_share": a.host_share * a.gpus_per_host / sc.gpus}
    hot = [Policy("torchpass hot swap", "torchpass", spares=spares, **common),
           Policy(f"torchpass, {2 * a.spares_per_1024} spares per 1,024", "torchpass", spares=2 * spares, **common)]
    return [
        Policy("checkpoint-restart", "ckpt", tau=young_daly(c_cr, mttf), cost=c_cr, restart_s=restart),
        *(replace(p, tau=snapshot_interval(c_tp, fallback_rate(p, mttf), write, a.snapshot_max_min * 60))
          for p in hot),
        Policy("TorchFT-style", "torchft", groups=sc.gpus // a.ft_group_gpus,
               pause_s=a.detect_s + a.rebuild_s + m.ft_regain_s + a.step_s, rejoin_s=restart + transfer,
               rejoin_pause_s=a.rebuild_s),
    ]


def snapshot_interval(cost: float, fallbacks_per_s: float, write_s: float, cap_s: float) -> float:
    """Young/Daly on the rate of fallbacks, at least one write (one snapshot in flight), at most ``cap_s``
    (a fallback is rare but costs all the work since the newest snapshot)."""
    tau = young_daly(cost, 1 / fallbacks_per_s) if fallbacks_per_s > 0 else cap_s
    return min(max(tau, write_s), max(cap_s, write_s))


def goodput(p: Policy, ettr: float, gpus: int, m: Measured, a: Assumed) -> float:
    """Training work per provisioned GPU: ETTR over the steady-state overhead of the approach, times the
    share of provisioned GPUs that train (a torchpass spare is paid for and idle until it is needed)."""
    if p.kind == "torchpass":
        return ettr / m.tp_overhead * gpus / (gpus + p.spares)
    return ettr / a.ft_overhead if p.kind == "torchft" else ettr
