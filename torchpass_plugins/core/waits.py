"""Futures for c10d work that has none of its own (gloo send/recv), completed by a helper thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch.distributed as dist


def completion(work: dist.Work):
    """A future that is done once ``work`` is (gloo send/recv have none of their own: a helper thread's)."""
    try:
        return work.get_future()
    except RuntimeError:
        return waited_in_thread([work])


def waited_in_thread(works: list[dist.Work]) -> Future:
    """A future that a helper thread completes once every work is done (or fails with the first error)."""
    fut: Future = Future()

    def wait_works() -> None:
        try:
            for work in works:
                work.wait()
            fut.set_result(None)
        except Exception as exc:  # handed over to the waiting thread
            fut.set_exception(exc)

    threading.Thread(target=wait_works, name="torchpass-wait", daemon=True).start()
    return fut
