"""The recovery engine in one process: a job of :class:`Runtime` s, one thread per worker, over the fakes of
``fake_engine``, against a failure-free run of the same job. Each failure must leave every logical rank
bit-equal to the failure-free run (weights, optimizer state, its rank-local state), with every step applied
once per rank, and the protocol must take the path its rules prescribe (retry, commit, replay)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fake_engine
import pytest
import torch
from fake_engine import Cut, Job, Kill, Republish, Worker
from torch import nn

from torchpass_plugins.core import rng
from torchpass_plugins.core.grad_buckets import GradientBuckets
from torchpass_plugins.core.interfaces import Phase
from torchpass_plugins.core.runtime import Runtime
from torchpass_plugins.core.training_state import OWN, TRAINER
from torchpass_plugins.testing import faults

STEPS, WORLD, SEED, DIM = 6, 3, 7, 4


class _Part:
    """A part of the training state (``Stateful``) read and written by two functions."""

    def __init__(self, read: Callable[[], Any], write: Callable[[Any], None]) -> None:
        self.state_dict, self.load_state_dict = read, write


class Trainer:
    """The framework side of one worker (the runtime's ``Adapter``) and its training loop: a linear model,
    SGD with momentum (by hand: ``torch.optim``'s first step imports for seconds), a collective in the
    forward pass that the gradient depends on, the real gradient buckets, and a running loss that only this
    rank holds (its rank state)."""

    def __init__(self, rt: Runtime, after_step: bool, phases: list[tuple[Any, Phase]]) -> None:
        self.rt, self.after_step = rt, after_step
        self.phases = phases  # (where, phase): after join, entry, each boundary
        self.w = nn.Parameter(torch.linspace(-1, 1, DIM, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.momentum = {"w": torch.zeros_like(self.w.detach()), "b": torch.zeros_like(self.b.detach())}
        self.buckets = GradientBuckets([self.w, self.b], rt.world_size, cap_bytes=DIM * 8)  # two buckets
        self.applied = 0
        self.applied_log: list[int] = []  # the steps this worker applied, in order
        self.loss_sum = torch.zeros((), dtype=torch.float64)

    def fit(self, steps: int) -> None:
        rt = self.rt
        while self.applied < steps:
            if rt.last_boundary != self.applied:
                rt.boundary(self.applied)
                self.phases.append((self.applied, rt.phase))
            self.train_step(self.applied)
        if rt.last_boundary != steps:
            rt.boundary(steps)
        rt.collective(lambda t: t.sync(), None)
        rt.training_complete(steps)

    def train_step(self, step: int) -> None:
        rt = self.rt
        gen = torch.Generator().manual_seed(rng.step_seed(rt.seed, rt.rank, step))
        x = torch.randn(8, DIM, generator=gen, dtype=torch.float64)
        y = torch.randn(8, generator=gen, dtype=torch.float64)

        def feature(t: Any) -> torch.Tensor:
            v = x.mean(0)
            t.all_reduce(v, what="feature")
            return v

        f = rt.collective(feature, None)
        self.buckets.overlap_with(rt.transport)
        self.w.grad = self.b.grad = None
        loss = ((x @ self.w + self.b + 0.1 * (f @ self.w) - y) ** 2).mean()
        loss.backward()
        self.loss_sum += loss.detach()
        rt.reduce_gradients(self.buckets)
        self.buckets.write_back()
        with torch.no_grad():
            for name, p in (("w", self.w), ("b", self.b)):
                p.sub_(self.momentum[name].mul_(0.9).add_(p.grad), alpha=0.05)
        self.applied += 1
        self.applied_log.append(step)
        faults.point("optimizer")
        if self.after_step:  # e.g. a logged metric synchronized after the optimizer step
            rt.collective(lambda t: t.all_reduce(loss.detach().reshape(1), what="metric"), None)

    # -- the runtime's Adapter --------------------------------------------------------------------------
    def applied_steps(self) -> int:
        return self.applied

    def boundary_snapshot(self) -> int:
        return self.applied

    def training_state(self) -> dict[str, _Part]:
        return {
            "weights": _Part(lambda: {"w": self.w.detach(), "b": self.b.detach(), "momentum": self.momentum},
                             self._load_weights),
            TRAINER: _Part(lambda: {"applied": self.applied}, lambda s: setattr(self, "applied", s["applied"])),
            OWN: _Part(lambda: {"loss_sum": self.loss_sum.clone()},
                       lambda s: setattr(self, "loss_sum", s["loss_sum"].clone())),
        }

    def _load_weights(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
            self.b.copy_(state["b"])
        self.momentum = state["momentum"]

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.w.detach(), self.b.detach()]

    def load_state(self, values: dict[str, Any]) -> None:
        for name, part in self.training_state().items():
            if name != OWN:
                part.load_state_dict(values[name])

    def final(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.detach(), "b": self.b.detach(), "momentum_w": self.momentum["w"],
                "momentum_b": self.momentum["b"], "loss_sum": self.loss_sum}


def run_job(*scripted: Any, spares: int = 1, after_step: bool = False) -> Job:
    """A job of ``WORLD`` ranks and ``spares`` spares training for ``STEPS`` steps, with the ``scripted`` faults."""

    def train(rt: Runtime, w: Worker) -> None:
        w.trainer = rt.adapter = Trainer(rt, after_step, w.phases)
        if rt.is_spare:
            rt.enter_as_spare()
            w.phases.append(("entered", rt.phase))
        w.trainer.fit(STEPS)

    return fake_engine.run_job(train, WORLD, spares, list(scripted), SEED)


@pytest.fixture(scope="module")
def reference() -> dict[int, dict[str, torch.Tensor]]:
    job = run_job(spares=0)
    return {rank: w.trainer.final() for rank, w in job.at_rank().items()}


def assert_like_reference(job: Job, reference: dict[int, dict[str, torch.Tensor]], rank_state_lost: int = -1) -> None:
    """Every logical rank ends bit-equal to the failure-free run, each of its steps applied exactly once
    (but for the rank-local state of rank ``rank_state_lost``, which started over)."""
    ranks = job.at_rank()
    assert sorted(ranks) == list(range(WORLD)), {w.name: w.outcome for w in job.workers.values()}
    for rank, w in ranks.items():
        for name, expected in reference[rank].items():
            if (rank, name) == (rank_state_lost, "loss_sum"):
                assert not torch.equal(w.trainer.final()[name], expected), "the rank state was not lost"
                continue
            assert torch.equal(w.trainer.final()[name], expected), f"rank {rank} ({w.name}): {name} differs"
        log = w.trainer.applied_log
        assert log == list(range(STEPS - len(log), STEPS)), f"rank {rank} ({w.name}) applied {log}"


@pytest.mark.timeout(60)
def test_a_failure_free_run_recovers_nothing(reference):
    job = run_job(spares=1)
    assert_like_reference(job, reference)
    assert all(w.trainer.applied_log == list(range(STEPS)) for w in job.at_rank().values())
    assert job.workers["w3"].outcome == "released"
    assert job.events("recovered") == [] and job.world.latest_gen == 0
    # the ranks differ (their data), so the comparison with the reference can fail
    assert not torch.equal(reference[0]["loss_sum"], reference[1]["loss_sum"])


def _spare(job: Job) -> Worker:
    (spare,) = [w for w in job.at_rank().values() if w.name == "w3"]
    return spare


def _recovered(job: Job) -> dict[str, dict[str, Any]]:
    """Each worker's ``transport_rebuilt`` event (the decision it took), by worker."""
    rebuilt = job.events("transport_rebuilt")
    assert len({e["source"] for e in rebuilt}) == len(rebuilt), rebuilt  # one recovery each
    return {e["source"]: e for e in rebuilt}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["boundary", "reduce", "commit", "optimizer"])
@pytest.mark.parametrize("dead", range(WORLD))
def test_a_rank_lost_anywhere_in_a_step_changes_no_result(reference, dead, phase):
    job = run_job(Kill(dead, 2, phase))
    assert_like_reference(job, reference)
    assert _spare(job).rt.rank == dead
    entry = 3 if phase == "optimizer" else 2  # it had applied step 2: every survivor had finished its vote
    assert {e["entry_step"] for e in job.events("transport_rebuilt")} == {entry}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dead", range(WORLD))
def test_a_rank_lost_in_the_gradient_reduction_is_retried_by_all(reference, dead):
    job = run_job(Kill(dead, 3, "reduce"))
    assert_like_reference(job, reference)
    spare = _spare(job)
    assert spare.rt.rank == dead and spare.trainer.applied_log == [3, 4, 5]  # it recomputed step 3
    decisions = _recovered(job)
    assert set(decisions) == {f"w{r}" for r in range(WORLD) if r != dead} | {"w3"}
    for worker, e in decisions.items():
        assert (e["entry_step"], e["committed"], e["spares"]) == (3, False, [dead]), worker
    for rank in set(range(WORLD)) - {dead}:  # the survivors reduced step 3 twice, and applied it once
        assert job.tries(f"w{rank}", 3, "allreduce") == 4  # two buckets, two generations
        retry = decisions[f"w{rank}"]["gen"]  # (the vote the lost rank broke may have been tried before it)
        assert job.tries(f"w{rank}", 3, "commit vote", gen=retry) == 1
    assert job.tries("w3", 3, "feature") == 0  # replayed from the survivor ahead: not run again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dead", range(WORLD))
def test_a_vote_one_survivor_finished_commits_the_step_for_all(reference, dead):
    ahead, behind = sorted(set(range(WORLD)) - {dead})
    job = run_job(Cut(dead, 2, "commit vote", delivered=(ahead,)))
    assert_like_reference(job, reference)
    spare = _spare(job)
    assert spare.trainer.applied_log == [3, 4, 5]  # it enters after step 2, which the survivors applied
    decisions = _recovered(job)
    assert decisions[f"w{behind}"]["committed"] and not decisions[f"w{ahead}"]["committed"]
    assert {(e["entry_step"], e["donor"]) for e in decisions.values()} == {(3, ahead)}
    for rank in (ahead, behind):  # nothing reduced or voted on again: the survivor behind took the vote's result
        assert job.tries(f"w{rank}", 2, "allreduce") == 2
        assert job.tries(f"w{rank}", 2, "commit vote") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dead", range(WORLD))
def test_a_collective_one_survivor_completed_is_replayed_to_the_others(reference, dead):
    ahead, behind = sorted(set(range(WORLD)) - {dead})
    job = run_job(Cut(dead, 4, "feature", delivered=(ahead,)))
    assert_like_reference(job, reference)
    spare = _spare(job)
    assert spare.trainer.applied_log == [4, 5]
    for worker in (f"w{ahead}", f"w{behind}"):
        assert job.tries(worker, 4, "feature") == 1  # the survivor behind did not run it again
    assert job.tries("w3", 4, "feature") == 0  # nor did the spare, which replays step 4
    assert job.tries("w3", 4, "allreduce") == 2  # but it reduces its gradient with the others
    decisions = _recovered(job)
    assert {tuple(e["target"]) for e in decisions.values()} == {(4, 2)}  # the reduction after the feature


@pytest.mark.timeout(60)
def test_a_newer_roster_while_ranks_wait_in_a_collective_makes_them_rebuild(reference):
    job = run_job(Republish(2, "commit vote", posted=2), spares=0)
    assert_like_reference(job, reference)
    assert job.world.latest_gen == 1
    decisions = _recovered(job)
    assert set(decisions) == {"w0", "w1", "w2"}
    assert all(e["gen"] == 1 and e["spares"] == [] and not e["committed"] for e in decisions.values())
    for rank in range(WORLD):  # no rank finished the vote: each retried the reduction and the vote, once
        assert job.tries(f"w{rank}", 2, "allreduce", gen=1) == 2
        assert job.tries(f"w{rank}", 2, "commit vote", gen=1) == 1
        assert job.tries(f"w{rank}", 3, "allreduce") == 2  # and went on in the new generation


@pytest.mark.timeout(60)
def test_a_promoted_spare_proves_itself_before_it_counts_as_active(reference):
    job = run_job(Kill(1, 2, "boundary"))
    assert_like_reference(job, reference)
    spare = _spare(job)
    assert spare.phases[:4] == [("joined", Phase.SPARE), ("entered", Phase.ENTERING), (2, Phase.PROVING),
                                (3, Phase.ACTIVE)]
    assert all(phase is Phase.ACTIVE for _, phase in spare.phases[4:])
    assert not spare.rt.unproven_spare


@pytest.mark.timeout(60)
def test_a_donor_lost_while_handing_over_starts_the_recovery_over_with_the_next_roster(reference):
    # rank 1 dies in step 3's reduction; rank 0, the donor, dies before sending the state to its spare
    job = run_job(Kill(1, 3, "reduce"), Kill(0, 3, "donor"), spares=2)
    # rank 0's running loss died with rank 0 and with rank 1, which held its copy: its spare starts it over
    assert_like_reference(job, reference, rank_state_lost=0)
    assert [(e["rank"], e["step"]) for e in job.events("rank_state_lost")] == [(0, 3)]
    assert job.world.latest_gen == 2
    assert {w.name for w in job.at_rank().values()} == {"w2", "w3", "w4"}
    donors = {e["donor"] for e in job.events("transport_rebuilt") if e["gen"] == 2}
    assert donors == {2}  # the one survivor hands the state to both spares


@pytest.mark.timeout(60)
def test_a_collective_after_the_optimizer_step_that_no_survivor_completed_stops_the_job():
    # A spare enters only at a step boundary: it cannot complete a collective of what ran after step 2.
    job = run_job(Cut(1, 2, "metric"), after_step=True)
    outcomes = {w.name: w.outcome for w in job.workers.values()}
    assert outcomes["w1"] == "killed"
    for worker in ("w0", "w2"):
        assert "lost after step 2's optimizer step" in outcomes[worker], outcomes
    assert outcomes["w3"].startswith("aborted: "), outcomes  # the spare leaves with the job
