"""``torchpass_fsdp``'s commit: the step's gradient logged at the ring successor, then the vote.

Just before the optimizer applies a step (every collective of the step is done: the reduction, the loss
scaler's check, gradient clipping), each rank hands its ring successor what the optimizer applies to its
shard and its own state (:mod:`torchpass_plugins.core.gradient_log`), then all vote in one small all-reduce
that also carries the step signals. A rank that finished the vote knows every successor holds the step's
gradient, so a failure never costs a step some survivor applied: the successor replays it on its replica.
At each boundary a rank hands its successor its own state again, with what ran after the optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from torchpass_plugins._compat.lightning import forget_unscaled
from torchpass_plugins.core.gradient_log import applied_gradient, hyperparameters, replay
from torchpass_plugins.core.process_group import PeerFailure
from torchpass_plugins.core.state_transfer import unpack
from torchpass_plugins.core.training_state import MODEL, OPTIMIZER, OWN, OptimizerState
from torchpass_plugins.integrations.lightning.step_replay import StepDiscarded
from torchpass_plugins.testing import faults


def closure_first(optimizer: Optimizer) -> None:
    """Make ``optimizer.step(closure)`` evaluate the closure before the step's hooks run rather than within
    the step, after them: Lightning's closure holds the forward, the backward and gradient clipping, and the
    commit (a step pre-hook) must see the gradient the optimizer applies. Loss scalers already call the
    closure first and step without one."""
    stepping = optimizer.step  # (wrapped already by an LR scheduler, which counts the calls)

    def step(closure=None, **kwargs):
        if closure is None:
            return stepping(**kwargs)
        with torch.enable_grad():
            loss = closure()
        stepping(**kwargs)
        return loss

    optimizer.step = step


class LoggedCommit:
    """The commit and the ring copies of ``torchpass_fsdp`` (mixed into ``TorchPassFSDPStrategy``, whose
    ``ring_copies``, ``replicator``, ``sharded``, ``relay``, ``logged_names`` and recovery it uses)."""

    def _copy_own_state(self, step: int) -> None:
        """Keep this rank's own state of boundary ``step`` (a retried step starts again from it) and hand it
        to the ring successor (with what ran after the last optimizer step: validation, an epoch's end), the
        first message of the step. With replication off only a planned migration at this boundary can use
        the successor's copy: a lost rank stops the job."""
        self.sharded.own[step] = own = self.sharded.state_dict()
        if not self.replicator.every and self.runtime.drain_due(step) is None:
            return
        try:
            self.ring_copies.exchange(self.runtime.transport, "boundary", step, own)
        except PeerFailure as exc:
            self.relay.poisoned = str(exc)

    def _commit(self, optimizer: Optimizer, stepped: bool) -> None:
        """Just before ``optimizer`` applies the step (every collective of the step is done): hand the ring
        successor what it applies to this rank's shard and this rank's own state, then vote (the vote
        carries the step signals). A failure meanwhile is recovered here: the step is applied if some
        survivor applied it (every shard's gradient of it is then logged), else discarded and run again."""
        if self._committed:
            return
        self._committed, step, rt = True, self.runtime.last_boundary, self.runtime
        failure = self._failure()  # a collective after the reduction (unscaling, clipping) failed
        if failure is None:
            self.committing = True
            try:
                if self.replicator.every:  # else no copy of this rank could be used: a lost rank stops the job
                    self.ring_copies.exchange(rt.transport, "vote", step, self._log_entry(optimizer, stepped),
                                              keep_votes_from=self.replicator.successor_replays_from())
                faults.point("commit")
                vote = rt.signals.row()
                rt.transport.all_reduce(vote, what="commit vote")
                rt.signals.take(vote, step, drain_at=step + 1)
            except PeerFailure as exc:
                failure = self.relay.poisoned = str(exc)
        try:
            if failure is not None and self._recover(failure) != step + 1:
                self._discard_step()
        finally:
            self.committing = False

    def _log_entry(self, optimizer: Optimizer, stepped: bool) -> dict[str, Any]:
        """What the ring successor logs of this step: this rank's own state, and what the optimizer applies
        to its shard (no gradients where a loss scaler skips the step)."""
        if self.logged_names is None:  # fixed once the model is sharded: not looked up every step
            names = OptimizerState(self.lightning_module, self.optimizers).names
            self.logged_names = names, self.sharded.skipped_parameters()
        step = (applied_gradient(optimizer, *self.logged_names) if stepped
                else {"grads": None, "groups": hyperparameters(optimizer)})
        return {"own": self.sharded.state_dict(), "step": step}

    def _discard_step(self) -> None:
        """The recovery restored the boundary of the step being committed: it is run again from there (the
        precision plugin's state as before the step, as if it had never run)."""
        self.precision_plugin.load_state_dict(self._precision_before)
        forget_unscaled(self.precision_plugin)
        raise StepDiscarded("the step is run again from its boundary")

    def predecessor_shard(self, step: int) -> tuple[dict[str, Any], int]:
        """The ring predecessor's shard state and own state as of boundary ``step``: its newest replica at or
        before ``step`` with the logged steps since replayed; and how many steps were replayed."""
        start = max(s for s in self.replicator.replicas if s <= step)
        packed = self.replicator.replicas[start]
        logged = [self.ring_copies.get("vote", s)["step"] for s in range(start, step)]
        shard = unpack(packed.meta, packed.payload)
        if logged:
            shard = replay(shard, logged, self.optimizers[0])
        kind, own = self.ring_copies.for_entry(step)
        own_state = own["own"] if kind == "vote" else own  # a vote copy carries the step's gradient too
        return {MODEL: shard[MODEL], OPTIMIZER: shard[OPTIMIZER], OWN: own_state}, step - start

