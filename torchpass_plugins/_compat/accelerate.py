"""Accelerate's ``Accelerator``, reached before a script builds one (checked against accelerate 1.x:
``tests/test_compat.py`` fails when its import path changes).

The module is patched as it is imported (at once if it is already), so a worker whose script never uses
Accelerate does not pay its import."""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

MODULE = "accelerate.accelerator"


def before_accelerator(check: Callable[[], None]) -> None:
    """Call ``check`` as each ``Accelerator`` of this process is built, before it initializes anything
    (``torch.distributed`` among it)."""

    def patch(module: ModuleType) -> None:
        init = module.Accelerator.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            check()
            init(self, *args, **kwargs)

        module.Accelerator.__init__ = __init__

    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    else:
        sys.meta_path.insert(0, _AfterImport(MODULE, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` through the other finders and runs ``then`` on the module once it has executed."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = next((s for s in (f.find_spec(fullname, path, target) for f in sys.meta_path
                                 if f is not self and hasattr(f, "find_spec")) if s is not None), None)
        if spec is None or spec.loader is None:
            return spec
        execute, then, finder = spec.loader.exec_module, self.then, self

        def exec_module(module: ModuleType) -> None:  # (a find_spec that imports nothing leaves the finder)
            execute(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            then(module)

        spec.loader.exec_module = exec_module
        return spec
