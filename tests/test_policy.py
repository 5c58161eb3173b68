"""The job's policy (every decision, table by table) and the control protocol's encoding, in-process."""

from __future__ import annotations

import json

import pytest

from torchpass_plugins.control.policy import Action, Decision, Policy
from torchpass_plugins.control.protocol import (
    Exit,
    ExitCode,
    Join,
    LeftForMigration,
    Migrate,
    NodeLost,
    ProtocolError,
    SpareDeadline,
    Stalled,
    StallVerdict,
    Stop,
    Straggler,
    decode,
    encode,
)
from torchpass_plugins.control.silence import BeatClocks
from torchpass_plugins.health.watch import Finding

A = Action


@pytest.mark.parametrize(("code", "refill", "job_done", "healthy", "expected"), [
    (ExitCode.REJECTED, True, False, True, A.ABORT),  # wrong token: this node stops, whatever else holds
    (ExitCode.REJECTED, False, True, False, A.ABORT),
    (-9, True, False, True, A.REFILL),  # a failure: the slot gets a fresh worker, a spare
    (1, True, False, True, A.REFILL),
    (-9, False, False, True, A.NOTHING),  # --no-refill
    (-9, True, True, True, A.NOTHING),  # the job is over
    (-9, True, False, False, A.NOTHING),  # the device was found failing: never refilled
    (ExitCode.OK, True, False, True, A.NOTHING),
    (ExitCode.CONFIG_ERROR, True, False, True, A.NOTHING),  # the job stops: a fresh worker would repeat it
    (ExitCode.UNRECOVERABLE, True, False, True, A.NOTHING),  # the job stops or restarts every worker
])
def test_what_the_agent_does_when_a_worker_exits(code, refill, job_done, healthy, expected):
    assert Policy(refill=refill).worker_exited(code, job_done=job_done, device_healthy=healthy).action is expected


@pytest.mark.parametrize(("code", "migrating", "asked", "restarts", "expected", "why"), [
    (ExitCode.OK, False, None, 3, A.FINISHED, ""),
    (ExitCode.OK, True, None, 3, A.REPLACE, ""),  # left for a migration whose spare was lost: a loss
    (-9, False, None, 3, A.REPLACE, ""),
    (1, False, None, 0, A.REPLACE, ""),
    (ExitCode.REJECTED, False, None, 3, A.REPLACE, ""),  # its agent stops the node; here, a lost rank
    (ExitCode.CONFIG_ERROR, False, "bad config", 3, A.ABORT, "bad config"),  # never restarted
    (ExitCode.CONFIG_ERROR, False, None, 3, A.ABORT, "worker w (logical rank 2) stopped on a configuration error"),
    (ExitCode.UNRECOVERABLE, False, "shard lost", 3, A.RESTART, "shard lost"),
    (ExitCode.UNRECOVERABLE, False, "shard lost", 0, A.ABORT, "shard lost"),  # no restart left
    (ExitCode.UNRECOVERABLE, False, None, 1, A.RESTART, "worker w (logical rank 2) found the lost state"),
])
def test_what_the_coordinator_does_when_a_rank_exits(code, migrating, asked, restarts, expected, why):
    decision = Policy(restarts_left=restarts).rank_exited(code, "w", 2, migrating=migrating, request=asked)
    assert decision.action is expected and decision.why.startswith(why)


@pytest.mark.parametrize(("code", "started", "expected", "why"), [
    (ExitCode.CONFIG_ERROR, True, A.ABORT, "worker w stopped on a configuration error before joining the job"),
    (1, False, A.ABORT, "worker w exited with code 1 before the job started: its script failed before joining"),
    (1, True, A.NOTHING, ""),  # a refilled spare: its agent's affair
    (-9, False, A.NOTHING, ""),  # killed from outside: started again
])
def test_a_worker_that_fails_before_joining_stops_a_job_that_has_not_started(code, started, expected, why):
    decision = Policy(restarts_left=3).unjoined_exited(code, "w", started=started)
    assert decision.action is expected and decision.why.startswith(why)


