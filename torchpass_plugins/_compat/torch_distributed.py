"""The private parts of ``torch.distributed`` that torchpass uses, in one place (checked against torch
2.13.0; ``tests/test_compat.py`` fails when they change).

- A Python ``ProcessGroup`` made the default group through ``init_process_group`` needs a backend that
  carries its name, since c10d reads a group's name from one of its backends
  (``ProcessGroup._register_backend``, ``BackendType.CUSTOM``).
- ``ProcessGroupNCCL.Options`` takes the collective timeout only through ``_timeout``.
- DCP's storage over fsspec (``FsspecWriter``, ``FsspecReader``) is exported only from
  ``torch.distributed.checkpoint._fsspec_filesystem``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter


def carry_name(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Register a one-rank gloo group as ``group``'s CPU backend: it carries the name and never communicates."""
    holder = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, holder)


def nccl_options(timeout: timedelta) -> dist.ProcessGroup.Options:
    """Options of a nonblocking NCCL communicator (the only kind that can be aborted safely)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = 0
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    return opts


def fsspec_writer(url: str, storage_options: dict[str, Any]) -> FsspecWriter:
    """DCP's writer to an fsspec URL; no ``fsync`` (fsspec files have no descriptor, and DCP falls back to
    syncing the whole machine's filesystems), as for every other file torchpass writes."""
    return FsspecWriter(url, sync_files=False, overwrite=True, **storage_options)


def fsspec_reader(url: str, storage_options: dict[str, Any]) -> FsspecReader:
    return FsspecReader(url, **storage_options)
