"""The idle-class snapshot copy: the fence finishes what the idle thread did not, and a piece the idle
thread still holds makes its destination unusable (the replicator redoes the round elsewhere) rather
than something that may be overwritten after the optimizer step."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from torchpass_plugins.core import idle_copy
from torchpass_plugins.core.idle_copy import IdleCopy, pieces
from torchpass_plugins.core.process_group import PeerFailure
from torchpass_plugins.core.ring_replication import RingReplicator
from torchpass_plugins.core.state_transfer import unpack

TIMEOUT_S = 30


def _sources(sizes: list[int]) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """A zeroed destination and random flat sources laid out back to back in it."""
    sources, offset = [], 0
    for n in sizes:
        sources.append((offset, torch.randint(1, 255, (n,), dtype=torch.uint8)))
        offset += n
    return torch.zeros(offset, dtype=torch.uint8), sources


def _expected(dst: torch.Tensor, sources: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    out = torch.zeros_like(dst)
    for offset, src in sources:
        out[offset : offset + src.numel()] = src
    return out


class _Holder:
    """A copy function whose first call from the idle thread blocks until ``release``: the idle thread
    then holds a piece, as when the scheduler starves it mid-copy."""

    def __init__(self) -> None:
        self.holding, self.release = threading.Event(), threading.Event()
        self.held: torch.Tensor | None = None  # the piece of a segment it was writing when it blocked

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if threading.current_thread().name == "torchpass-idle-copy" and not self.holding.is_set():
            self.held = dst
            self.holding.set()
            assert self.release.wait(TIMEOUT_S)
        dst.copy_(src)


def _wait_settled(copy: IdleCopy) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not copy.settled:
        assert time.monotonic() < deadline, "the idle copier did not finish"
        time.sleep(0.01)


def test_pieces_cover_every_source_in_bounded_pieces():
    dst, sources = _sources([3 * idle_copy.PIECE + 5, 7, idle_copy.PIECE])
    pairs = pieces(dst, sources)
    assert len(pairs) == 4 + 1 + 1
    assert max(src.numel() for _, src in pairs) == idle_copy.PIECE
    for d, s in pairs:
        d.copy_(s)
    assert torch.equal(dst, _expected(dst, sources))


def test_left_alone_the_idle_thread_copies_everything():
    dst, sources = _sources([2 * idle_copy.PIECE + 1, 100])
    copy = IdleCopy(pieces(dst, sources))
    assert copy.wait()
    assert torch.equal(dst, _expected(dst, sources))
    _wait_settled(copy)


def test_finish_copies_what_the_idle_thread_did_not_start_and_waits_for_the_piece_it_holds():
    dst, sources = _sources([5 * idle_copy.PIECE])
    holder = _Holder()
    copy = IdleCopy(pieces(dst, sources), copy=holder)
    assert holder.holding.wait(TIMEOUT_S)
    threading.Timer(0.2, holder.release.set).start()
    assert copy.finish(grace_s=TIMEOUT_S)  # the other four here, then the held one once released
    assert torch.equal(dst, _expected(dst, sources))
    assert copy.wait()


def test_a_piece_held_past_the_grace_is_reported_and_lands_only_later():
    dst, sources = _sources([4 * idle_copy.PIECE])
    holder = _Holder()
    copy = IdleCopy(pieces(dst, sources), copy=holder)
    assert holder.holding.wait(TIMEOUT_S)
    assert not copy.finish(grace_s=0.05)
    assert not copy.wait()  # the round waiting on it is told to give up
    assert not copy.settled
    expected = _expected(dst, sources)
    held = [i for i in range(4) if not torch.equal(dst[i * idle_copy.PIECE : (i + 1) * idle_copy.PIECE],
                                                   expected[i * idle_copy.PIECE : (i + 1) * idle_copy.PIECE])]
    assert len(held) == 1  # every other piece was copied by the caller
    holder.release.set()
    _wait_settled(copy)
    assert torch.equal(dst, expected)  # the late write


class _NoPeer:
    """A side group whose roster is always stale: a round packs, then its exchange fails at once."""

    rank, world_size = 0, 2

    def check(self) -> None:
        raise PeerFailure("a newer roster")


def test_the_fence_redoes_a_round_whose_copy_it_gave_up_on_into_another_segment(monkeypatch):
    monkeypatch.setattr("torchpass_plugins.core.ring_replication.GRACE_S", 0.05)
    holder, copies = _Holder(), []

    def copier(pairs) -> IdleCopy:
        copies.append(IdleCopy(pairs, copy=holder))
        return copies[-1]

    replicator = RingReplicator(_NoPeer(), every=1, copier=copier)
    state = {"w": torch.arange(3 * idle_copy.PIECE // 4, dtype=torch.float32)}
    replicator.start_round(0, state, host=None)
    assert holder.holding.wait(TIMEOUT_S)
    with pytest.raises(PeerFailure, match="newer roster"):  # the redone round reached its exchange
        replicator.fence()
    packed = replicator.own[0]
    assert packed.payload.untyped_storage().data_ptr() != holder.held.untyped_storage().data_ptr()
    assert torch.equal(unpack(packed.meta, packed.payload)["w"], state["w"])
    # the given-up segment is still held (a piece may land there), beside the redone round's
    assert replicator.host_bytes() == 2 * packed.payload.nbytes + packed.meta.numel()
    holder.release.set()
    _wait_settled(copies[0])
    replicator.start_round(1, state, host=None)  # the next round closes the abandoned segment
    with pytest.raises(PeerFailure):
        replicator.fence()
    assert replicator.host_bytes() == sum(p.payload.nbytes + p.meta.numel() for p in replicator.own.values())


def test_pieces_refuse_what_a_raw_copy_could_overrun():
    dst, sources = _sources([100])
    with pytest.raises(ValueError, match="overrun"):
        pieces(dst[:50], sources)
    with pytest.raises(ValueError, match="contiguous host bytes"):
        pieces(dst, [(0, torch.zeros(10, 10, dtype=torch.uint8).t()[0])])


_PINNED_COPY = """
import os, threading, torch
from torchpass_plugins.core.idle_copy import IdleCopy, pieces
home = {min(os.sched_getaffinity(0))}
os.sched_setaffinity(0, home)  # a rank pinned to one core
dst, src = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
assert IdleCopy(pieces(dst, [(0, src)])).wait()  # a replication round: on its rank's core
idle = next(t for t in threading.enumerate() if t.name == "torchpass-idle-copy")
assert os.sched_getaffinity(idle.native_id) == home
assert IdleCopy(pieces(dst, [(0, src)]), roam=True).wait() and bool(dst.all())  # a publication: anywhere
idle = next(t for t in threading.enumerate() if t.name == "torchpass-idle-copy")
print(os.sched_getscheduler(idle.native_id) == os.SCHED_IDLE, *sorted(os.sched_getaffinity(idle.native_id)))
copy = IdleCopy(pieces(dst, [(0, src)]), roam=True)
assert copy.finish(10.0)  # called home (a wait for it must not be a wait for another core to go idle) ...
assert os.sched_getaffinity(idle.native_id) == home
assert IdleCopy(pieces(dst, [(0, src)]), roam=True).wait()  # ... and away again with its next copy
print(*sorted(os.sched_getaffinity(idle.native_id)))
"""


def test_a_copy_one_rank_makes_alone_may_use_every_core_and_is_called_home_when_waited_for():
    """The idle time of such a step is mostly on the other ranks' cores (they wait for the rank that copies);
    a replication round, which every rank makes at once, stays on its rank's core."""
    out = subprocess.run([sys.executable, "-c", _PINNED_COPY], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    roaming, roaming_again = out.stdout.splitlines()
    idle_class, *cores = roaming.split()
    assert idle_class == "True" and {int(core) for core in cores} >= os.sched_getaffinity(0)
    assert roaming_again.split() == cores
