"""Weights published by logical rank 0, whichever process holds it: the job's first one, or a spare that
took the rank over, even in the middle of a publication. The Lightning callback and the Accelerate loop
call it at the same points of a step."""

from __future__ import annotations

import threading
from typing import Any

import torch

from torchpass_plugins.errors import ConfigError
from torchpass_plugins.weights import wire
from torchpass_plugins.weights.publisher import WeightPublisher

DTYPES = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAST_DELIVERY_S = 30.0  # how long the process may outlive training to hand the last version to its subscribers


class RankZeroPublishing:
    """A version at the start of training, before the loader takes its first batches (rollouts that feed
    them need weights to play with), at every ``every_n_steps``-th step boundary (the weights after that
    many optimizer steps), numbered by the step, and the last one at the end of training. The copy into
    host memory runs in the background during the step and is finished before its optimizer step. A
    process starts its publisher when it first holds rank 0 and publishes at once, so a spare that takes
    rank 0 over goes on: a version its predecessor was cut off in the middle of reaches the subscribers
    whole (one its predecessor had finished is sent only to subscribers that lack it)."""

    def __init__(self, endpoint: str, every_n_steps: int, dtype: str | None, storage: str | None = None) -> None:
        if every_n_steps < 1 or dtype not in DTYPES:
            raise ConfigError(f"torchpass: publish_every_n_steps={every_n_steps} must be >= 1 and publish_dtype="
                              f"{dtype!r} one of {', '.join(map(repr, DTYPES))}")
        wire.address(endpoint)  # a malformed endpoint is refused before training
        self.endpoint, self.every_n_steps, self.dtype_name, self.dtype = endpoint, every_n_steps, dtype, DTYPES[dtype]
        self.storage = storage
        self.publisher: WeightPublisher | None = None
        self._delivering = False

    def check(self, module: torch.nn.Module, sharded_by: str | None = None) -> None:
        """Before training, on every rank (each may come to hold rank 0): what publishing needs."""
        if sharded_by is not None:
            raise ConfigError(f"torchpass: publish_weights with {sharded_by} is not supported (a rank holds a "
                              "shard, not the weights); publish from a data-parallel loop, or train the sharded "
                              "model with Lightning's strategy='torchpass_fsdp', whose ranks' shards are assembled")
        try:
            wire.token_or_env(None)
            wire.layout(module.state_dict(), self.dtype)
        except ValueError as exc:
            raise ConfigError(f"torchpass: publish_weights: {exc}") from None

    def at_start(self, rank: int, step: int, module: torch.nn.Module, events: Any) -> None:
        """The weights training starts from (the job's first, a checkpoint's, or those a spare that took
        rank 0 over was handed), complete before this returns."""
        if rank == 0:
            self._publish(module, step, events, wait=False, fence_later=False)

    def at_boundary(self, rank: int, step: int, module: torch.nn.Module, events: Any) -> None:
        """Start copying the weights of every N-th boundary; :meth:`before_optimizer_step` finishes the copy."""
        if rank == 0 and step % self.every_n_steps == 0:
            self._publish(module, step, events, wait=False, fence_later=True)

    def before_optimizer_step(self) -> None:
        if self.publisher is not None:
            self.publisher.fence()

    def at_end(self, rank: int, step: int, module: torch.nn.Module, events: Any) -> None:
        """The trained weights (unless the last boundary's version, if it was not skipped, is them), waiting
        for a free copy. The process goes on (to the last barrier, to exit) while they are sent: a thread
        that is not a daemon, so the interpreter waits for it before exiting, hands them to every subscriber
        connected (at most ``LAST_DELIVERY_S``), then closes the publisher."""
        self.before_optimizer_step()  # a version staged at a boundary that ended training
        if rank != 0 or self._delivering:
            return
        self._publish(module, step, events, wait=True, fence_later=False)
        self._delivering = True
        threading.Thread(target=self._deliver_last, args=(events,), name="weights-last-delivery").start()

    def _deliver_last(self, events: Any) -> None:
        behind = self.publisher.deliver_newest(LAST_DELIVERY_S)
        if behind:
            events.emit("weights_undelivered", version=self.publisher.last_version, subscribers=behind,
                        waited_s=LAST_DELIVERY_S)
        self.publisher.close()

    def _publish(self, module: torch.nn.Module, step: int, events: Any, wait: bool, fence_later: bool) -> None:
        if self.publisher is None:
            self.publisher = WeightPublisher(self.endpoint, dtype=self.dtype, events=events, storage=self.storage)
        if step > self.publisher.last_version:
            self.publisher.publish(module, step, wait=wait, fence_later=fence_later)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
