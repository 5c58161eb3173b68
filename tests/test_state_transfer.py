"""State moves between two real gloo ranks exactly: structure, dtypes, shapes, values."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpass_plugins.core.host_copy import to_host
from torchpass_plugins.core.state_transfer import Landing, pack, recv_state, send_state, unpack


class _Pair:
    """Two ranks of one real gloo group, in two threads of this process."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.groups: dict[int, dist.ProcessGroup] = {}

        def build(rank: int) -> None:
            self.groups[rank] = dist.ProcessGroupGloo(self.store.clone(), rank, 2, timedelta(seconds=30))

        threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class _Transport:
    """The operations ``state_transfer`` uses, on a plain group, one message at a time."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg

    def recv_from(self, tensor, src, tag=0):
        self.pg.recv([tensor], src, tag).wait()

    def send_many(self, tensors, dst, tag=0):
        for tensor in tensors:
            self.pg.send([tensor], dst, tag).wait()

    def recv_many(self, tensors, src, tag=0):
        for tensor in tensors:
            self.recv_from(tensor, src, tag)


def _state() -> dict:
    return {
        "state_dict": OrderedDict(w=torch.randn(3, 4), b=torch.arange(5, dtype=torch.int64)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(2, 2)}}, "lr": 0.1}],
        "flags": torch.tensor([True, False]),
        "half": torch.randn(3).to(torch.bfloat16),
        "scalar": torch.tensor(3),
        "meta": ("epoch", 2, None),
        "empty": torch.empty(0, 3),
    }


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_pack_unpack_roundtrip():
    state = _state()
    _assert_same(unpack(*pack(state)), state)


def _transfer(state: dict, landing: Landing | None = None) -> tuple[dict, int, int]:
    """(state received, bytes received, bytes sent) over a real gloo pair."""
    pair, got = _Pair(), {}

    def receive() -> None:
        got["state"], got["bytes"] = recv_state(_Transport(pair.groups[1]), 0, landing)

    t = threading.Thread(target=receive)
    t.start()
    sent = send_state(_Transport(pair.groups[0]), state, 1)
    t.join(timeout=30)
    assert not t.is_alive()
    return got["state"], got["bytes"], sent


def test_send_and_receive_over_gloo():
    state = _state()
    received, nbytes, sent = _transfer(state)
    assert nbytes == sent > 0
    _assert_same(received, state)


def test_large_tensors_land_in_the_tensors_prepared_for_them():
    state = {"w": torch.randn(300, 1000), "m": [torch.randn(300, 1000), torch.randn(70_000)], "b": torch.randn(5)}
    announced = Landing.describe({"w": state["w"], "m": state["m"]})  # the small one is never announced
    landing = Landing.from_description(announced)
    assert landing.nbytes == 2 * 300_000 * 4 + 70_000 * 4
    extra = torch.randn(64, 4096)  # not announced: received into fresh memory
    received, _, _ = _transfer({**state, "extra": extra}, landing)
    _assert_same(received, {**state, "extra": extra})
    assert landing.nbytes == 0  # every prepared tensor was received into


def test_host_copies_leave_cpu_tensors_in_place_unless_a_snapshot_asks_for_copies():
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.int64)
    assert [t.data_ptr() for t in to_host([a, b])] == [a.data_ptr(), b.data_ptr()]  # sent from where they are
    reused = torch.empty(2, 3)
    copies = to_host([a, b], [reused, torch.empty(5, dtype=torch.int64)], copy=True)
    assert copies[0] is reused and copies[1].data_ptr() != b.data_ptr()  # the mismatched one is new memory
    a.add_(1), b.add_(1)  # training goes on: the snapshot's copies keep the values they had
    assert torch.equal(copies[0], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(copies[1], torch.ones(4, dtype=torch.int64))
