"""The restore-step decision of fully sharded recovery, the replay of logged gradients on a replica, and
the replay of a step's batches."""

from __future__ import annotations

import copy

import pytest
import torch

from torchpass_plugins.control.membership import Unrecoverable
from torchpass_plugins.core.gradient_log import applied_gradient, producible, replay, replay_refusal
from torchpass_plugins.core.sharded_recovery import NONE, ShardAgreement, ShardRow
from torchpass_plugins.core.state_transfer import pack, unpack
from torchpass_plugins.core.training_state import MODEL, OPTIMIZER, ModelState, OptimizerState, capture
from torchpass_plugins.integrations.lightning.step_replay import ReplayFetcher

SPARE = ShardRow(spare=True)


def at(step: int, own=(), predecessor=(NONE, NONE), applied: int | None = None, pending=False) -> ShardRow:
    """A survivor whose last boundary is ``step`` (and that has applied ``applied`` steps, default ``step``),
    that can bring its predecessor's shard to the boundaries ``predecessor`` spans."""
    return ShardRow(False, step if applied is None else applied, step, pending, tuple(own), predecessor)


def test_rows_survive_the_wire():
    for row in (SPARE, at(9, own=(8, 9), predecessor=(8, 9)), at(3, applied=4), at(3, pending=True)):
        assert ShardRow.from_tensor(row.to_tensor()) == row


def test_a_failure_in_a_step_restores_its_boundary():
    rows = [at(5, own=(4, 5), predecessor=(4, 5)), SPARE, at(5, own=(4, 5), predecessor=(4, 5))]
    a = ShardAgreement.decide(rows)
    assert (a.restore_step, a.lost_steps, a.sources, a.donor) == (5, 0, {1: 2}, 0)


def test_logged_steps_bring_an_older_replica_to_the_step_in_flight():
    # Replicated every 4 steps: the successor holds rank 1's replica of step 4 and the gradients of 4 and 5.
    rows = [at(6, own=(0, 4), predecessor=(0, 6)), SPARE, at(6, own=(0, 4), predecessor=(4, 6))]
    a = ShardAgreement.decide(rows)
    assert (a.restore_step, a.lost_steps) == (6, 0)


def test_a_step_some_survivor_applied_is_applied_by_those_in_its_commit():
    # Rank 0 finished step 5's vote and applied it; rank 2 was still in the vote when rank 1 died. Rank 1's
    # gradient of step 5 reached rank 2 before the vote (a finished vote implies it).
    rows = [at(6, own=(4, 5), predecessor=(4, 6)), SPARE, at(5, own=(4, 5), predecessor=(4, 6), pending=True)]
    a = ShardAgreement.decide(rows)
    assert (a.restore_step, a.lost_steps, a.donor) == (6, 0, 0)  # the donor is at that boundary


def test_a_step_nobody_applied_is_run_again_even_when_it_could_be_applied():
    rows = [at(5, own=(5,), predecessor=(5, 6), pending=True), SPARE, at(5, own=(5,), predecessor=(5, 6), pending=True)]
    assert ShardAgreement.decide(rows).restore_step == 5


def test_without_the_lost_ranks_gradient_the_applied_step_is_rolled_back():
    # Two failures in one step: the log did not reach the successor (possible only then).
    rows = [at(6, own=(4, 5), predecessor=(4, 6)), SPARE, at(6, own=(4, 5), predecessor=(4, 5))]
    a = ShardAgreement.decide(rows)
    assert (a.restore_step, a.lost_steps) == (5, 1)


def test_a_rank_lost_with_its_ring_successor_is_unrecoverable():
    with pytest.raises(Unrecoverable, match="rank 1 and its replica holder, rank 2, were lost together"):
        ShardAgreement.decide([at(5, own=(5,), predecessor=(5, 5)), SPARE, SPARE])


def test_no_common_step_is_unrecoverable():
    with pytest.raises(Unrecoverable, match="no step is held by every rank"):
        ShardAgreement.decide([at(5, own=(5,), predecessor=(5, 5)), SPARE, at(5, own=(5,))])


def test_the_successor_reaches_every_boundary_its_log_covers():
    assert producible([], {3, 4}) is None
    assert producible([4], set()) == (4, 4)
    assert producible([0, 4], {0, 1, 2, 3, 4, 5}) == (0, 6)
    assert producible([0, 4], {4}) == (4, 5)  # the log of the older round was dropped


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    lambda ps: torch.optim.SGD([{"params": ps[:1], "lr": 0.1}, {"params": ps[1:], "lr": 0.01}], momentum=0.9),
])
def test_replaying_logged_gradients_on_a_replica_is_the_live_optimizer_bit_for_bit(make):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = make(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    parts = {MODEL: ModelState(model, buffers=False), OPTIMIZER: OptimizerState(model, [optimizer])}
    names = parts[OPTIMIZER].names
    replica, logged = None, []
    for step in range(5):
        if step == 2:
            replica = copy.deepcopy(capture(parts))
        optimizer.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        if step >= 2:
            logged.append(unpack(*pack(applied_gradient(optimizer, names, frozenset()))))  # as the holder gets it
        optimizer.step()
        scheduler.step()  # changes the learning rate between steps: the log carries each step's
    replayed = replay(replica, logged, optimizer)
    live = capture(parts)
    for name, tensor in live[MODEL].items():
        assert torch.equal(replayed[MODEL][name], tensor), name
    for name, state in live[OPTIMIZER]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(replayed[OPTIMIZER]["state"][name][key]), torch.as_tensor(value))
    # (its hyperparameters are those of the last step: the donor's boundary ones replace them)


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


def test_an_optimizer_the_log_cannot_replay_is_named_with_the_fix():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert replay_refusal(torch.optim.AdamW(params), scaled=True) is None
    assert replay_refusal(torch.optim.AdamW(params, fused=True), scaled=False) is None  # no loss scale to miss
    why = replay_refusal(torch.optim.AdamW(params, fused=True), scaled=True)
    assert "AdamW(fused=True)" in why and "AdamW(fused=False)" in why
    assert "capturable" in replay_refusal(torch.optim.Adam(params, capturable=True), scaled=False)
    assert "differentiable" in replay_refusal(torch.optim.SGD(params, lr=0.1, differentiable=True), scaled=False)


def test_only_steps_that_are_elementwise_within_a_tensor_are_replayed_on_a_shard():
    params = [torch.nn.Parameter(torch.zeros(4, 4))]

    class LoggingAdamW(torch.optim.AdamW):  # keeps AdamW's step
        pass

    class NormedAdamW(torch.optim.AdamW):  # its own step: may look at the whole parameter
        def step(self, closure=None):
            return super().step(closure)

    assert replay_refusal(LoggingAdamW(params), scaled=False) is None
    LoggingAdamW(params).step()  # torch wraps the class's step in a hook on the first instance
    assert replay_refusal(LoggingAdamW(params), scaled=False) is None
    for optimizer in (NormedAdamW(params), torch.optim.Adafactor(params), torch.optim.LBFGS(params)):
        why = replay_refusal(optimizer, scaled=False)
        assert why is not None and f"{type(optimizer).__name__}'s step is not one" in why and "AdamW" in why
