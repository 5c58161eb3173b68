"""Lightning's internals that torchpass needs and Lightning has no public route for (checked against
lightning 2.6.6; ``tests/test_compat.py`` fails when one changes).

A rank's logging state, read and written as plain data: what a rank logged with ``self.log`` lives in the
train loop's ``_ResultCollection`` (one ``_ResultMetric`` per key: the running sum and batch count of an
``on_epoch`` value, the last ``on_step`` value) and in the logger connector's ``callback_metrics``; a
torchmetrics ``Metric`` keeps its counts in its own states.
None of it is in a checkpoint, and all of it differs between ranks. :func:`rank_local_state` captures it as
nested dicts of tensors and plain values (so it travels like any other state), and
:func:`load_rank_local_state` puts it back, creating the result entries a fresh process has not logged yet.

Also: what Lightning's own strategies use without a public name (moving optimizer state to a device,
rebuilding a ``DataLoader`` around another sampler), the sampler wrapper, the restarted epoch loop, the
layer sync, the prepare-data barrier, the checkpoint connector and the loops' progress.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.trainer.connectors import data_connector
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync
from lightning.pytorch.utilities.data import _update_dataloader
from torchmetrics import Metric

from torchpass_plugins.core.tree import device_kinds, onto_device_kinds
from torchpass_plugins.errors import ConfigError

_REDUCE = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}
_META = (
    "fx",
    "name",
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "enable_graph",
    "add_dataloader_idx",
    "dataloader_idx",
    "metric_attribute",
)


def _metric_state(metric: Metric) -> dict[str, Any]:
    return {
        "states": {name: getattr(metric, name) for name in metric._defaults},
        "update_count": metric._update_count,
        "computed": metric._computed,
        "forward_cache": metric._forward_cache,
    }


def _load_metric_state(metric: Metric, state: dict[str, Any]) -> None:
    for name, value in state["states"].items():
        setattr(metric, name, value)
    metric._update_count, metric._computed = state["update_count"], state["computed"]
    metric._forward_cache = state["forward_cache"]


def _result(item: _ResultMetric) -> dict[str, Any]:
    meta = item.meta
    return {
        "meta": {name: getattr(meta, name) for name in _META},
        "reduce": meta.reduce_fx.__name__,
        "sync": (meta.sync.should, meta.sync.rank_zero_only),
        "is_tensor": item.is_tensor,
        "state": _metric_state(item) if item.is_tensor else {"forward_cache": item._forward_cache},
        "has_reset": item.has_reset,
    }


def rank_local_state(trainer: Any) -> dict[str, Any]:
    """This rank's logged values, metric states and ``callback_metrics``, as plain data, with the device type
    of each tensor in it (the state reaches another process through host memory)."""
    state = _rank_local_values(trainer)
    return {**state, "devices": device_kinds(state)}


def _rank_local_values(trainer: Any) -> dict[str, Any]:
    module, connector = trainer.lightning_module, trainer._logger_connector
    return {
        "epoch": trainer.current_epoch,
        "metrics": {path: _metric_state(m) for path, m in module.named_modules() if isinstance(m, Metric)},
        "results": {key: _result(item) for key, item in trainer.fit_loop.epoch_loop._results.items()},
        "logger": {
            "callback": dict(connector._callback_metrics),
            "logged": dict(connector._logged_metrics),
            "pbar": dict(connector._progress_bar_metrics),
            # which hook logged last and whether this is an epoch's first batch: when they say a new
            # epoch began, the next ``self.log`` resets the epoch's running values
            "current_fx": connector._current_fx,
            "first_loop_iter": connector._first_loop_iter,
        },
    }


def load_rank_local_state(trainer: Any, state: dict[str, Any]) -> None:
    """Make this rank's logging state ``state`` (taken by :func:`rank_local_state` on another process). A state
    taken in an earlier epoch than this rank is in is then reset as the end of that epoch reset it. Each
    tensor goes back to the type of device it was on there (a metric state on the GPU, not in host memory)."""
    module, connector = trainer.lightning_module, trainer._logger_connector
    if "devices" in state:  # (a snapshot written before devices were recorded has its tensors on the host)
        state = onto_device_kinds({k: v for k, v in state.items() if k != "devices"}, state["devices"])
    metrics = {path: m for path, m in module.named_modules() if isinstance(m, Metric)}
    for path, metric_state in state["metrics"].items():
        _load_metric_state(metrics[path], metric_state)
    results = trainer.fit_loop.epoch_loop._results
    for key in [k for k in results if k not in state["results"]]:
        del results[key]
    for key, saved in state["results"].items():
        item = results.get(key)
        if item is None:
            meta = _Metadata(**saved["meta"], reduce_fx=_REDUCE[saved["reduce"]])
            should, rank_zero_only = saved["sync"]
            meta.sync = _Sync(fn=trainer.strategy.reduce, _should=should, rank_zero_only=rank_zero_only)
            item = results[key] = _ResultMetric(meta, saved["is_tensor"])
        if item.is_tensor:
            _load_metric_state(item, saved["state"])
            item.to(item.value.device)  # where the logged value is, as Lightning places a new key's metric
        else:
            item.value = getattr(module, saved["meta"]["metric_attribute"])
            item._forward_cache = saved["state"]["forward_cache"]
        item.has_reset = saved["has_reset"]
    connector._callback_metrics = dict(state["logger"]["callback"])
    connector._logged_metrics = dict(state["logger"]["logged"])
    connector._progress_bar_metrics = dict(state["logger"]["pbar"])
    connector._current_fx, connector._first_loop_iter = (
        state["logger"]["current_fx"],
        state["logger"]["first_loop_iter"],
    )
    if state["epoch"] < trainer.current_epoch:
        results.reset()  # what the epoch's end did (``reset_results``)
        connector._current_fx = connector._first_loop_iter = None


def drop_loader_positions(fit_loop_state: dict[str, Any]) -> None:
    """Remove the train loaders' own saved positions (a ``StatefulDataLoader``'s ``state_dict``) from a fit
    loop's state: torchpass repositions the loader from the loop's progress, and a saved position is the
    rank's that wrote it, not the rank that loads it."""
    fit_loop_state.get("state_dict", {}).pop("combined_loader", None)