@pytest.mark.parametrize(("lost", "spares", "trained", "wait_s", "refill", "restarts", "expected"), [
    ([1], 1, False, 20.0, True, 3, A.REPLACE),
    ([0, 2], 2, False, 0.0, True, 0, A.REPLACE),
    ([0, 2], 1, False, 20.0, True, 3, A.WAIT),  # refilled workers may join in time
    ([0, 2], 1, False, 0.0, True, 3, A.RESTART),  # no wait: restart at once
    ([0, 2], 1, False, 20.0, False, 3, A.RESTART),  # --no-refill: no worker will come
    ([0, 2], 1, False, 20.0, False, 0, A.ABORT),
    ([1], 0, False, 0.0, True, 0, A.ABORT),
    ([1], 1, True, 20.0, True, 3, A.ABORT),  # training had completed: nothing to recover, never restarted
])
def test_what_the_coordinator_does_with_lost_ranks(lost, spares, trained, wait_s, refill, restarts, expected):
    policy = Policy(restarts_left=restarts, spare_wait_s=wait_s, refill=refill)
    assert policy.ranks_lost(lost, spares, training_complete=trained).action is expected


def test_the_messages_of_too_few_spares_and_of_a_loss_after_training():
    policy = Policy(restarts_left=1, spare_wait_s=0.2)
    now = Policy().ranks_lost([0, 1], 0, training_complete=False)
    assert now.why.startswith("2 worker(s) lost (logical rank(s) [0, 1]) but 0 spare(s) left:")
    assert "--spares" in now.why
    late = policy.spares_not_refilled([0, 1], 0, borrowed=False)
    assert late.action is A.RESTART and "but 0 spare(s) left (none joined within 0.2 s)" in late.why
    after = policy.ranks_lost([1], 3, training_complete=True)
    assert "after training had completed on every rank" in after.why and "not restarted" in after.why


@pytest.mark.parametrize(("job_over", "is_spare", "is_rank", "moving", "spares", "expected", "why"), [
    (False, False, True, False, 1, A.MIGRATE, ""),
    (False, True, False, False, 1, A.RETIRE, ""),  # a spare on a suspect device leaves the pool
    (False, True, False, True, 0, A.RETIRE, ""),
    (False, False, True, True, 1, A.REFUSE, "another migration is in progress"),
    (False, False, True, False, 0, A.REFUSE, "no spare left"),
    (False, False, False, False, 1, A.NOTHING, ""),  # neither rank nor spare (already gone)
    (True, False, True, False, 1, A.NOTHING, ""),  # the job is over
])
def test_what_the_coordinator_does_with_a_migration_request(job_over, is_spare, is_rank, moving, spares, expected,
                                                             why):
    decision = Policy().migration_requested(job_over=job_over, is_spare=is_spare, is_rank=is_rank, moving=moving,
                                            spares=spares)
    assert decision == Decision(expected, why)


def test_a_straggler_moves_only_when_stragglers_migrate():
    assert Policy(straggler_migrate=True).straggler("slow") == Decision(A.MIGRATE, "slow")
    assert Policy(straggler_migrate=False).straggler("slow") == Decision(A.WARN, "slow")


def test_a_stall_verdict_evicts_the_silent_ranks_or_restarts_when_every_rank_timed_out():
    evict = Policy().stall_verdict(4, ["n0-s1-i0"])
    assert evict.action is A.EVICT and evict.why.startswith("stalled the collectives of generation 4")
    none_silent = Policy(restarts_left=1).stall_verdict(4, [])
    assert none_silent.action is A.RESTART and "every rank's collective timed out in generation 4" in none_silent.why
    assert Policy(restarts_left=0).stall_verdict(4, []).action is A.ABORT


@pytest.mark.parametrize(("silent_s", "expected"), [(0.0, A.NOTHING), (30.0, A.NOTHING), (30.1, A.EVICT)])
def test_silence_past_the_heartbeat_timeout_is_written_off(silent_s, expected):
    assert Policy(heartbeat_timeout=30.0).silence(silent_s).action is expected


