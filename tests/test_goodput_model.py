"""The goodput simulation agrees with its closed forms and loses exactly the work it should."""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _goodput_model import Policy, _Ledger, closed_form, daly_ettr, erlang_b, simulate, young_daly

HOUR, DAY = 3600.0, 86400.0


def _mean_ettr(p: Policy, mttf: float, trials: int = 60, days: float = 20.0) -> float:
    return statistics.fmean(simulate(p, mttf, days * DAY, f"t/{k}")["ettr"] for k in range(trials))


def test_checkpoint_restart_matches_daly():
    mttf = 2 * HOUR
    p = Policy("cr", "ckpt", tau=young_daly(20.0, mttf), cost=20.0, restart_s=600.0)
    assert abs(_mean_ettr(p, mttf) - daly_ettr(p.tau, p.cost, p.restart_s, mttf)) < 0.01


def test_torchft_matches_first_order():
    mttf = 2 * HOUR
    p = Policy("ft", "torchft", groups=16, pause_s=45.0, rejoin_s=900.0, rejoin_pause_s=30.0)
    assert abs(_mean_ettr(p, mttf) - closed_form(p, mttf)) < 0.01


def test_torchpass_with_ample_spares_never_restarts():
    p = Policy("tp", "torchpass", tau=HOUR, cost=1.0, write_s=30.0, restart_s=600.0, swap_s=50.0, spares=64,
               refill_s=HOUR)
    run = simulate(p, 2 * HOUR, 10 * DAY, "s")
    assert run["fallbacks"] == 0 and run["swaps"] == run["failures"] > 0


def test_torchpass_without_spares_falls_back_every_time():
    p = Policy("tp", "torchpass", tau=HOUR, cost=1.0, restart_s=600.0, swap_s=50.0, spares=1, host_share=1.0)
    run = simulate(p, 2 * HOUR, 10 * DAY, "s")
    assert run["swaps"] == 0 and run["fallbacks"] == run["failures"] > 0


def test_ledger_restores_the_newest_written_checkpoint():
    ledger = _Ledger(tau=100.0, cost=10.0, write_s=50.0)
    ledger.advance(0.0, 250.0)  # boundaries at 110 s (work 100, written at 160) and 220 s (work 200, at 270)
    assert ledger.work == 200.0 + 30.0
    assert ledger.rollback(now=250.0) == 130.0  # the snapshot of work 200 is still being written
    assert ledger.work == 100.0
    ledger.advance(300.0, 520.0)  # two more boundaries: work 200 (at 410, written at 460) and 300 (at 520, 570)
    assert ledger.work == 300.0
    assert ledger.rollback(now=530.0) == 100.0 and ledger.work == 200.0
    ledger.advance(600.0, 710.0)  # work 300 again, its snapshot written at 760
    assert ledger.rollback(now=800.0) == 0.0 and ledger.work == 300.0


def test_erlang_b_limits():
    assert erlang_b(0, 1.0) == 1.0
    assert erlang_b(10, 1e-9) < 1e-12
    assert abs(erlang_b(1, 1.0) - 0.5) < 1e-12


def test_torchpass_host_losses_need_a_host_worth_of_spares():
    base = Policy("tp", "torchpass", tau=HOUR, cost=1.0, restart_s=600.0, swap_s=50.0, host_swap_s=80.0,
                  host_spares=8, refill_s=HOUR, host_share=1.0)
    short = simulate(replace(base, spares=7), 2 * HOUR, 10 * DAY, "h")
    enough = simulate(replace(base, spares=64), 2 * HOUR, 10 * DAY, "h")
    fatal = simulate(replace(base, spares=64, fatal_share=1.0), 2 * HOUR, 10 * DAY, "h")
    assert short["swaps"] == 0 and short["fallbacks"] == short["failures"] > 0
    assert enough["fallbacks"] == 0 and enough["swaps"] == enough["failures"] > 0
    assert fatal["swaps"] == 0 and fatal["fallbacks"] == fatal["failures"] > 0
