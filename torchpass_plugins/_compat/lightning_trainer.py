"""Lightning's internals that decide, as a Trainer is built and set up, how many devices it uses and where
its loggers write (checked against lightning 2.6.6; ``tests/test_compat.py`` fails when one changes)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from torchpass_plugins.control.protocol import logger_version_key
from torchpass_plugins.errors import ConfigError


def resolve_auto_devices_to_active_ranks(active_ranks: int, strategy_names: tuple[str, ...]) -> None:
    """Make ``Trainer(devices="auto")`` with a torchpass strategy mean this job's active ranks per node.

    Lightning resolves "auto" to the accelerator's device count (1 on a CPU; every GPU of the node,
    including those of the spares) in ``_AcceleratorConnector._set_devices_flag_if_auto_passed``, before
    any strategy exists, and the strategy then refuses the mismatch. Under ``torchpass launch`` the active
    ranks are known from the start, so the count written once on the command line (processes minus
    spares) is the count the Trainer uses. Any other strategy, and an explicit ``devices``, are untouched."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    lightnings = _AcceleratorConnector._set_devices_flag_if_auto_passed
    if getattr(lightnings, "resolves_to_active_ranks", False):
        return

    def set_devices_flag_if_auto_passed(connector: _AcceleratorConnector) -> None:
        flag = connector._strategy_flag
        if connector._devices_flag != "auto" or getattr(flag, "strategy_name", flag) not in strategy_names:
            return lightnings(connector)
        per_node, left_over = divmod(active_ranks, connector._num_nodes_flag)
        if left_over:
            raise ConfigError(
                f"torchpass: devices='auto' cannot split the job's {active_ranks} active ranks evenly over "
                f"num_nodes={connector._num_nodes_flag}; set devices (active ranks per node) explicitly"
            )
        connector._devices_flag = per_node

    set_devices_flag_if_auto_passed.resolves_to_active_ranks = True
    _AcceleratorConnector._set_devices_flag_if_auto_passed = set_devices_flag_if_auto_passed


def keep_logger_versions(trainer: Any, store: Any, starting: bool) -> None:
    """Loggers that number their runs by the directories they find (``CSVLogger``, ``TensorBoardLogger``:
    ``_version`` until asked) would give a spare that takes logical rank 0 over the next number, and so a
    second log directory, with the checkpoints and the saved config split between the two. The job's rank 0
    fixes each version as it starts and the job's store keeps it; a spare adopts it."""
    for index, logger in enumerate(trainer.loggers):
        if not hasattr(logger, "_version"):
            continue
        key = logger_version_key(index)
        if starting and trainer.global_rank == 0:
            store.set(key, json.dumps(logger.version))
        elif not starting and logger._version is None and store.check([key]):
            logger._version = json.loads(store.get(key))


def rewrite_trainer_arguments(rewrite: Callable[[dict[str, Any]], tuple[dict[str, Any], Callable[[Any], None]]]
                              ) -> None:
    """Build every ``Trainer`` of this process (a script's, LightningCLI's, Hydra's ``instantiate``) with the
    arguments ``rewrite`` returns, and hand the built Trainer to the function it returns with them.

    ``Trainer.__init__`` takes keyword arguments only, and a subclass reaches it through ``super()``, so
    wrapping it sees every Trainer as asked for, before its accelerator connector resolves the strategy."""
    from lightning.pytorch import Trainer

    lightnings = Trainer.__init__
    if getattr(lightnings, "rewritten", False):
        return

    @functools.wraps(lightnings)
    def __init__(self: Trainer, **arguments: Any) -> None:
        arguments, then = rewrite(arguments)
        lightnings(self, **arguments)
        then(self)

    __init__.rewritten = True
    Trainer.__init__ = __init__