@pytest.mark.parametrize(("severities", "expected"), [
    ([], []),
    (["degraded"], [A.WARN]),
    (["degraded", "degraded"], [A.WARN, A.WARN]),
    (["critical"], [A.MIGRATE]),
    (["degraded", "critical", "degraded", "critical"], [A.WARN, A.MIGRATE]),  # the first critical ends it
])
def test_device_findings_warn_until_the_first_critical_one_moves_the_worker(severities, expected):
    findings = [Finding(s, f"check{i}", f"why{i}") for i, s in enumerate(severities)]
    decisions = Policy().device_findings(findings)
    assert [d.action for d in decisions] == expected
    assert [d.why for d in decisions] == [f"why{i}" for i in range(len(expected))]


@pytest.mark.parametrize("message", [
    Join("n0-s0-i0"), Exit("n0-s1-i0", -9, "signal 9"), Exit("n0-s1-i0", ExitCode.CONFIG_ERROR),
    Migrate("n0-s0-i0", "GPU 0 at 95 C"), Straggler("n0-s0-i0", "straggler: 2x"), LeftForMigration("n0-s0-i0"),
    Stalled("n0-s0-i0", 3, 0.5, "timed out"), StallVerdict(3), SpareDeadline(2), NodeLost(1, "silent"), Stop(),
])
def test_every_message_survives_the_wire(message):
    assert decode(encode(message).encode()) == message


def test_a_message_this_code_does_not_know_fails_loud():
    with pytest.raises(ProtocolError, match=r"unknown control message kind 'resize'.*same torchpass-plugins version"):
        decode(json.dumps({"kind": "resize", "to": 4}))
    with pytest.raises(ProtocolError, match="unknown control message kind None"):
        decode(json.dumps({"join": "n0-s0-i0"}))  # a message without a kind
    with pytest.raises(ProtocolError, match=r"'exit' has fields \['worker'\], expected"):
        decode(json.dumps({"kind": "exit", "worker": "n0-s0-i0"}))  # its code is missing
    with pytest.raises(ProtocolError, match=r"'stop' has fields \['now'\]"):
        decode(json.dumps({"kind": "stop", "now": 1}))


def test_silence_counts_only_while_the_store_answers(monkeypatch):
    """A beat counter that does not move is silent for the time since it last moved, except that a slow
    store call (the store was out: nobody could beat) starts every clock again."""
    now = [100.0]
    monkeypatch.setattr("torchpass_plugins.control.silence.time.monotonic", lambda: now[0])
    clocks = BeatClocks(timeout=4.0)
    assert clocks.silent_for("w", 3) == 0.0
    now[0] += 1.5
    with clocks.store_call():
        now[0] += 1.0  # a normal call, under half the timeout
    assert clocks.silent_for("w", 3) == 2.5
    assert clocks.silent_for("v", 1) == 0.0
    with clocks.store_call():
        now[0] += 3.0  # the store was out for longer than half the timeout
    assert clocks.silent_for("w", 3) == 0.0 and clocks.silent_for("v", 1) == 0.0
    now[0] += 5.0
    assert clocks.silent_for("w", 3) == 5.0 and clocks.silent_for("w", 4) == 0.0


def test_a_job_that_may_borrow_waits_for_its_own_refill_first_then_borrows_then_gives_up():
    borrowing = Policy(restarts_left=1, spare_wait_s=20.0, borrow=True, borrow_wait_s=50.0)
    assert borrowing.ranks_lost([1], 1, training_complete=False).action is A.REPLACE  # a spare of its own
    assert borrowing.ranks_lost([1], 0, training_complete=False).action is A.WAIT  # its refill, on its way
    assert borrowing.spares_not_refilled([1], 0, borrowed=False).action is A.BORROW  # no refill in time
    late = borrowing.spares_not_refilled([1], 0, borrowed=True)
    assert late.action is A.RESTART and "(none joined within 50 s)" in late.why
    no_refill = Policy(refill=False, borrow=True, borrow_wait_s=50.0)
    assert no_refill.ranks_lost([1], 0, training_complete=False).action is A.BORROW  # at once


def test_a_slot_whose_workers_keep_failing_before_joining_is_not_started_again():
    policy = Policy(refill=True)
    assert policy.worker_exited(1, job_done=False, device_healthy=True, failed_starts=2).action is A.REFILL
    stopped = policy.worker_exited(1, job_done=False, device_healthy=True, failed_starts=3)
    assert stopped.action is A.NOTHING and "its last 3 workers failed before joining the job" in stopped.why
