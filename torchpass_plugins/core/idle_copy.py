"""Copying a snapshot in the time its core would otherwise be idle, with the training thread as fallback.

A replication round copies a rank's shard state (tens of MB) once per step. At normal priority that copy
takes its CPU from the training thread on the same core; in a thread of the ``SCHED_IDLE`` class it runs
only where the core has nothing else to run, as while the rank waits for a collective (measured: the
round's share of a step fell from ~2% to ~0%). Such a thread may be starved, so whoever needs the copy
done (the fence, before the optimizer step changes the sources) copies what the idle thread has not
started. A piece the idle thread started may still be in its hands, and would land late, with sources the
optimizer step may have changed meanwhile: :meth:`IdleCopy.finish` waits for it a short while, and if it
does not finish, the destination must be abandoned until the piece has landed (:attr:`settled`).

One such thread serves the process, copy after copy: starting a thread per copy cost the caller about a
third of a millisecond, a share of a short step that publishing weights at every step would pay.

A copy that one rank makes alone (a publication of weights: ``roam=True``) may run on every core the
machine lets the process use, even when the process is pinned to one: the thread only ever takes a core's
idle time, and the idle time of such a step is mostly on the *other* ranks' cores (the rank that copies is
the slower one: the others wait for it in the next collective). Kept on its rank's core, the copy of a
~105M-parameter model was left to the fence in about half the steps. A copy every rank makes at once (a
replication round) stays on its rank's cores: there the others have no time to spare, and measured side
by side, letting the rounds move made a round every step costlier. Away from
the training thread's core, though, a wait for the idle thread is a wait for another core to go idle: the
fence that waits for the piece it holds, or for the lock it holds, first calls it back to the training
thread's cores (which the wait leaves idle). A wait for Python's interpreter lock, which the idle thread
takes after each piece, cannot be intercepted: pieces of 4 MiB keep those few (a subscriber's small model
is one or two pieces).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

PIECE = 4 << 20  # bytes per piece: the most the fallback may have to wait for, or abandon


def pieces(dst: torch.Tensor, sources: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs of at most ``PIECE`` bytes that copy each flat uint8 source (contiguous,
    in host memory) to its offset in ``dst``."""
    if not (dst.is_contiguous() and dst.dtype == torch.uint8 and dst.device.type == "cpu"):
        raise ValueError("torchpass: an idle copy writes contiguous host bytes")
    out = []
    for offset, src in sources:
        if not (src.is_contiguous() and src.dtype == torch.uint8 and src.device.type == "cpu"):
            raise ValueError("torchpass: an idle copy reads contiguous host bytes")
        if offset < 0 or offset + src.numel() > dst.numel():
            raise ValueError(f"torchpass: {src.numel()} bytes at offset {offset} overrun a {dst.numel()}-byte buffer")
        for lo in range(0, src.numel(), PIECE):
            part = src[lo : lo + PIECE]
            out.append((dst[offset + lo : offset + lo + part.numel()], part))
    return out


def copy_piece(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A plain ``memcpy`` of contiguous bytes, without the GIL: ``Tensor.copy_`` could hand a large piece to
    intra-op threads, which would run at normal priority."""
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


class IdleCopy:
    """``pairs`` copied by the process's thread of the idle scheduling class, handed to it at once; see the
    module docstring. ``copy`` does one pair (tests hold a piece in the idle thread's hands with it);
    ``roam``: a copy this rank makes alone, which may run on any core."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 copy: Callable[[torch.Tensor, torch.Tensor], None] = copy_piece, roam: bool = False) -> None:
        self._pairs, self._copy, self.roam = pairs, copy, roam
        self._next = 0  # the first pair nobody has claimed
        self._done = 0
        self._abandoned = False  # finish() gave up waiting for the idle thread
        self._cond = threading.Condition()
        _idle_thread.take(self)

    def _claim(self) -> int | None:
        with self._cond:
            if self._next == len(self._pairs):
                return None
            self._next += 1
            return self._next - 1

    def _copied(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def run(self) -> None:
        """(In the idle thread.) Copy pairs until none is left unclaimed."""
        while (i := self._claim()) is not None:
            self._copy(*self._pairs[i])
            self._copied()

    def wait(self) -> bool:
        """Block until every pair is copied (True) or :meth:`finish` gave up on the idle thread (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done == len(self._pairs) or self._abandoned)
            return not self._abandoned

    def finish(self, grace_s: float) -> bool:
        """Copy in this thread every pair the idle thread has not started, then wait up to ``grace_s`` for
        the one it holds. False: it still holds one, so the destination may be written later."""
        _idle_thread.call_home()
        while (i := self._claim()) is not None:
            self._copy(*self._pairs[i])
            self._copied()
        with self._cond:
            if self._cond.wait_for(lambda: self._done == len(self._pairs), grace_s):
                return True
            self._abandoned = True
            self._cond.notify_all()
            return False

    @property
    def settled(self) -> bool:
        """Every pair is copied, the one the idle thread held too: nothing more will be written."""
        with self._cond:
            return self._done == len(self._pairs)


class _IdleThread:
    """The process's idle-class copying thread: copies are run in the order they were handed over. Started
    with the first one, and again in a forked child (which has no thread of its parent's)."""

    def __init__(self) -> None:
        self._start_afresh()
        os.register_at_fork(after_in_child=self._start_afresh)

    def _start_afresh(self) -> None:
        self._queue: deque[IdleCopy] = deque()
        self._cond = threading.Condition()  # (a fork may have copied the parent's while held)
        self._thread: threading.Thread | None = None
        self._home: set[int] | None = None  # its cores as started (its rank's), once it may leave them
        self._away = False  # running a copy that may use every core

    def take(self, copy: IdleCopy) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="torchpass-idle-copy", daemon=True)
                self._thread.start()
            self._queue.append(copy)
            self._cond.notify()

    def call_home(self) -> None:
        """(A thread about to wait for this one.) Bring it to the caller's cores, which the wait leaves idle;
        it goes back to every core with its next copy."""
        if self._away and self._thread is not None and self._thread.native_id is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self._thread.native_id, os.sched_getaffinity(0))

    def _serve(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only (Linux)
            self._home = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            pass  # no idle class here: a normal background thread, kept where its process is pinned
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                copy = self._queue.popleft()
            if self._home is not None and (copy.roam or self._away):  # (where it is, unless it must move)
                self._away = self._place(copy.roam)
            copy.run()

    def _place(self, roam: bool) -> bool:
        """This thread on every core there may be (the kernel keeps those the cpuset allows), or back on its
        own; whether it is away."""
        try:
            os.sched_setaffinity(0, range(os.sysconf("SC_NPROCESSORS_CONF")) if roam else self._home)
        except (AttributeError, OSError, ValueError):
            return False
        return roam


_idle_thread = _IdleThread()
