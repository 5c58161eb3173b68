"""The job's policy: what to do about what the detectors observed. Pure: no store, no process, no clock.

The mechanisms report observations and carry out the decision: the agent (a worker exited, a heartbeat or
a node's agent fell silent, a device reading was classified), the coordinator (a rank exited, ranks were
lost, a migration or straggler report, a stall verdict). Exit codes are interpreted here and nowhere else.

=====================================  =============================================================
observation                            decision
=====================================  =============================================================
worker exit, agent side                REJECTED: ABORT (this node stops); a failure while refill is on,
                                       the job runs, the device is healthy and the slot's last workers
                                       did not all fail before joining: REFILL; else NOTHING
rank exit, coordinator side            CONFIG_ERROR: ABORT; UNRECOVERABLE: give up (restartable);
                                       OK (not leaving for a migration): FINISHED; else REPLACE
exit of a worker not yet joined        CONFIG_ERROR, or an error before the job started: ABORT; else
                                       NOTHING
ranks lost in one batch                training complete: ABORT; more than spares: WAIT (refill on and
                                       a wait set), BORROW (--borrow) or give up (restartable); else
                                       REPLACE
no refilled spare in time              BORROW (--borrow, not yet asked), else give up (restartable)
give up (restartable)                  RESTART while restarts are left, else ABORT
migration request (health)             job over / unknown worker: NOTHING; a spare: RETIRE; a migration
                                       under way or no spare: REFUSE; else MIGRATE
straggler report                       MIGRATE if stragglers migrate, else WARN (already logged)
stall verdict                          the silent ranks: EVICT; none silent: give up (restartable)
heartbeat / node agent silent          longer than the heartbeat timeout: EVICT; else NOTHING
a node's worker joins                  its node's paths differ from the coordinator's: ABORT before
                                       the job starts, REFUSE (the worker) after; else NOTHING
link down past the grace               on the roster's path: REROUTE to the next path not failed yet;
                                       no such path, or another path: NOTHING
device findings (in order)             degraded: WARN; the first critical: MIGRATE, and stop there
=====================================  =============================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from torchpass_plugins.config import TimeoutConfig
from torchpass_plugins.control.protocol import ExitCode
from torchpass_plugins.health.watch import Finding


class Action(Enum):
    NOTHING = "nothing"
    WARN = "warn"  # log it, keep going
    MIGRATE = "migrate"  # move the rank to a reserved spare at an agreed step boundary
    RETIRE = "retire"  # a spare on a suspect device leaves the pool
    REFUSE = "refuse"  # a migration that cannot happen now: log why
    EVICT = "evict"  # write off a live but silent worker (or node): SIGKILL it, its ranks are lost
    FINISHED = "finished"  # the rank completed its work
    REPLACE = "replace"  # the rank is lost: a spare takes it (for a batch: the spares take them now)
    WAIT = "wait"  # more ranks lost than spares free: wait for refilled workers to join the pool
    BORROW = "borrow"  # more ranks lost than spares free: ask a lending job for devices, wait for their workers
    REFILL = "refill"  # start a fresh worker in the freed slot; it joins the spare pool
    REROUTE = "reroute"  # rebuild the same members' groups on another network path
    RESTART = "restart"  # restart every worker; the job resumes from its newest snapshot
    ABORT = "abort"  # stop the job with the message


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str = ""
    path: int | None = None  # REROUTE: the path to take


NOTHING = Decision(Action.NOTHING)
FAILED_STARTS = 3  # a slot whose workers failed this many times in a row before joining is not refilled


@dataclass(frozen=True)
class Policy:
    """The knobs of ``torchpass launch`` that decide, for one attempt of the job."""

    restarts_left: int = 0  # a failure no spare can fix restarts the job this many more times
    spare_wait_s: float = 0.0  # more ranks lost than spares free: wait this long for refilled workers
    refill: bool = True  # agents start a fresh worker in a failed worker's slot
    straggler_migrate: bool = False  # move a straggler to a spare (else only log it)
    heartbeat_timeout: float = TimeoutConfig.heartbeat_s  # silence after which a worker or node is written off
    paths: int = 1  # network paths between the nodes (``--interfaces``)
    borrow: bool = False  # more ranks lost than spares free (and none refilled in time): borrow lenders' devices
    borrow_wait_s: float = 0.0  # how long a borrowed device's worker may take to yield, start and join

    def give_up(self, message: str, restartable: bool) -> Decision:
        """A failure no spare can fix: restart while restarts are left, if a restart can get past it."""
        return Decision(Action.RESTART if restartable and self.restarts_left > 0 else Action.ABORT, message)

    # -- exits --------------------------------------------------------------------------------------
    def worker_exited(self, code: int, *, job_done: bool, device_healthy: bool, failed_starts: int = 0) -> Decision:
        """The agent saw one of its workers exit; ``failed_starts``: how many of the slot's workers in a row
        failed before joining the job (a slot whose script keeps failing so is not started again)."""
        if code == ExitCode.REJECTED:
            return Decision(Action.ABORT, "the coordinator refused this node's worker (see its output)")
        if code in (ExitCode.OK, ExitCode.CONFIG_ERROR, ExitCode.UNRECOVERABLE):
            return NOTHING  # done, or the job stops (or restarts every worker) anyway
        if failed_starts >= FAILED_STARTS:
            return Decision(Action.NOTHING, f"its last {failed_starts} workers failed before joining the job: the "
                                            "slot is not started again (see their output)")
        return Decision(Action.REFILL) if self.refill and not job_done and device_healthy else NOTHING

    def unjoined_exited(self, code: int, worker: str, *, started: bool) -> Decision:
        """A worker that had not joined the job exited; ``started``: the job's first roster is out. Its script
        failed before building a torchpass strategy or ``TorchPass()``: a configuration error (every worker
        repeats it), or before the job started, any error of its own (every worker runs the same script; its
        agent would otherwise start it again and again). Killed by a signal, or later: its agent's refill."""
        if code == ExitCode.CONFIG_ERROR:
            return Decision(Action.ABORT, f"worker {worker} stopped on a configuration error before joining the "
                                          "job; see its output")
        if code > 0 and not started:
            return Decision(Action.ABORT, f"worker {worker} exited with code {code} before the job started: its "
                                          "script failed before joining it (see its output), as every worker's would")
        return NOTHING

    def rank_exited(self, code: int, worker: str, rank: int, *, migrating: bool, request: str | None) -> Decision:
        """The worker of logical rank ``rank`` exited; ``request``: its own message (``abort_request_key``),
        ``migrating``: it left for a planned migration that could not happen (its spare was lost)."""
        if code == ExitCode.CONFIG_ERROR:  # a mistake every worker would repeat: no spare, no restart
            return Decision(Action.ABORT, request or f"worker {worker} (logical rank {rank}) stopped on a "
                                                     "configuration error; see its output")
        if code == ExitCode.UNRECOVERABLE:
            return self.give_up(request or f"worker {worker} (logical rank {rank}) found the lost state "
                                           "unrecoverable; see its output", restartable=True)
        if code == ExitCode.OK and not migrating:
            return Decision(Action.FINISHED)
        return Decision(Action.REPLACE)

    def ranks_lost(self, lost: list[int], spares: int, *, training_complete: bool) -> Decision:
        """The ranks lost so far (one batch of reports, and those still waiting for a spare)."""
        if training_complete:
            # Every rank had passed the barrier that ends training: nothing to recover, nothing to
            # recompute, but what the lost worker's script had left to do after ``fit`` is lost.
            return Decision(Action.ABORT, f"rank(s) {lost} failed after training had completed on every rank (in "
                                          "the script's code after fit, or at exit); the job is not restarted")
        if len(lost) <= spares:
            return Decision(Action.REPLACE)
        if self.refill and self.spare_wait_s > 0:  # a refill is a spare on its way: no lender disturbed for it
            return Decision(Action.WAIT, f"{len(lost)} rank(s) lost, {spares} spare(s) free")
        if self.borrow:
            return Decision(Action.BORROW, f"{len(lost)} rank(s) lost, {spares} spare(s) free")
        return self._too_few_spares(lost, spares, "")

    def spares_not_refilled(self, lost: list[int], spares: int, *, borrowed: bool) -> Decision:
        """The wait for refilled workers (``borrowed``: then for borrowed ones) ended with ranks still lacking a
        spare: borrow, if this job may and has not yet, else give up."""
        if self.borrow and not borrowed:
            return Decision(Action.BORROW, f"no refilled worker joined within {self.spare_wait_s:g} s")
        wait = self.borrow_wait_s if borrowed else self.spare_wait_s
        return self._too_few_spares(lost, spares, f" (none joined within {wait:g} s)")

    def _too_few_spares(self, lost: list[int], spares: int, waited: str) -> Decision:
        return self.give_up(
            f"{len(lost)} worker(s) lost (logical rank(s) {lost}) but {spares} spare(s) left{waited}: "
            "the job cannot continue without recomputation. Relaunch with more --spares, or resume "
            "from the newest snapshot.",
            restartable=True,
        )

    # -- requests to move a rank ---------------------------------------------------------------------
    def migration_requested(self, *, job_over: bool, is_spare: bool, is_rank: bool, moving: bool,
                            spares: int) -> Decision:
        """A health watch asks to move a worker off its device."""
        if job_over or not (is_spare or is_rank):
            return NOTHING
        if is_spare:
            return Decision(Action.RETIRE)
        if moving:
            return Decision(Action.REFUSE, "another migration is in progress")
        if not spares:
            return Decision(Action.REFUSE, "no spare left")
        return Decision(Action.MIGRATE)

    def straggler(self, why: str) -> Decision:
        """The ranks judged a rank a straggler (rank 0 has logged the verdict)."""
        return Decision(Action.MIGRATE if self.straggler_migrate else Action.WARN, why)

    def stall_verdict(self, gen: int, silent: list[str]) -> Decision:
        """Collectives of generation ``gen`` timed out; ``silent``: the working ranks' workers that did not
        report a timeout within the grace (alive, but not in the collective the others wait in)."""
        if not silent:
            return self.give_up(f"every rank's collective timed out in generation {gen}, none of them was lost: "
                                "a collective that not all ranks issue, or a network fault", restartable=True)
        return Decision(Action.EVICT, f"stalled the collectives of generation {gen}: alive, but not in them when "
                                      "the others timed out")

    def link_down(self, path: int, current: int, failed: set[int]) -> Decision:
        """An agent reached another node over ``path`` for longer than the grace, and over another path still;
        ``current``: the roster's path, ``failed``: the paths left for good so far."""
        if path != current:
            return NOTHING  # a path the job no longer uses (another agent reported the same failure first)
        left = [p for p in (*range(current + 1, self.paths), *range(current)) if p not in failed | {path}]
        if not left:
            return Decision(Action.NOTHING, f"path {path} failed and no other path is left")
        return Decision(Action.REROUTE, f"path {path} failed", path=left[0])

    def node_paths(self, node: int, paths: int, *, started: bool) -> Decision:
        """A worker of ``node``, whose agent has ``paths`` network paths, joins. Every node needs this (the
        coordinating) node's count: a reroute moves every collective to path ``p`` at once. Before the job
        starts: ABORT, a launch mistake that no spare or restart fixes; a spare of a node that joins later
        (a replacement node): REFUSE it, the job goes on without that node."""
        if paths == self.paths:
            return NOTHING
        why = (f"node {node} has {paths} network path(s) (--interfaces), the coordinating node has {self.paths}: "
               "give every node the same interfaces, in the same order")
        return Decision(Action.REFUSE if started else Action.ABORT, why)

    # -- detectors ------------------------------------------------------------------------------------
    def silence(self, silent_s: float) -> Decision:
        """A worker's heartbeat, or the agent of another node, has not moved for ``silent_s``."""
        if silent_s > self.heartbeat_timeout:
            return Decision(Action.EVICT, f"silent for {silent_s:.1f} s")
        return NOTHING

    def device_findings(self, findings: Iterable[Finding]) -> list[Decision]:
        """What a device's findings call for, in order: the first critical one moves its worker away."""
        out = []
        for finding in findings:
            if finding.severity == "critical":
                out.append(Decision(Action.MIGRATE, finding.why))
                break
            out.append(Decision(Action.WARN, finding.why))
        return out
