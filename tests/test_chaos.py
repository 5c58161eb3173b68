"""The chaos matrix: its scenarios, its verdicts, and a fixed-seed slice of it (the full matrix of 200+
scenarios is ``torchpass chaos``; its last result is in docs/reliability.md)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
from jobs import run

from torchpass_plugins.testing import faults
from torchpass_plugins.testing.chaos import matrix
from torchpass_plugins.testing.chaos.scenario import STEPS, draw, draw_link
from torchpass_plugins.testing.faults import ACTIONS, PHASES, Fault

pytestmark = pytest.mark.xdist_group("chaos")  # one worker: the module's failure-free references are made once


def test_a_fault_prints_as_it_parses_and_a_bad_one_says_how_to_write_it():
    for text in ("kill@rank=1,step=5,phase=reduce", "spin@phase=donor", "slow@rank=2,step=3,phase=data,seconds=0.3"):
        assert str(Fault.parse(text)) == text
    assert Fault.parse("stall@phase=promoted").matches(rank=2, step=-1, phase="promoted")
    assert not Fault.parse("kill@rank=1,phase=data").matches(rank=0, step=4, phase="data")
    with pytest.raises(ValueError, match="phases"):
        Fault.parse("kill@rank=1,phase=lunch")
    with pytest.raises(ValueError, match="ACTION@rank=R"):
        Fault.parse("kill@rank=one")


def test_a_malformed_fault_spec_fails_when_loaded_not_on_import():
    script = ("from torchpass_plugins.testing import faults\n"  # importing reads nothing from the environment
              "from torchpass_plugins.errors import ConfigError\n"
              "try:\n    faults.load()\nexcept ConfigError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TORCHPASS_FAULTS": "kill@rank=one"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("torchpass: TORCHPASS_FAULTS: bad fault 'kill@rank=one'"), done.stdout


@pytest.mark.timeout(240)
def test_a_malformed_fault_spec_stops_the_job_before_training(tmp_path):
    job, codes = run(tmp_path, nproc=2, spares=0, train_args=("--max-steps", "3"), faults="kill@rank=one")
    assert codes == [1]
    assert "TORCHPASS_FAULTS: bad fault 'kill@rank=one'" in job.output()
    assert job.applied(0) == []
    assert len(job.events("worker_started")) == 2  # stopped, not refilled with workers that would repeat it
    assert job.leftovers() == []


def test_scenarios_replay_from_their_seed_and_the_matrix_covers_every_phase_and_action():
    scenarios = [draw(0, i) for i in range(200)]
    assert scenarios == [draw(0, i) for i in range(200)]
    assert draw(1, 0) != draw(0, 0) or draw(1, 1) != draw(0, 1)
    # ``collective`` strikes in the user's own collectives, ``publish`` while weights are sent to a subscriber:
    # the tests that know where a script makes them, or that publish, use them
    assert {s.target.phase for s in scenarios} == set(PHASES) - set(faults.USER_PHASES) - {"publish"}
    assert {s.target.action for s in scenarios} == set(ACTIONS) - set(faults.LINK_ACTIONS)  # (their own family)
    assert {s.strategy for s in scenarios} == {"torchpass_ddp", "torchpass_fsdp"}
    for s in scenarios:
        assert [faults.Fault.parse(item) for item in s.spec.split(";")] == list(s.faults)


def test_any_21_link_scenarios_cover_every_link_fault_in_every_phase_of_a_step():
    scenarios = [draw_link(3, i) for i in range(5, 26)]
    assert scenarios == [draw_link(3, i) for i in range(5, 26)]
    assert {(s.target.action, s.target.phase) for s in scenarios} == {
        (action, phase) for action in faults.LINK_ACTIONS for phase in faults.STEP_PHASES}
    assert all(s.on_hosts and s.reference.endswith("-hosts") and s.name.endswith("-link") for s in scenarios)
    assert {s.strategy for s in scenarios} == {"torchpass_ddp", "torchpass_fsdp"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One work directory for the module, so each failure-free reference run is made once."""
    return tmp_path_factory.mktemp("chaos")


