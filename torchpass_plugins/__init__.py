"""torchpass-plugins: hot spares and live recovery for PyTorch Lightning and Accelerate.

Importing the package registers the strategy names (Lightning has no entry point for strategies): at once
if Lightning is imported already, else as soon as ``lightning.pytorch`` has been imported. So processes
that never train (the ``torchpass`` launcher, which supervises workers) do not pay for importing
Lightning, and the public classes are loaded when first used.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TorchPassCallback": "torchpass_plugins.integrations.lightning.callback",
    "TorchPassDDPStrategy": "torchpass_plugins.integrations.lightning",
    "TorchPassFSDPStrategy": "torchpass_plugins.integrations.lightning",
    "TorchPassEnvironment": "torchpass_plugins.integrations.lightning.environment",
    "TorchPass": "torchpass_plugins.integrations.accelerate.loop",
}
__all__ = [*_EXPORTS, "__version__"]


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


def _register() -> None:
    """Register factories, so that registering imports nothing of ours (Lightning may be mid-import)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (class_name, description) in _STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, functools.partial(_build, class_name), description=description)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Runs :func:`_register` right after the ``lightning.pytorch`` package has finished importing."""

    def find_spec(self, name, path, target=None):
        if name != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module) -> None:
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


if "lightning.pytorch" in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLightning())
