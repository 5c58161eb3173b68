"""Gradient buckets all-reduced while backward still runs, in a layout that never changes.

Buckets are fixed at setup (parameters in reverse order, split at ``cap_bytes`` and at dtype changes),
so a spare builds exactly the same layout as its predecessor: each element is summed in the same order,
which is what makes recovery bit-exact. During the backward of the step's last micro-batch, a bucket is
issued as soon as its gradients are ready *and* every lower bucket was issued, so every rank issues the
same sequence. The local gradients are copied into the buckets, never reduced in place, so a failed
reduction can be retried from them. The copy multiplies by ``1 / world_size`` (as DDP's reducer does), so
the reduced bucket already holds the average and no second pass over the gradients is needed.

Each bucket has two flat buffers, allocated once and used in alternate steps (a fresh allocation per
step costs the kernel's page zeroing every step): after a step the gradients are views of one buffer,
so the next step, which may have accumulated into those views (``zero_grad(set_to_none=False)``), is
copied into the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from torchpass_plugins.core.process_group import PeerFailure, ReconfigurableGroup


class GradientBuckets:
    def __init__(self, params: Iterable[nn.Parameter], world_size: int, cap_bytes: int = 4 * 2**20) -> None:
        self._scale = 1.0 / world_size
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        for p in reversed(self.params):
            last = self.buckets[-1] if self.buckets else None
            size = sum(q.numel() * q.element_size() for q in last) if last else 0
            if last and last[0].dtype == p.dtype and size + p.numel() * p.element_size() <= cap_bytes:
                last.append(p)
            else:
                self.buckets.append([p])
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._flat: list[list[torch.Tensor]] = [[], []]  # per parity: one flat buffer per bucket
        self._views: list[list[list[torch.Tensor]]] = [[], []]  # per parity and bucket: each gradient's view
        self._parity = 0
        self._overlapping: ReconfigurableGroup | None = None
        self._ready = [0] * len(self.buckets)
        self._restart()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def overlap_with(self, transport: ReconfigurableGroup) -> None:
        """A new step: issue buckets during the coming backward, on ``transport``'s group at that time."""
        self._overlapping = transport
        self._ready = [0] * len(self.buckets)
        self._parity ^= 1
        self._restart()

    def _restart(self) -> None:
        self._works: list[tuple[int, dist.Work | None]] = []  # (generation, work) per issued bucket

    def _on_grad(self, p: nn.Parameter) -> None:
        if self._overlapping is None:
            return
        self._ready[self._bucket_of[id(p)]] += 1
        n = len(self._works)
        while n < len(self.buckets) and self._ready[n] == len(self.buckets[n]):
            self._issue(n, self._overlapping)
            n += 1

    def _issue(self, b: int, transport: ReconfigurableGroup) -> None:
        bucket, flats = self.buckets[b], self._flat[self._parity]
        if len(flats) == b:
            flats.append(torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device))
            self._views[self._parity].append(_views_of(flats[b], bucket))
        for p, view in zip(bucket, self._views[self._parity][b], strict=True):
            if p.grad is None:
                view.zero_()
            else:
                torch.mul(p.grad, self._scale, out=view)
        work = None
        try:
            work = transport.allreduce([flats[b]])
            transport.track(work)
        except RuntimeError:
            pass  # a broken or replaced group: reported when the bucket is waited for
        self._works.append((transport.gen, work))

    def complete(self, transport: ReconfigurableGroup, issued: Callable[[], None] = lambda: None) -> None:
        """Issue what backward did not (all of it after a recovery), then wait for every bucket.

        Raises ``PeerFailure``; the local gradients are untouched until :meth:`write_back`.
        """
        self._overlapping = None
        if any(gen != transport.gen for gen, _ in self._works):
            self._restart()
        while len(self._works) < len(self.buckets):
            self._issue(len(self._works), transport)
        issued()
        for b, (_, work) in enumerate(self._works):
            if work is None:
                raise PeerFailure(f"all_reduce of gradient bucket {b}: {transport.errored() or 'not issued'}")
            transport.wait(work, f"all_reduce of gradient bucket {b}")

    def write_back(self) -> None:
        """Replace each gradient with its average over the ranks: a view of its reduced bucket."""
        if len(self._works) != len(self.buckets):
            raise RuntimeError("torchpass: write_back before every gradient bucket was reduced")
        for bucket, views in zip(self.buckets, self._views[self._parity], strict=True):
            for p, view in zip(bucket, views, strict=True):
                p.grad = view


def _views_of(flat: torch.Tensor, bucket: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient-shaped view of its span of ``flat``, made once per buffer."""
    views, offset = [], 0
    for p in bucket:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views
