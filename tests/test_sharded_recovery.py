"""The restore-step decision of fully sharded recovery, and the replay of a step's batches."""

from __future__ import annotations

import copy

import pytest
import torch

from torchpass_plugins.control.membership import Unrecoverable
from torchpass_plugins.core.sharded_recovery import ShardAgreement, ShardRow
from torchpass_plugins.core.training_state import MODEL, OPTIMIZER, ModelState, OptimizerState, capture
from torchpass_plugins.integrations.lightning.step_replay import ReplayFetcher

SPARE = ShardRow(spare=True)


def at(step: int, own=(), replicas=(), applied: int | None = None) -> ShardRow:
    """A survivor whose last boundary is ``step`` (and that has applied ``applied`` steps, default ``step``)."""
    return ShardRow(False, step if applied is None else applied, step, tuple(own), tuple(replicas))


def test_rows_survive_the_wire():
    for row in (SPARE, at(9, own=(8, 9), replicas=(9,)), at(3, applied=4)):
        assert ShardRow.from_tensor(row.to_tensor()) == row


def test_a_failure_after_the_fence_restores_the_step_in_flight():
    rows = [at(5, own=(4, 5), replicas=(4, 5)), SPARE, at(5, own=(4, 5), replicas=(4, 5))]
    a = ShardAgreement.decide(rows)
    assert (a.restore_step, a.lost_steps, a.sources, a.donor) == (5, 0, {1: 2}, 0)


def test_an_older_replica_rolls_every_rank_back():
    # Replicated every 4 steps: the lost rank's shard exists only for steps 0 and 4.
    rows = [at(6, own=(0, 4), replicas=(0, 4)), SPARE, at(6, own=(0, 4), replicas=(0, 4))]
    a = ShardAgreement.decide(rows)
    assert (a.restore_step, a.lost_steps) == (4, 2)


def test_a_survivor_that_applied_the_step_rolls_back_with_the_others():
    # Rank 0 applied step 5 before the failure reached it; rank 2 discarded it.
    rows = [at(5, own=(4, 5), replicas=(4, 5), applied=6), SPARE, at(5, own=(4, 5), replicas=(4, 5))]
    a = ShardAgreement.decide(rows)
    assert (a.restore_step, a.lost_steps) == (5, 1)


def test_a_rank_lost_with_its_ring_successor_is_unrecoverable():
    with pytest.raises(Unrecoverable, match="rank 1 and its replica holder, rank 2, were lost together"):
        ShardAgreement.decide([at(5, own=(5,), replicas=(5,)), SPARE, SPARE])


def test_no_common_step_is_unrecoverable():
    with pytest.raises(Unrecoverable, match="no step is held by every rank"):
        ShardAgreement.decide([at(5, own=(5,), replicas=(5,)), SPARE, at(5, own=(5,), replicas=())])


class _Fetcher:
    """The parts of Lightning's data fetcher that the epoch loop uses."""

    def __init__(self, n: int) -> None:
        self.items, self.fetched = list(range(n)), 0

    def __next__(self):
        if not self.items:
            raise StopIteration
        self.fetched += 1
        return self.items.pop(0)

    @property
    def done(self) -> bool:
        return not self.items


def test_replay_hands_out_the_batches_of_a_step_again():
    wrapped = _Fetcher(6)
    fetcher = ReplayFetcher(wrapped, first_tag=0)
    taken = []
    for step in range(3):
        fetcher.tag = step
        taken += [next(fetcher), next(fetcher)]  # two micro-batches per step
    assert taken == [0, 1, 2, 3, 4, 5] and fetcher.done
    fetcher.rewind(1)
    assert [next(fetcher) for _ in range(4)] == [2, 3, 4, 5]
    assert fetcher.done
    fetcher.fetched = 7  # attributes other than next/done are the wrapped fetcher's
    assert wrapped.fetched == 7


def test_replay_refuses_steps_it_no_longer_holds():
    fetcher = ReplayFetcher(_Fetcher(6), first_tag=0)
    for step in range(3):
        fetcher.tag = step
        next(fetcher)
    fetcher.forget_before(2)
    with pytest.raises(Unrecoverable, match="batches are not held any more"):
        fetcher.rewind(1)
    fetcher.rewind(2)
    assert next(fetcher) == 2


def test_rolling_back_to_before_the_first_step_drops_the_optimizer_state_taken_since():
    # Found by the chaos matrix (seed 0, #27): a rollback to step 0 kept AdamW's moments of the rolled-back
    # steps, because the captured state had none to overwrite them with; the replay then diverged.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    parts = {MODEL: ModelState(model, buffers=False), OPTIMIZER: OptimizerState(model, [optimizer])}
    at_start = copy.deepcopy(capture(parts))
    assert at_start[OPTIMIZER]["state"] == {}
    step()
    after_one = copy.deepcopy(model.state_dict())
    step()
    for name, part in parts.items():
        part.load_state_dict(at_start[name])
    assert not optimizer.state
    step()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, after_one[name]), name
