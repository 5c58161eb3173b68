"""Gradient buckets: averaged, handed back as views, and never reduced over the local gradients."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from torchpass_plugins.control.membership import Member, connect_store
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.core.grad_buckets import GradientBuckets
from torchpass_plugins.core.process_group import ReconfigurableGroup


def _single_rank_transport() -> tuple[ReconfigurableGroup, Member]:
    master = connect_store("127.0.0.1:0", is_master=True, timeout=30)
    env = WorkerEnv(store=f"127.0.0.1:{master.port}", token="tok", worker_id="n0-s0-i0", world_size=1, node_rank=0,
                    local_slot=0, run_dir="", seed=0, heartbeat_interval=0.5)
    member = Member(env)
    transport = ReconfigurableGroup(member, timedelta(seconds=30))
    transport.configure(0, 0)
    transport._master = master  # keep the store server alive with the transport
    return transport, member


def test_buckets_average_and_keep_local_gradients_that_alias_last_steps_buckets():
    transport, member = _single_rank_transport()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    # A divisor of 2 over a one-rank group: the sum is the local gradient, so the result is half of it.
    buckets = GradientBuckets(model.parameters(), world_size=2, cap_bytes=300)
    assert len(buckets.buckets) > 1

    buckets.overlap_with(transport)  # buckets are issued during backward
    with pytest.raises(RuntimeError, match="before every gradient bucket was reduced"):
        buckets.write_back()
    model(torch.randn(4, 8)).sum().backward()
    local = {name: p.grad.clone() for name, p in model.named_parameters()}
    buckets.complete(transport)
    buckets.write_back()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, local[name] / 2)
        assert p.grad.untyped_storage().data_ptr() != local[name].untyped_storage().data_ptr()

    # zero_grad(set_to_none=False): the next backward accumulates into last step's bucket views (the
    # buckets' two buffers alternate: the third step reduces into the first step's buffers again).
    for _ in range(2):
        old_views = {name: p.grad for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=False)
        buckets.overlap_with(transport)
        model(torch.randn(4, 8)).sum().backward()
        local = {name: p.grad.clone() for name, p in model.named_parameters()}
        buckets.complete(transport)
        for name in local:
            assert torch.equal(old_views[name], local[name])  # a retry could still start from them
        buckets.write_back()
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, local[name] / 2)
    member.close()