def reopen_epoch_cut_by_fit_end(checkpoint: dict[str, Any]) -> None:
    """A checkpoint saved after ``fit`` stopped in the middle of an epoch (``max_steps``) counts that epoch as
    finished, though batches of it are left: resumed as Lightning reads it, the run would go on with the
    next epoch's data where an uninterrupted run goes on with this epoch's. Count it as in progress again,
    as a checkpoint saved during the epoch does (so training continued from it is the uninterrupted run's)."""
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if fit is None:
        return
    batches, epochs = fit["epoch_loop.batch_progress"], fit["epoch_progress"]
    mid_epoch = batches["current"]["ready"] > 0 and not batches["is_last_batch"]
    if mid_epoch and epochs["current"]["processed"] == epochs["current"]["started"] > 0:
        for counters in (epochs["current"], epochs["total"]):
            counters["processed"] -= 1
            counters["completed"] = min(counters["completed"], counters["processed"])
        if "epoch" in checkpoint:
            checkpoint["epoch"] -= 1


def users_sampler(sampler: Any) -> Any:
    """The user's own sampler inside Lightning's ``DistributedSamplerWrapper`` (which keeps it in its
    dataset's ``_sampler``), else ``None``."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    return sampler.dataset._sampler if isinstance(sampler, DistributedSamplerWrapper) else None


def continue_from_boundary(epoch_loop: Any) -> None:
    """End the restart of an epoch loop whose progress was restored from a step boundary (a spare's
    hand-over, a snapshot). Lightning's restart logic is made for checkpoints saved inside a batch's end
    (``on_train_batch_end``, ``on_validation_end``) and replays the rest of that batch: after a mid-epoch
    validation, an ``advance`` that takes no batch, then an ``on_advance_end`` that counts the batch again
    (``_batches_that_stepped``); at an epoch's first batch alike. A boundary comes after the batch's end, so
    the loop goes on as one that has just finished an iteration: its first ``advance`` takes the next batch,
    as on every other rank."""
    epoch_loop.on_iteration_done()


def replays_a_batch_end(epoch_loop: Any, data_fetcher: Any) -> bool:
    """Whether the epoch loop's next ``advance`` takes no batch: a loop restored from a checkpoint saved inside
    a batch's end (the user's own, through ``ckpt_path``) first replays the rest of that end, where a
    validation was due (after a mid-epoch validation, and at an epoch's first batch). Lightning's own test,
    from ``_TrainingEpochLoop.advance``."""
    return bool(epoch_loop.restarting and epoch_loop._should_check_val_fx(data_fetcher)
                and (epoch_loop.val_loop.restarted_mid_evaluation or epoch_loop.restarted_on_last))


def apply_layer_sync(strategy: Any, model: Any) -> Any:
    """What Lightning's strategies do at ``setup`` with ``sync_batchnorm=True`` (``strategy._layer_sync``),
    with torchpass's layer sync, which also runs on CPU, in place of Lightning's default one."""
    # imported here: the strategies import this module, and the package of the layer sync imports them
    from torchpass_plugins.integrations.lightning.sync_batchnorm import TorchPassSyncBatchNorm

    if strategy._layer_sync is None:
        return model
    if type(strategy._layer_sync) is TorchSyncBatchNorm:
        strategy._layer_sync = TorchPassSyncBatchNorm()
    return strategy._layer_sync.apply(model)


def refuse_unsupported(trainer: Any) -> None:
    """Refuse, on every rank and before training, what a spare could not continue bit for bit."""
    if not trainer.lightning_module.automatic_optimization:
        raise ConfigError(
            "torchpass: manual optimization (automatic_optimization = False) is not supported: a spare enters at "
            "a step boundary, and a failure between a batch's optimizer steps could not be continued. Use "
            "automatic optimization."
        )
    closures = [type(o).__name__ for o in trainer.optimizers if isinstance(o, torch.optim.LBFGS)]
    if closures:
        raise ConfigError(
            f"torchpass: the {closures[0]} optimizer is not supported: it evaluates the closure (forward and "
            "backward) several times per step, and each gradient reduction must belong to one step. Use an "
            "optimizer that takes one gradient per step."
        )


class _PatientBarrier:
    """What ``prepare_data`` runs in place of Lightning's ``_InfiniteBarrier``: the same shape (a context
    that waits as it exits, callable to wait), through the strategy's own wait."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self.wait = wait

    def __call__(self) -> None:
        self.wait()

    def __enter__(self) -> _PatientBarrier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


