"""Futures for c10d work that has none of its own (gloo send/recv, gloo's reduce-scatter), completed by a
waiter thread.

Such work can only be waited for by blocking a thread in ``wait()``, and a wait on a dead peer may never
return, so the caller waits on a future instead and can leave it behind when a newer roster replaces the
group. Waiter threads are reused: one that finished its works offers itself for the next (a thread start
costs about as much as a small collective's hand-off); one stuck on a dead peer is simply never reused.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future

import torch.distributed as dist

_idle: list[queue.SimpleQueue] = []  # the inboxes of waiter threads that have nothing to wait for
_lock = threading.Lock()


def _forked() -> None:
    """A forked child has none of its parent's threads, and the lock may have been held by one of them."""
    global _lock
    _idle.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def completion(work: dist.Work):
    """A future that is done once ``work`` is (gloo send/recv have none of their own: a waiter thread's)."""
    try:
        return work.get_future()
    except RuntimeError:
        return waited_in_thread([work])


def waited_in_thread(works: list[dist.Work]) -> Future:
    """A future that a waiter thread completes once every work is done (or fails with the first error)."""
    fut: Future = Future()
    with _lock:
        inbox = _idle.pop() if _idle else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name="torchpass-wait", daemon=True).start()
    inbox.put((works, fut))
    return fut


def _serve(inbox: queue.SimpleQueue) -> None:
    while True:
        works, fut = inbox.get()
        try:
            for work in works:
                work.wait()
            fut.set_result(None)
        except Exception as exc:  # handed over to the waiting thread
            fut.set_exception(exc)
        del works, fut  # an idle waiter keeps no work (nor its tensors) alive
        with _lock:
            _idle.append(inbox)