def test_the_verdict_catches_a_divergence_and_a_step_applied_twice(work):
    # One real job with a kill; judged against the true reference, a perturbed one, and a doctored log.
    sc = draw(0, 16)
    assert sc.spec == "kill@rank=2,step=8,phase=data" and sc.strategy == "torchpass_ddp"
    expected = matrix.reference(work, sc.reference)
    job, codes, left = matrix.run_job(work / "verdict", sc.strategy, sc.replicate_every, sc.spec)
    assert matrix.judge(sc, job, codes, left, expected)[0] == "zero-rollback"
    for part, name in (("module", "net.1.running_mean"), ("callback_metrics", "train_acc")):  # rank 2's own
        perturbed = copy.deepcopy(expected)
        perturbed[2][part][name].view(-1)[0] += 1e-7
        outcome, detail = matrix.judge(sc, job, codes, left, perturbed)
        assert outcome == "failure" and detail.startswith(f"divergence: rank2/{part}/{name}: differs"), detail
    with open(job.out / "applied_rank1.txt", "a") as f:
        f.write(f"{STEPS - 1} 0.0\n")
    outcome, detail = matrix.judge(sc, job, codes, left, expected)
    assert outcome == "failure" and "applied twice without a log" in detail
    assert matrix.judge(sc, job, None, [], expected)[0] == "failure"  # hung
    assert matrix.judge(sc, job, codes, [12345], expected)[0] == "failure"  # a process left behind


# The CI slice: the scenarios (seed, index) that found bugs (docs/reliability.md), replayed with the outcome
# they have since the fix: an FSDP rank stalled outside a collective (was a hang), a stalled snapshot
# thread (the spare enters in fit's final barrier with its predecessor's logged values from before the
# epoch's end; was a restart), the promoted spare lost (waits for a refilled spare; was a restart), a kill
# in FSDP's data phase (never struck), the replication thread raising (was silent), an FSDP rollback to
# before the first step (diverged; since each step's gradient is logged at the ring successor, no single
# failure rolls back: the unit tests in test_sharded_recovery.py pin the rollback itself). Then one
# scenario of each fault kind the others do
# not strike, with the outcome the guarantee promises and no costlier one: a GIL-holding loop and a
# SIGSTOP (replaced live), a slow rank (nothing lost), the coordinator's agent killed (the job stops; the
# resubmitted job resumes from its newest snapshot). Seed 1's #21: rank 1 killed, then rank 0 during the
# recovery, before rank 1's spare held rank 0's copy of its logged values: they start over, and say so.
# Seed 1's #11: a survivor whose recovery raises, in a collective Lightning's SIGTERM check makes and whose
# errors it swallows: the survivor fails at its next collective and is replaced (was a hang, then a restart).
SLICE = {(0, 2): {"zero-rollback"}, (0, 19): {"logs-at-vote"}, (0, 8): {"zero-rollback"}, (0, 20): {"restarted"},
         (0, 58): {"zero-rollback"}, (0, 27): {"zero-rollback"}, (0, 34): {"zero-rollback"},
         (0, 128): {"zero-rollback"}, (0, 15): {"no-loss"}, (0, 0): {"stopped"}, (1, 21): {"logs-reset"},
         (1, 11): {"logs-reset"}}


@pytest.mark.parametrize(("seed", "index"), list(SLICE))
def test_fixed_seed_slice_of_the_chaos_matrix(work, seed, index):
    [result] = matrix.run_matrix(seed, [index], work)
    assert result.index == index and result.outcome in SLICE[seed, index], f"{result.outcome}: {result.detail}"


def test_the_summary_leads_with_the_zero_rollback_share_of_single_failures():
    def result(outcome: str, strategy: str, lost: int, kind: str = "step") -> matrix.Result:
        return matrix.Result(0, "kill@rank=1,step=3,phase=data", kind, "data", "kill", outcome, "", 1.0, strategy,
                             lost)

    results = [result("zero-rollback", "torchpass_ddp", 1), result("resumed", "torchpass_ddp", 1, "background"),
               result("no-loss", "torchpass_ddp", 0), result("resumed", "torchpass_ddp", 2, "double"),
               result("restarted", "torchpass_ddp", 1, "recovery"),  # a second fault: not a single failure
               result("zero-rollback", "torchpass_fsdp", 1)]  # fmt: skip
    text = matrix.summary(results, 3)
    assert ("`torchpass_ddp`: a single failure that lost a worker, replaced with zero rollback in 1 of 2 scenarios "
            "(50%)") in text
    assert ("`torchpass_fsdp`: a single failure that lost a worker, replaced with zero rollback in 1 of 1 scenarios "
            "(100%)") in text
    assert "| strategy | zero-rollback | no-loss | resumed | restarted |" in text
    assert "| torchpass_ddp | 1 | 1 | 2 | 1 |" in text and "| torchpass_fsdp | 1 | 0 | 0 | 0 |" in text
