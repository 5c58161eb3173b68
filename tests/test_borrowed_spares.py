"""Borrowed spares, with two real jobs on this machine: a job with no spare free borrows a device of a job
launched with ``--lend``; the lender gets it back and resumes from its snapshot; a lender that does not yield
in time leaves the borrower to its snapshot. Every job is compared with its failure-free run."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import STEPS, assert_bit_exact
from jobs import start

pytestmark = pytest.mark.timeout(300)


class Jobs:
    """A lending job started, its first snapshot written, and at most one borrowing job: both killed at the end."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path, self.registry, self.borrowing = tmp_path, tmp_path / "registry", None
        snapshots = ("--snapshot-dir", str(tmp_path / "lender-snapshots"), "--snapshot-every", "4",
                     "--snapshot-when-busy", "wait")
        self.lending = start(tmp_path / "lender", nproc=2, spares=0, launch_args=(
            "--lend", "--lend-registry", str(self.registry), "--spare-wait", "0"), train_args=(
            "--devices", "2", "--max-steps", str(STEPS), "--sleep-per-step", "1.0", *snapshots))

    def __enter__(self) -> Jobs:
        self.lending.wait_until(lambda: self.lending.events("snapshot_committed"), "the lender's first snapshot")
        return self

    def borrow(self, *launch_args: str, train_args: tuple[str, ...] = ()):
        """The borrowing job: it loses rank 1 at step 5, with no spare of its own."""
        self.borrowing = start(self.tmp_path / "borrower", nproc=2, spares=0, launch_args=(
            "--borrow", "--lend-registry", str(self.registry), *launch_args), train_args=(
            "--devices", "2", "--max-steps", str(STEPS), *train_args), faults="kill@rank=1,step=5,phase=reduce")
        return self.borrowing

    def __exit__(self, *exc) -> None:
        self.lending.kill()
        if self.borrowing is not None:
            self.borrowing.kill()


def assert_same_weights(job, ref) -> None:
    final, expected = job.final(), ref.final()
    assert final["global_step"] == STEPS and final["adam_steps"] == expected["adam_steps"]
    for name, tensor in expected["weights"].items():
        assert torch.equal(final["weights"][name], tensor), f"{name} differs from the failure-free run"


def assert_the_lender_got_its_slot_back_and_resumed(lending, lent, reference) -> None:
    assert lent == [0], lending.output()[-3000:]
    assert lending.events("slot_returned") and len(lending.events("job_restarting")) == 1
    assert lending.events("snapshot_resumed")
    assert_same_weights(lending, reference(2))
    assert lending.leftovers() == []


def test_a_job_with_no_spare_goes_on_bit_exact_on_a_borrowed_device_and_the_lender_resumes(tmp_path, reference):
    with Jobs(tmp_path) as jobs:
        borrowing = jobs.borrow("--no-refill")  # (its own slot is not started again)
        jobs.lending.wait_until(lambda: jobs.lending.events("slot_lent"), "the lender to yield a slot")
        jobs.lending.full_speed()
        borrowed, lent = borrowing.wait(), jobs.lending.wait()
    # The borrower: its lost rank 1 taken by a worker on the lender's device, every rank as without the failure.
    assert [e["node"] for e in borrowing.events("borrow_requested")] == [0]
    [loan] = borrowing.events("slot_borrowed")
    [slot_lent] = jobs.lending.events("slot_lent")
    assert loan["device"] == slot_lent["device"] and not borrowing.events("job_restarting")
    assert_bit_exact(borrowing, borrowed, reference(2), world=2)
    assert borrowing.events("slot_given_back")
    # The lender: it yielded a worker, waited for its slot, and resumed from its newest snapshot.
    assert_the_lender_got_its_slot_back_and_resumed(jobs.lending, lent, reference)


def test_a_lender_that_does_not_yield_in_time_leaves_the_borrower_to_its_snapshot(tmp_path, reference):
    with Jobs(tmp_path) as jobs:
        os.kill(jobs.lending.agents[0].pid, signal.SIGSTOP)  # its agent answers nothing
        snapshots = ("--snapshot-dir", str(tmp_path / "borrower-snapshots"), "--snapshot-every", "2",
                     "--snapshot-when-busy", "wait")
        borrowing = jobs.borrow("--no-refill", "--yield-timeout", "3", "--spare-wait", "2", train_args=snapshots)
        borrowed = borrowing.wait()
        os.kill(jobs.lending.agents[0].pid, signal.SIGCONT)
    assert borrowed == [0], borrowing.output()[-3000:]
    [failed] = borrowing.events("borrow_failed")
    assert failed["why"] == "no lender of this node yielded a device within 3 s"
    [restart] = borrowing.events("job_restarting")
    assert "none joined within 5 s" in restart["message"]
    resumed = {e["step"] for e in borrowing.events("snapshot_resumed")}
    assert len(resumed) == 1 and resumed <= {2, 4}, resumed  # the newest before the kill at step 5
    assert_same_weights(borrowing, reference(2))
    assert borrowing.leftovers() == []
