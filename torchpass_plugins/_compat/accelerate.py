"""Accelerate's ``Accelerator`` and prepared loaders, reached from outside a script: before it builds an
Accelerator, after it prepares objects, as it iterates a loader (checked against accelerate 1.x:
``tests/test_compat.py`` fails when these change).

The module is patched as it is imported (at once if it is already), so a worker whose script never uses
Accelerate does not pay its import."""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable, Iterator
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


def after_prepare(then: Callable[[Any, tuple], None]) -> None:
    """Call ``then(accelerator, prepared)`` with what each ``accelerator.prepare`` of this process returns
    (as a tuple), before the script gets it. The module is imported: an Accelerator is being built."""
    accelerator_class = sys.modules[MODULE].Accelerator
    prepare = accelerator_class.prepare

    @functools.wraps(prepare)
    def prepare_then(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = prepare(self, *args, **kwargs)
        then(self, result if isinstance(result, tuple) else (result,))
        return result

    accelerator_class.prepare = prepare_then


def is_prepared_loader(obj: Any) -> bool:
    """A loader ``prepare`` returned: a shard of a map-style dataset's, or a dispatcher of an iterable one's."""
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    return isinstance(obj, DataLoaderShard | DataLoaderDispatcher)


def shards_a_map_style_dataset(loader: Any) -> bool:
    """Each rank's batches are picked by a sampler (which can skip the batches of a pass already taken)."""
    from accelerate.data_loader import DataLoaderShard
    from torch.utils.data import IterableDataset

    return isinstance(loader, DataLoaderShard) and not isinstance(loader.dataset, IterableDataset)


def before_skipping(check: Callable[[Any], None]) -> None:
    """Call ``check(loader)`` as ``accelerator.skip_first_batches(loader, n)`` is asked for."""
    accelerator_class = sys.modules[MODULE].Accelerator
    skip = accelerator_class.skip_first_batches

    @functools.wraps(skip)
    def checked(self: Any, dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        check(dataloader)
        return skip(self, dataloader, *args, **kwargs)

    accelerator_class.skip_first_batches = checked


def iterate_through(loader: Any, passes: Callable[[Any, Callable[[], Iterator]], Iterator]) -> None:
    """Each ``iter(loader)`` (a prepared loader's pass) returns ``passes(loader, plain)``, where ``plain()``
    iterates it as Accelerate does. ``iter`` looks ``__iter__`` up on the type (and a prepared loader's
    ``__class__`` is read-only), so the class's method asks each instance for its own; other instances, and
    the copies Accelerate makes (``skip_first_batches``), iterate as before."""
    loader_class = type(loader)
    if not hasattr(loader_class.__iter__, "_torchpass_plain"):
        plain_iter = loader_class.__iter__

        @functools.wraps(plain_iter)
        def __iter__(self: Any) -> Iterator:
            own = self.__dict__.get(_PASSES)
            return plain_iter(self) if own is None else own(self, lambda: plain_iter(self))

        __iter__._torchpass_plain = plain_iter
        loader_class.__iter__ = __iter__
    loader.__dict__[_PASSES] = passes


_PASSES = "_torchpass_passes"


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
