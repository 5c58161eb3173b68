"""An Accelerate script without TorchPass's four lines, under ``torchpass launch --protect``: what can be
protected without them, the job-wide snapshots and the automatic resume from the newest one.

How the loop is seen without its lines:

- ``Accelerator()`` first joins the job through a ``TorchPass``, as the four lines' first line does.
- What ``accelerator.prepare`` returns is tracked: every model, optimizer and scheduler, and as the train
  loader the first DataLoader prepared (as Hugging Face's examples prepare theirs: training first, then
  evaluation). A backward pass on a batch that did not come from it stops the job before that step.
- The loop's passes are that loader's passes (there is no ``tp.epochs``). A job resuming from a snapshot of
  pass P, batch b runs the loop's code for passes 0..P-1 without their batches (what runs between the
  passes, an evaluation, runs again, on the resumed state), then pass P from batch b; the tracked state is
  loaded again as pass P begins, so whatever that code changed in it (a per-epoch scheduler step) is undone.
- What torchpass cannot follow is refused: a train loader dispatched from rank 0, a pass not finished (a
  ``break``, a peek) and another begun, the script's own ``skip_first_batches`` of it, a backward pass on
  another loader's batch, models or optimizers prepared once training has begun and then more training.
- A spare cannot enter such a loop live: it would run the code between the passes alone, collectives
  included. A promoted spare hands the loss on to a restart from the newest snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from torchpass_plugins._compat.accelerate import (
    after_prepare,
    before_skipping,
    is_prepared_loader,
    iterate_through,
    shards_a_map_style_dataset,
)
from torchpass_plugins.control.membership import Unrecoverable
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.integrations.accelerate.loop import TorchPass

NO_LIVE_ENTRY = ("torchpass --protect: a spare cannot enter an Accelerate loop written without TorchPass's four "
                 "lines live; the job restarts from its newest snapshot (add the four lines for live replacement)")
_ADD_THE_LINES = "or add TorchPass's four lines (docs/platform.md)"


def line(env: WorkerEnv) -> str:
    """The level of protection such a script gets, and why, in one line."""
    spares = (f"its {env.spares} spare(s) cannot enter this loop live: " if env.spares else "")
    saved = (f"snapshots every {env.snapshot_every} step(s) to {env.snapshot_dir}, resumed from after a restart"
             if env.snapshot_dir and env.snapshot_every else
             f"resumes from the newest snapshot in {env.snapshot_dir} (none written: --snapshot-every 0)"
             if env.snapshot_dir else "no snapshots (pass --snapshot-dir): a restart begins again from step 0")
    resumed = ("; a resume restores what prepare returned, not the loop's own variables (a step counter starts "
               "over)" if env.snapshot_dir else "")
    return (f"torchpass: Accelerator() without TorchPass's four lines runs under torchpass: {spares}a lost worker "
            f"restarts the job; {saved}{resumed}")


def _refuse(what: str) -> ConfigError:
    return ConfigError(f"torchpass --protect: {what}, {_ADD_THE_LINES}")


class ImplicitTorchPass(TorchPass):
    """A ``TorchPass`` the script did not write: tracks what ``prepare`` returns, marks the passes of the
    train loader as ``tp.epochs`` and ``tp.batches`` would."""

    def __init__(self) -> None:
        from torchpass_plugins.control.worker import current_runtime

        if current_runtime().is_spare:  # (a spare is only past its join once promoted)
            raise Unrecoverable(NO_LIVE_ENTRY)
        super().__init__()
        self.accelerator: Any = None  # the script's, once it prepares
        self.prepared: list[Any] = []  # models, optimizers and schedulers, in the order prepare returned them
        self.train_loader: Any = None
        self.passes = 0  # passes the loop began over the train loader (skipped ones too)
        self.skipped = False  # passes already done before the resume were run without their batches
        self.from_train = False  # the newest batch of a prepared loader came from the train loader
        self.pass_open = False  # a pass over the train loader was begun and has not reached its end
        self.late: str | None = None  # what was prepared once training had begun (refused if training goes on)
        rt = self.runtime
        if rt.rank == 0:
            env = rt.env
            print(line(env), flush=True)
            rt.events.emit("protection", rank=0, asked="Accelerator()", strategy="TorchPass (implicit)",
                           spares=env.spares, snapshot_dir=env.snapshot_dir, snapshot_every=env.snapshot_every)

    def on_prepare(self, accelerator: Any, results: tuple) -> None:
        if self.accelerator is None:
            self.accelerator = accelerator
            self._guard_backward()
            before_skipping(self._refuse_skipping)
        for obj in results:
            if is_prepared_loader(obj):
                if self.train_loader is None:
                    if not shards_a_map_style_dataset(obj):
                        raise _refuse("the first DataLoader given to accelerator.prepare, taken for the training "
                                      "loader, is dispatched from rank 0 (an iterable dataset, or "
                                      "dispatch_batches=True), and its passes cannot be resumed mid-way; train "
                                      "from a map-style dataset, not dispatched")
                    self.train_loader = obj
                iterate_through(obj, self._pass if obj is self.train_loader else self._other_pass)
            elif isinstance(obj, nn.Module | torch.optim.Optimizer) or (
                    callable(getattr(obj, "state_dict", None)) and hasattr(obj, "scheduler")):
                if self._tracked:  # (refused if training goes on: a final test after training may prepare)
                    self.late = (f"a {type(obj).__name__} was prepared after training began, so its state would "
                                 "not be in the snapshots; prepare everything before the first pass")
                else:
                    self.prepared.append(obj)

    def _pass(self, loader: Any, plain: Callable[[], Iterator]) -> Iterator:
        """A pass the loop begins over the train loader: none of its batches if it was done before the
        resume, else its batches from where the job stands."""
        if self.late:
            raise _refuse(self.late)
        if self.pass_open:
            raise _refuse("a pass over the training loader was begun and not finished (a break, or a batch taken "
                          "with next(iter(...))) before another began, whose position torchpass cannot follow")
        if not self._tracked:
            self._track_prepared(loader)
        index, self.passes = self.passes, self.passes + 1
        if index < self._iteration:
            self.skipped = True
            return iter(())
        if self.skipped:  # (passes are skipped only after a resume: no spare enters this loop)
            self.snapshots.load(self.snapshots.resumed)  # undo what the code between the passes changed
            self.skipped = False
        self._plain, self.pass_open = plain, True
        return self._train_batches(loader)

    def _train_batches(self, loader: Any) -> Iterator:
        """The pass's batches, each noted as the train loader's (a backward pass must follow one of its)."""
        for batch in self.batches(loader):
            self.from_train = True
            yield batch
        self.from_train = self.pass_open = False

    def _other_pass(self, loader: Any, plain: Callable[[], Iterator]) -> Iterator:
        """Another loader's batches (an evaluation, even one inside a training step, which then goes on)."""
        before = self.from_train
        try:
            for batch in plain():
                self.from_train = False
                yield batch
        finally:
            self.from_train = before

    def _pass_of(self, loader: Iterable[Any]) -> Iterator[Any]:
        return self._plain() if loader is self.train_loader else iter(loader)

    def _refuse_skipping(self, loader: Any) -> None:
        if loader is self.train_loader:
            raise _refuse("the script skips batches of the training loader itself (skip_first_batches, resuming "
                          "from a checkpoint of its own); torchpass resumes it from the snapshots")

    def _track_prepared(self, loader: Any) -> None:
        kinds = {"model": nn.Module, "optimizer": torch.optim.Optimizer}
        named: dict[str, Any] = {}
        for obj in self.prepared:
            kind = next((k for k, t in kinds.items() if isinstance(obj, t)), "scheduler")
            named[f"{kind}{sum(name.startswith(kind) for name in named)}"] = obj
        if not any(isinstance(o, torch.optim.Optimizer) for o in self.prepared):
            raise _refuse("the loop iterates the first DataLoader given to accelerator.prepare, but no optimizer "
                          "was prepared before: prepare the model, the optimizer and the loaders first")
        self.accelerator.backward = self._unguarded
        self.track(self.accelerator, **named, loader=loader)
        self._guard_backward()  # outermost: a refused backward reaches none of the step's machinery

    def _guard_backward(self) -> None:
        """A backward pass must be on a batch of the train loader (the step torchpass reduces and commits)."""
        backward = self._unguarded = self.accelerator.backward

        def backward_on_a_train_batch(loss: torch.Tensor, **kwargs: Any) -> None:
            if self.late:
                raise _refuse(self.late)
            if not (self._tracked and self.from_train):
                raise _refuse("a backward pass ran on a batch that is not of the first DataLoader given to "
                              "accelerator.prepare, taken for the training loader (or before any pass over it): "
                              "prepare the training loader before any other")
            backward(loss, **kwargs)

        self.accelerator.backward = backward_on_a_train_batch

    def finish(self) -> None:
        """The script returned: the snapshot in flight lands. (No barrier: a rank may have more to do after
        training, as long as it likes; once a rank has ended, the loss of another is not recovered, as after
        ``fit``.)"""
        if self.snapshots is not None:
            self.snapshots.close()


def protect(at_script_end: list[Callable[[], None]]) -> None:
    """An ``Accelerator`` is being built by a script of a ``--protect`` launch with no ``TorchPass``."""
    tp = ImplicitTorchPass()
    after_prepare(tp.on_prepare)
    at_script_end.append(tp.finish)