def wait_in_prepare_data(trainer: Any, wait: Callable[[str], None]) -> None:
    """Make ``trainer``'s ``prepare_data`` wait for the other ranks with ``wait(name)`` (a barrier with no
    time limit). Lightning's ``_InfiniteBarrier`` makes a new gloo group on the default group's store,
    which torchpass's default group does not share with the other ranks (it would wait forever) and which
    a spare could never join; the swap lasts only while ``prepare_data`` runs."""
    connector = trainer._data_connector
    prepare, calls = connector.prepare_data, itertools.count()

    def prepare_data() -> None:
        original = data_connector._InfiniteBarrier
        data_connector._InfiniteBarrier = lambda: _PatientBarrier(lambda: wait(f"prepare_data.{next(calls)}"))
        try:
            prepare()
        finally:
            data_connector._InfiniteBarrier = original

    connector.prepare_data = prepare_data


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """Lightning's whole checkpoint as a dict in memory (``Trainer.save_checkpoint`` only writes a file)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def precision_checkpoint_key(trainer: Any) -> str:
    """Where Lightning's checkpoint holds the precision plugin's state (the gradient scaler's)."""
    return type(trainer.precision_plugin).__qualname__


def restore_at_fit_start(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Have ``fit`` restore ``checkpoint`` as if it had been read from ``ckpt_path`` (model, optimizers,
    loops, callbacks: Lightning's own restore path, in memory)."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def restoring_a_checkpoint(trainer: Any) -> bool:
    """Whether ``fit`` is about to restore a checkpoint (handed over in memory, or from ``ckpt_path``)."""
    return bool(trainer._checkpoint_connector._loaded_checkpoint) or trainer.ckpt_path is not None


def forget_unscaled(precision: Any) -> None:
    """A step abandoned after its gradients were unscaled, before the scaler stepped and updated: the
    scaler forgets it (else the step run again could not unscale: torch allows once per update)."""
    scaler = getattr(precision, "scaler", None)
    if scaler is not None:
        scaler._per_optimizer_states.clear()  # a defaultdict: each optimizer's starts fresh again


def rewind_loops(fit_loop: _Loop, snapshot: dict) -> None:
    """Put every progress counter of the fit loop back to ``snapshot`` (``fit_loop.state_dict()``), without
    the restart mode that ``load_state_dict`` would switch on."""

    def visit(loop: _Loop, prefix: str) -> None:
        loop._load_from_state_dict(snapshot, prefix)
        for name, child in vars(loop).items():
            if isinstance(child, _Loop):
                visit(child, f"{prefix}{name}.")

    visit(fit_loop, "")


def optimizers_to_device(optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the optimizers' state to ``device`` as Lightning's strategies do at ``setup`` (``step`` counters
    stay where the optimizer keeps them)."""
    _optimizers_to_device(optimizers, device)


def dataloader_with_sampler(dataloader: Any, sampler: Any) -> Any:
    """A new ``DataLoader`` like ``dataloader`` (its class and arguments, as Lightning re-creates loaders to
    inject its distributed sampler) that draws from ``sampler``."""
    return _update_dataloader(dataloader, sampler)
