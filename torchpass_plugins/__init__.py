"""torchpass-plugins: hot spares and live recovery for PyTorch Lightning and Accelerate.

The strategy names ``"torchpass_ddp"`` and ``"torchpass_fsdp"`` are registered with Lightning's
``StrategyRegistry`` by :func:`register_strategies`: on importing this package when Lightning is imported
already (``import lightning`` first, as a Lightning script does), and, in every worker that
``torchpass launch`` starts, by the worker's entry before the script runs. The package itself never
imports Lightning, so processes that never train (the ``torchpass`` launcher, which supervises workers)
do not pay its import (about 4 s of CPU); the public classes are loaded when first used.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TorchPassCallback": "torchpass_plugins.integrations.lightning.callback",
    "TorchPassDDPStrategy": "torchpass_plugins.integrations.lightning",
    "TorchPassFSDPStrategy": "torchpass_plugins.integrations.lightning",
    "TorchPassEnvironment": "torchpass_plugins.integrations.lightning.environment",
    "TorchPass": "torchpass_plugins.integrations.accelerate.loop",
    "WeightPublisher": "torchpass_plugins.weights",
    "WeightSubscriber": "torchpass_plugins.weights",
}
__all__ = [*_EXPORTS, "__version__", "register_strategies"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'torchpass_plugins' has no attribute {name!r}")


_STRATEGIES = {
    "torchpass_ddp": ("TorchPassDDPStrategy", "DDP whose failed workers are replaced by spares, live"),
    "torchpass_fsdp": ("TorchPassFSDPStrategy", "FSDP2 whose shards survive the loss of a rank (ring replicas)"),
}


def _build(class_name: str, **kwargs: Any) -> Any:
    return getattr(importlib.import_module("torchpass_plugins.integrations.lightning"), class_name)(**kwargs)


def register_strategies() -> None:
    """Register ``"torchpass_ddp"`` and ``"torchpass_fsdp"`` with Lightning's ``StrategyRegistry`` (importing
    Lightning), as factories: registering imports nothing of torchpass's own. Importing this package calls
    it when Lightning is imported already, and a worker ``torchpass launch`` started has it called before
    its script runs; a script that imports this package before Lightning elsewhere calls it itself."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (class_name, description) in _STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, functools.partial(_build, class_name), description=description)


if "lightning.pytorch" in sys.modules:
    register_strategies()
