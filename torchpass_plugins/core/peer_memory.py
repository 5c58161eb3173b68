"""Memory that another process on the same host maps: how a ring replica, and a subscriber to published
weights, skip the network.

A segment is an anonymous memory file (``memfd``) of the process that writes it; a peer on the same host
and in the same PID namespace opens it through ``/proc/<pid>/fd/<fd>`` and maps it, so what the writer
puts there is in the peer's memory without a copy through a socket. A mapping keeps the memory alive after
the writer dies, which is what lets a ring successor hold the shard of a predecessor that was SIGKILLed;
and since no file is named anywhere, nothing is left behind once the last mapping goes.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import astuple, dataclass

import torch

from torchpass_plugins.core.process_group import PeerFailure

NOT_MAPPED = [-1] * 4  # a message's segment fields where the bytes travel over the group instead


@dataclass(frozen=True)
class SegmentId:
    """Where a peer finds a segment, and the identity (device, inode) it checks that it found it."""

    pid: int
    fd: int
    dev: int
    ino: int

    def to_list(self) -> list[int]:
        return list(astuple(self))


class Segment:
    """``nbytes`` of this process's memory that a same-host peer can map. ``pinned``: also page-locked for
    CUDA (registered as DCP's stager registers its shared buffers), so device copies into it run as DMA."""

    def __init__(self, nbytes: int, pinned: bool = False) -> None:
        self.fd = os.memfd_create("torchpass-replica", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        st = os.fstat(self.fd)
        self.id = SegmentId(os.getpid(), self.fd, st.st_dev, st.st_ino)
        self.tensor = _map(self.fd, nbytes)
        self.pinned = pinned and nbytes > 0
        if self.pinned:
            error = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 1))  # portable
            if error:
                os.close(self.fd)
                raise OSError(f"CUDA could not page-lock {nbytes} bytes of shared memory (cudaError {error})")

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        """No peer can map it from now on; existing mappings (``tensor`` too) stay valid, but no longer
        page-locked."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        os.close(self.fd)


def map_peer(segment: SegmentId, nbytes: int) -> torch.Tensor:
    """A peer's segment as a uint8 tensor; ``OSError`` if this process cannot reach that very segment
    (another host or PID namespace, or the segment was replaced)."""
    fd = os.open(f"/proc/{segment.pid}/fd/{segment.fd}", os.O_RDWR)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size) != (segment.dev, segment.ino, nbytes):
            raise OSError(f"/proc/{segment.pid}/fd/{segment.fd} is not the segment announced")
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def host_identity() -> str:
    """Equal for two processes exactly when one can map the other's segments: the same kernel (its boot
    id) and the same PID namespace."""
    with open("/proc/sys/kernel/random/boot_id") as boot:
        return f"{boot.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"


def map_predecessor(segment: SegmentId, nbytes: int, settled: bool) -> torch.Tensor | None:
    """Map the predecessor's segment; ``None`` where it cannot be mapped while this generation has not
    ``settled`` that it maps (then the bytes come over the side group). Once settled, a segment that cannot
    be opened means the predecessor died after announcing it: a ``PeerFailure`` like any lost peer's."""
    try:
        return map_peer(segment, nbytes)
    except OSError as exc:
        if settled:
            raise PeerFailure(f"the predecessor's segment is gone: {exc}") from exc  # (its segment with it)
        return None


def _map(fd: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)
