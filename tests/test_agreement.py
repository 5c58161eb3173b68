"""The recovery decision (commit rule, entry boundary, target, donor) from the members' rows."""

from __future__ import annotations

import pytest

from torchpass_plugins.control.membership import JobAborted
from torchpass_plugins.core.replicated_recovery import Agreement, MemberState

SPARE = MemberState(spare=True, position=(-1, -1), applied=-1, last_boundary=-1, reduced=False, voted=False)


def member(step: int, count: int, applied: int, reduced: bool = False, voted: bool = False) -> MemberState:
    return MemberState(False, (step, count), applied, last_boundary=step, reduced=reduced or voted, voted=voted)


def test_rows_survive_the_wire():
    for row in (member(7, 3, 7, voted=True), member(2, 0, 2, reduced=True), SPARE):
        assert MemberState.from_tensor(row.to_tensor()) == row


def test_a_reduction_that_some_survivor_did_not_finish_is_retried():
    a = Agreement.decide([member(5, 2, 5, reduced=True), member(5, 2, 5), SPARE])
    assert a.committed == frozenset()
    assert (a.entry_step, a.target) == (5, (5, 2))
    assert a.spares == [2]
    assert a.immediate and a.donor == 0  # both still hold the state of boundary 5


def test_a_vote_no_survivor_finished_is_retried_even_if_all_reduced():
    # The dead rank may have finished the vote and applied the step: that state died with it.
    a = Agreement.decide([SPARE, member(5, 2, 5, reduced=True), member(5, 2, 5, reduced=True)])
    assert a.committed == frozenset()
    assert (a.entry_step, a.target) == (5, (5, 2))
    assert a.immediate and a.donor == 1


def test_a_finished_vote_commits_the_others_and_defers_the_handover():
    # Rank 0 finished the vote and then failed in a collective before its optimizer step.
    a = Agreement.decide([member(5, 3, 5, voted=True), member(5, 2, 5, reduced=True), SPARE])
    assert a.committed == frozenset({1})
    assert (a.entry_step, a.target) == (6, (6, 0))  # the spare enters after step 5 is applied
    assert not a.immediate and a.donor == 0


def test_a_rank_past_the_vote_commits_the_laggards_but_not_its_own_next_reduction():
    # Rank 0 applied step 5 and failed in the reduction of step 6; rank 1 was still in the vote of step 5.
    a = Agreement.decide([member(6, 1, 6), member(5, 1, 5, reduced=True), SPARE])
    assert a.committed == frozenset({1})
    assert a.entry_step == 6
    assert a.target == (6, 1)  # rank 1 skips up to rank 0's position; rank 0 retries its reduction
    assert a.immediate and a.donor == 0


def test_a_failure_after_an_optimizer_step_defers_the_state_to_the_next_boundary():
    # Both applied step 5 but have not reached boundary 6 yet (e.g. a sync_dist log after the step).
    after = MemberState(False, (5, 2), applied=6, last_boundary=5, reduced=False, voted=False)
    a = Agreement.decide([after, after, SPARE])
    assert a.committed == frozenset()
    assert (a.entry_step, a.target) == (6, (6, 0))
    assert not a.immediate and a.donor == 0


def test_a_vote_before_every_reduction_finished_is_a_loud_error():
    with pytest.raises(AssertionError, match="voted on before every rank reduced"):
        Agreement.decide([member(6, 1, 6), member(5, 1, 5), SPARE])


def test_no_survivor_aborts_the_job():
    with pytest.raises(JobAborted, match="resume from a snapshot"):
        Agreement.decide([SPARE, SPARE])
