"""The lending exchange in-process, over a real TCPStore: the registry lists live lenders only, a request is
answered with a device and the device comes back; a lender with nothing to lend says why."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch.distributed as dist

from torchpass_plugins.control.lending import BorrowFailed, LendingDesk, Registry, borrow, device_of


def test_the_registry_lists_live_lenders_other_than_the_asking_job(tmp_path):
    registry = Registry(str(tmp_path))
    listed = registry.enter("127.0.0.1:1", 0)
    assert oct(listed.stat().st_mode & 0o777) == "0o600" and listed.parent == tmp_path / str(os.getuid())
    (listed.parent / "9.json").write_text(json.dumps({"endpoint": "127.0.0.1:2", "node": 0, "pid": 999999999}))
    (listed.parent / "torn.json").write_text("{")
    assert [lender.endpoint for lender in registry.lenders(other_than="127.0.0.1:9")] == ["127.0.0.1:1"]
    assert registry.lenders(other_than="127.0.0.1:1") == []  # not from itself


@pytest.mark.timeout(60)
@pytest.mark.parametrize("has_a_slot", [True, False])
def test_a_request_is_answered_with_a_device_which_comes_back(tmp_path, monkeypatch, has_a_slot):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{server.port}"
    Registry(str(tmp_path)).enter(endpoint, 3)
    desk = LendingDesk(server, 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")

    def lend() -> None:
        while not (requests := desk.requests()):
            pass
        [request] = requests
        assert (request.borrower, request.pid) == ("127.0.0.1:9", os.getpid())
        desk.answer(request.number, device_of(1) if has_a_slot else None, "no slot of this node is running a worker")

    lender = threading.Thread(target=lend)
    lender.start()
    if not has_a_slot:
        with pytest.raises(BorrowFailed, match="no slot of this node is running a worker"):
            borrow(Registry(str(tmp_path)), "127.0.0.1:9", timeout_s=20)
        lender.join()
        return
    loan = borrow(Registry(str(tmp_path)), "127.0.0.1:9", timeout_s=20)
    lender.join()
    assert (loan.device, loan.request, loan.lender.pid) == ("5", 1, os.getpid())  # slot 1: visible GPU 5
    assert not desk.given_back(1)
    loan.give_back()
    assert desk.given_back(1)


@pytest.mark.timeout(60)
def test_a_request_not_answered_in_time_is_cancelled_and_one_never_written_is_skipped(tmp_path, monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    Registry(str(tmp_path)).enter(f"127.0.0.1:{server.port}", 0)
    desk = LendingDesk(server, 0)
    with pytest.raises(BorrowFailed, match=r"did not yield a device within 0\.3 s"):
        borrow(Registry(str(tmp_path)), "127.0.0.1:9", timeout_s=0.3)
    [late] = desk.requests()
    assert desk.given_back(late.number)  # cancelled: a lender that looks late yields nothing
    server.add("lend/0/asked", 1)  # a borrower that died between numbering its request and writing it
    monkeypatch.setattr("torchpass_plugins.control.lending._UNWRITTEN_S", 0.2)
    assert desk.requests() == []  # waited for, without blocking
    time.sleep(0.3)
    server.add("lend/0/asked", 1)
    server.set("lend/0/ask/3", json.dumps({"borrower": "127.0.0.1:8", "pid": 1}))
    assert [r.number for r in desk.requests()] == [3]  # the unwritten one skipped
