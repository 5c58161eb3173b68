"""Publishing weights to processes outside the job: versions arrive whole (checked against what was
published, bit for bit), in order, newest first, over TCP and, on the publisher's host, through its mapped
copies; a subscriber that reads slowly holds only its own copy; a subscriber killed in the middle of a
version, and a publisher killed in the middle of one, leave nothing torn behind; a late subscriber gets the
newest version; a wrong token is refused; a subscriber that cannot map the copies gets the bytes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from jobs import Job, run, service_port
from scripts.weights_follower import digest

from torchpass_plugins.observe.events import EventLog
from torchpass_plugins.testing.chaos.oracle import differences
from torchpass_plugins.weights import TokenRefused, WeightPublisher, WeightSubscriber, wire
from torchpass_plugins.weights import publisher as publisher_module

TOKEN = "test-weights-token"
pytestmark = pytest.mark.timeout(120)


def _state(version: int, width: int = 256) -> dict[str, torch.Tensor]:
    """A state dict whose every value says which version it is."""
    generator = torch.Generator().manual_seed(version)
    return {"layer.weight": torch.randn(width, width, generator=generator), "layer.bias": torch.full((width,), version),
            "steps": torch.tensor(version, dtype=torch.int64)}


def _assert_is(state: dict[str, torch.Tensor], version: int) -> None:
    expected = _state(version, state["layer.weight"].shape[0])
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), f"{name} of version {version} differs from what was published"


def _paths(events: Path) -> set[str]:
    """How the versions a subscriber logged to ``events`` reached it."""
    return {record["path"] for record in map(json.loads, events.read_text().splitlines())
            if record["event"] == "weights_received"}


@pytest.mark.parametrize("shared_memory", [True, False], ids=["mapped", "tcp"])
def test_versions_arrive_whole_in_order_and_a_late_subscriber_gets_the_newest(shared_memory, tmp_path):
    received: list[int] = []
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN) as publisher:
        publisher.publish(_state(0), 0)
        subscriber = WeightSubscriber(publisher.endpoint, token=TOKEN, shared_memory=shared_memory,
                                      events=EventLog(tmp_path / "events.jsonl"))

        def follow() -> None:
            version, state = subscriber.latest(timeout=30)
            while True:
                _assert_is(state, version)
                received.append(version)
                if version == 40:
                    return
                version, state = subscriber.wait_newer(version, timeout=30)

        follower = threading.Thread(target=follow)
        follower.start()
        for version in range(1, 40):  # some may be skipped (every copy in use): the follower skips them too
            publisher.publish(_state(version), version)
        assert not publisher.publish(_state(40), 40, wait=True).skipped
        follower.join(timeout=60)
        assert received[-1] == 40 and received == sorted(set(received))  # newest last, each once, in order
        assert _paths(tmp_path / "events.jsonl") == {"shared_memory" if shared_memory else "tcp"}
        late = WeightSubscriber(publisher.endpoint, token=TOKEN)
        version, state = late.latest(timeout=30)
        assert version == 40
        _assert_is(state, 40)
        with pytest.raises(ValueError, match="not newer"):
            publisher.publish(_state(7), 7)


def test_a_slow_subscriber_holds_only_its_own_copy_and_then_skips_to_the_newest():
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN, copies=3) as publisher:
        publisher.publish(_state(0, 1024), 0)
        slow = _RawSubscriber(publisher.endpoint)
        version, entries, nbytes = slow.ask(have=-1)
        slow.read(nbytes // 4)  # and stops reading: the publisher's send of version 0 is stuck mid-way
        for version in range(1, 30):  # none of these waits for it, and none is skipped
            assert not publisher.publish(_state(version, 1024), version).skipped
        buffer = slow.read_rest()  # version 0, whole, although 29 newer ones were published meanwhile
        assert zlib.crc32(memoryview(buffer.numpy())) == slow.lines.receive()["crc32"]
        _assert_is({e.name: wire.view(buffer, e) for e in entries}, 0)
        version, entries, nbytes = slow.ask(have=0)
        assert version == 29  # the newest, not version 1
        slow.close()


def test_the_copies_after_the_first_are_made_in_the_background_not_by_a_publication(monkeypatch):
    """Made by the publication that needs it, a large model's copy costs that step its page faults."""
    makers = []

    class Recorded(publisher_module.Segment):
        def __init__(self, *args, **kwargs) -> None:
            makers.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "Segment", Recorded)
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN, copies=3) as publisher:
        publisher.publish(_state(0, 1024), 0)
        slow = _RawSubscriber(publisher.endpoint)
        slow.ask(have=-1)  # and holds version 0's copy: the publisher needs a third one
        for version in range(1, 10):
            assert not publisher.publish(_state(version, 1024), version).skipped
        slow.close()
    assert makers[0] == threading.current_thread().name and makers[1:] == ["weights-copies"] * 2


def test_a_copy_the_background_could_not_make_is_made_by_the_publication_that_needs_it(monkeypatch):
    class Refused(publisher_module.Segment):
        def __init__(self, *args, **kwargs) -> None:
            if threading.current_thread().name == "weights-copies":
                raise RuntimeError("no memory for it now")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "Segment", Refused)
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN, copies=3) as publisher:
        idle = _RawSubscriber(publisher.endpoint)  # connected: the first fence wants two copies made, not one
        for version in range(5):  # none waits for a copy that will never come
            assert not publisher.publish(_state(version, 1024), version).skipped
        version, state = WeightSubscriber(publisher.endpoint, token=TOKEN).latest(timeout=30)
        idle.close()
    assert version == 4
    _assert_is(state, 4)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "tcp"])
def test_a_subscriber_killed_in_the_middle_of_a_version_costs_the_others_nothing(mapped):
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN, copies=2) as publisher:
        publisher.publish(_state(0, 4096), 0)  # 64 MiB: more than the sockets buffer, so the send is cut off
        child = subprocess.run([sys.executable, "-c", _KILLED_MID_RECEIVE, publisher.endpoint, TOKEN, str(mapped)],
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == -signal.SIGKILL, child.stderr
        for version in (1, 2, 3):  # with 2 copies, these wait for ever unless the killed subscriber's is freed
            assert not publisher.publish(_state(version, 1024), version, wait=True).skipped
        version, state = WeightSubscriber(publisher.endpoint, token=TOKEN).wait_newer(2, timeout=30)
        assert version == 3
        _assert_is(state, 3)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["mapped", "tcp"])
def test_a_publisher_killed_mid_version_is_never_seen_torn_and_its_successor_serves_the_same_endpoint(
        shared_memory, tmp_path):
    endpoint = f"tcp://127.0.0.1:{service_port()}"
    env = {**os.environ, wire.TOKEN_VARIABLE: TOKEN, "TORCHPASS_FAULTS": "kill@phase=publish"}
    first = subprocess.Popen([sys.executable, "-c", _PUBLISHER, endpoint, "5"], cwd=tmp_path, env=env)
    successor: list[subprocess.Popen] = []

    def replace_when_lost() -> None:
        first.wait(timeout=60)
        env.pop("TORCHPASS_FAULTS")
        successor.append(subprocess.Popen([sys.executable, "-c", _PUBLISHER, endpoint, "5"], cwd=tmp_path, env=env))

    replacer = threading.Thread(target=replace_when_lost)
    replacer.start()
    try:
        subscriber = WeightSubscriber(endpoint, token=TOKEN, retry_s=0.05, shared_memory=shared_memory)
        version, state = subscriber.latest(timeout=60)  # the first one dies half-way through sending it
        replacer.join(timeout=60)
        assert first.returncode == -signal.SIGKILL
        assert version == 5
        _assert_is(state, 5)
    finally:
        for process in (first, *successor):
            process.kill()
            process.wait()


def test_a_wrong_token_is_refused_with_a_clear_error_and_the_right_one_still_served():
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN) as publisher:
        publisher.publish(_state(0), 0)
        with pytest.raises(TokenRefused, match="refused the token"):
            WeightSubscriber(publisher.endpoint, token="not-the-token").latest(timeout=10)
        assert WeightSubscriber(publisher.endpoint, token=TOKEN).latest(timeout=10)[0] == 0


def test_a_model_is_loaded_in_place_and_a_cast_publication_halves_the_bytes():
    model = torch.nn.Linear(64, 64)
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN, dtype=torch.bfloat16) as publisher:
        publication = publisher.publish(model, 0)
        assert publication.nbytes < sum(t.numel() * 4 for t in model.state_dict().values()) * 0.6
        replica = torch.nn.Linear(64, 64)
        weight = replica.weight
        assert WeightSubscriber(publisher.endpoint, token=TOKEN).load_into(replica, timeout=10) == 0
        assert replica.weight is weight  # in place
        assert torch.equal(replica.weight, model.weight.to(torch.bfloat16).float())


class _RawSubscriber:
    """The wire protocol by hand, to stop reading in the middle of a version."""

    def __init__(self, endpoint: str, receive_buffer: int = 0) -> None:
        import socket

        self.sock = socket.socket()
        if receive_buffer:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect(wire.address(endpoint))
        self.lines = wire.Lines(self.sock)
        nonce = self.lines.receive()["nonce"]
        self.lines.send({"answer": wire.answer(TOKEN.encode(), nonce)})
        assert self.lines.receive()["ok"] is True
        self.buffer = memoryview(b"")
        self.done = 0

    def ask(self, have: int):
        self.lines.send({"have": have, "wait": 10})
        version, entries, nbytes = wire.parse_header(self.lines.receive(), newer_than=have)
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.buffer, self.done = memoryview(self.tensor.numpy()), 0
        return version, entries, nbytes

    def read(self, n: int) -> None:
        self.lines.receive_into(self.buffer[self.done:self.done + n])
        self.done += n

    def read_rest(self) -> torch.Tensor:
        self.read(len(self.buffer) - self.done)
        return self.tensor

    def close(self) -> None:
        self.sock.close()


_KILLED_MID_RECEIVE = textwrap.dedent("""
    import os, signal, socket, sys
    from torchpass_plugins.core.peer_memory import SegmentId, map_peer
    from torchpass_plugins.weights import wire
    lines = wire.Lines(socket.create_connection(wire.address(sys.argv[1])))
    lines.send({"answer": wire.answer(sys.argv[2].encode(), lines.receive()["nonce"])})
    lines.receive()
    mapped = sys.argv[3] == "True"
    lines.send({"have": -1, "wait": 10, "map": mapped})
    header = lines.receive()
    if mapped:  # copying the version out of the publisher's copy, which the publisher holds for it
        source = map_peer(SegmentId(*header["segment"]), header["nbytes"])
        source[:header["nbytes"] // 3].clone()
    else:
        lines.receive_into(memoryview(bytearray(header["nbytes"] // 3)))
    os.kill(os.getpid(), signal.SIGKILL)
""")
_SUBSCRIBER_OF_ITS_OWN_USER_NAMESPACE = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    from test_weights import _assert_is
    from torchpass_plugins.observe.events import EventLog
    from torchpass_plugins.weights import WeightSubscriber
    version, state = WeightSubscriber(sys.argv[1], events=EventLog(sys.argv[2])).latest(timeout=30)
    _assert_is(state, version)
    print(version)
""")


def test_a_subscriber_that_may_not_map_the_publishers_copies_is_sent_the_bytes(monkeypatch, tmp_path):
    """In a user namespace of its own (a rootless container sharing the host's PIDs) a subscriber sees the
    publisher's process but may not open its memory files: it is told so, and asks for bytes instead."""
    monkeypatch.setenv(wire.TOKEN_VARIABLE, TOKEN)
    with WeightPublisher("tcp://127.0.0.1:0") as publisher:
        publisher.publish(_state(3), 3)
        child = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c",
                                _SUBSCRIBER_OF_ITS_OWN_USER_NAMESPACE, publisher.endpoint, str(tmp_path / "events")],
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == 0 and child.stdout.split() == ["3"], child.stderr
        publisher.publish(_state(4), 4)
        assert WeightSubscriber(publisher.endpoint).wait_newer(3, timeout=30)[0] == 4  # the publisher serves on
    events = [record["event"] for record in map(json.loads, (tmp_path / "events").read_text().splitlines())]
    assert events == ["weights_unmapped", "weights_received"]
    assert _paths(tmp_path / "events") == {"tcp"}
_PUBLISHER = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    from test_weights import _state
    from torchpass_plugins.weights import WeightPublisher
    publisher = WeightPublisher(sys.argv[1])
    publisher.publish(_state(int(sys.argv[2]), 1024), int(sys.argv[2]))
    time.sleep(60)
""")


_ENDS_TRAINING = textwrap.dedent("""
    import sys, torch
    from torchpass_plugins.observe.events import EventLog
    from torchpass_plugins.weights.rank_zero import RankZeroPublishing
    publishing = RankZeroPublishing(sys.argv[1], every_n_steps=1, dtype=None, storage=sys.argv[2])
    model = torch.nn.Linear(64, 64)
    publishing.at_start(0, 0, model, EventLog(None))
    sys.stdin.readline()  # the subscriber has version 0
    with torch.no_grad():
        model.weight.fill_(3.0)
    publishing.at_end(0, 7, model, EventLog(None))  # and the script ends here
""")


def test_the_trained_weights_reach_a_connected_subscriber_although_the_process_ends_at_once(monkeypatch, tmp_path):
    """... and the storage: the process that ends training lives until both have them."""
    from torchpass_plugins.weights.storage import VersionStore

    monkeypatch.setenv(wire.TOKEN_VARIABLE, TOKEN)
    endpoint, storage = f"tcp://127.0.0.1:{service_port()}", str(tmp_path / "weights")
    trainer = subprocess.Popen([sys.executable, "-c", _ENDS_TRAINING, endpoint, storage], stdin=subprocess.PIPE,
                               text=True)
    try:
        subscriber = WeightSubscriber(endpoint, token=TOKEN, retry_s=0.05)
        assert subscriber.latest(timeout=60)[0] == 0
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        time.sleep(1.0)  # asks only after the script has ended training
        version, state = subscriber.wait_newer(0, timeout=30)
        assert version == 7 and torch.equal(state["weight"], torch.full((64, 64), 3.0))
        assert trainer.wait(timeout=30) == 0  # and then the process ends
    finally:
        trainer.kill()
        trainer.wait()
    assert VersionStore(storage).read_newer(-1)[0] == 7


def test_storage_goes_back_with_a_job_restarted_from_an_older_snapshot(tmp_path):
    from torchpass_plugins.weights.storage import VersionStore

    store = VersionStore(str(tmp_path / "weights"))
    for version in (10, 11, 5):  # a job restarted from its snapshot of step 5
        entries, nbytes = wire.layout(_state(version))
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        for entry, tensor in zip(entries, _state(version).values(), strict=True):
            wire.view(buffer, entry).copy_(tensor)
        store.write(version, entries, buffer, zlib.crc32(memoryview(buffer.numpy())))
    version, state, _ = VersionStore(str(tmp_path / "weights")).read_newer(-1)
    assert version == 5
    _assert_is(state, 5)
    kept = sorted(p.name for p in (tmp_path / "weights").glob("v*"))
    assert kept == ["v000000000005.weights", "v000000000011.weights"]  # the newest and the one written before it


def test_the_end_waits_for_an_expected_subscriber_that_is_not_connected_yet():
    """A rank's shard publisher at the end of training waits for rank 0's follower by name: a spare that
    took the rank over shortly before the end may not be followed yet, and must not exit before it is."""
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN) as publisher:
        publisher.publish(_state(5), 5)
        assert publisher.deliver_newest(0.3, expected=("rank0-follows-rank1",)) == ["rank0-follows-rank1"]
        late = threading.Timer(0.5, lambda: WeightSubscriber(publisher.endpoint, token=TOKEN,
                                                             name="rank0-follows-rank1").latest(timeout=10))
        late.start()
        started = time.monotonic()
        assert publisher.deliver_newest(30, expected=("rank0-follows-rank1",)) == []
        assert time.monotonic() - started >= 0.4  # it waited for the subscriber to come
        late.join()


def test_a_subscriber_that_never_asks_holds_the_end_of_training_back_only_so_long(tmp_path, monkeypatch):
    from torchpass_plugins.observe.events import EventLog, read_events
    from torchpass_plugins.weights import rank_zero

    monkeypatch.setenv(wire.TOKEN_VARIABLE, TOKEN)
    monkeypatch.setattr(rank_zero, "LAST_DELIVERY_S", 1.0)
    events = EventLog(tmp_path / "events.jsonl", source="rank0")
    publishing = rank_zero.RankZeroPublishing("tcp://127.0.0.1:0", every_n_steps=1, dtype=None)
    publishing.at_start(0, 0, torch.nn.Linear(4, 4), events)
    silent = _RawSubscriber(publishing.publisher.endpoint)  # connected, never asks
    publishing.at_end(0, 3, torch.nn.Linear(4, 4), events)
    [delivery] = [t for t in threading.enumerate() if t.name == "weights-last-delivery"]
    assert not delivery.daemon  # the interpreter waits for it before it exits
    delivery.join(timeout=30)
    [undelivered] = [e for e in read_events(tmp_path) if e["event"] == "weights_undelivered"]
    assert undelivered["version"] == 3 and len(undelivered["subscribers"]) == 1
    assert silent.sock.recv(1) == b""  # then the publisher closed


@pytest.fixture(params=["file", "s3"])
def storage_url(request, tmp_path):
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        return f"s3://snapshots/weights-{tmp_path.name}"
    return str(tmp_path / "weights")


def test_a_subscriber_that_cannot_reach_the_publisher_takes_the_newest_version_from_storage(tmp_path, storage_url):
    """The publisher writes its newest version to storage as it goes; once it is gone, a subscriber that
    reaches nobody for ``fallback_s`` takes the newest version from there, whole (a file changed since is
    never handed out); storage keeps the newest two versions."""
    from torchpass_plugins.observe.events import EventLog, read_events
    from torchpass_plugins.weights.storage import VersionStore

    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN, storage=storage_url,
                         events=EventLog(tmp_path / "events.jsonl", source="rank0")) as publisher:
        for version in range(5):
            publisher.publish(_state(version), version, wait=True)
            deadline = time.monotonic() + 30
            while version not in {e["version"] for e in read_events(tmp_path) if e["event"] == "weights_stored"}:
                assert time.monotonic() < deadline, read_events(tmp_path)
                time.sleep(0.05)
    subscriber = WeightSubscriber(publisher.endpoint, token=TOKEN, storage=storage_url, fallback_s=0.5, retry_s=0.05)
    started = time.monotonic()
    version, state = subscriber.latest(timeout=30)
    assert version == 4 and time.monotonic() - started >= 0.5
    _assert_is(state, 4)
    store = VersionStore(storage_url)
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.root, detail=False)) == [
        "LATEST", "v000000000003.weights", "v000000000004.weights"]
    path = f"{store.root}/v000000000004.weights"
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(TimeoutError):
        WeightSubscriber(publisher.endpoint, token=TOKEN, storage=storage_url, fallback_s=0.1, retry_s=0.05).latest(2)


def _full(version: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {"w": torch.randn(10, 4, generator=generator), "b": torch.randn(10, generator=generator),
            "running": torch.full((3,), float(version))}


def test_shards_of_one_step_are_assembled_and_a_step_some_rank_did_not_send_is_never_published(monkeypatch):
    """Rank 0's collector follows two other ranks' shard publishers; each version it publishes is every
    parameter's shards of that one step concatenated (10 rows over 3 ranks: 4, 4, 2), with rank 0's
    unsharded tensors; a step whose shards one rank skipped is passed over for the next."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from torchpass_plugins.observe.events import EventLog
    from torchpass_plugins.weights.sharded import SENDER, ShardCollector, shard_key

    monkeypatch.setenv(wire.TOKEN_VARIABLE, TOKEN)
    store = dist.HashStore()
    runtime = SimpleNamespace(world_size=3, member=SimpleNamespace(thread_store=lambda: store))
    ranks = [WeightPublisher("tcp://127.0.0.1:0") for _ in range(2)]
    for rank, publisher in enumerate(ranks, start=1):
        store.set(shard_key(rank), publisher.endpoint)
    with WeightPublisher("tcp://127.0.0.1:0") as publisher:
        collector = ShardCollector(runtime, publisher, {"w", "b"}, EventLog(None))
        follower = WeightSubscriber(publisher.endpoint)
        received = {}
        try:
            for version in range(8):
                full = _full(version)
                shards = [{name: full[name].chunk(3)[rank] for name in ("b", "w")} for rank in range(3)]
                for rank, shard_publisher in enumerate(ranks, start=1):
                    if (rank, version) != (2, 3):
                        shard_publisher.publish({**shards[rank], SENDER: torch.tensor(rank)}, version, wait=True)
                collector.add(0, version, {**shards[0], "running": full["running"]})
                if version == 3:
                    assert not collector.wait_published(3, 1.0)
                    continue
                assert collector.wait_published(version, 30)
                got, state = follower.wait_newer(max(received, default=-1), timeout=30)
                received[got] = state
        finally:
            collector.close()
            for shard_publisher in ranks:
                shard_publisher.close()
    assert 3 not in received and set(received) == set(range(8)) - {3}
    for version, state in received.items():
        assert list(state) == ["b", "w", "running"]
        for name, tensor in _full(version).items():
            assert torch.equal(state[name], tensor), (version, name)


FOLLOWER = Path(__file__).parent / "scripts" / "weights_follower.py"
JOB_STEPS = 12


def _job_with_a_follower(run_dir: Path, nproc: int, spares: int, faults: str = "",
                         train_args: tuple[str, ...] = ()) -> tuple[Job, dict[int, str]]:
    """The demo job publishing every step to a follower process; what the follower received."""
    endpoint = f"tcp://127.0.0.1:{service_port()}"
    received = run_dir / "received.txt"
    run_dir.mkdir(parents=True)
    follower = subprocess.Popen([sys.executable, str(FOLLOWER), endpoint, str(received), "--final", str(JOB_STEPS)],
                                stdout=subprocess.PIPE, text=True)
    assert follower.stdout.readline() == "following\n"  # before the job starts (which may take less time)
    try:
        job, codes = run(run_dir / "job", nproc=nproc, spares=spares, faults=faults,
                         train_args=("--max-steps", str(JOB_STEPS), "--publish-weights", endpoint, *train_args))
        assert codes == [0], job.output()[-3000:]
        follower.wait(timeout=60)
    finally:
        follower.kill()
        follower.wait()
    lines = [line.split() for line in received.read_text().splitlines()] if received.exists() else []
    versions = [int(version) for version, _ in lines]
    assert versions == sorted(set(versions)) and versions, f"versions out of order or none: {versions}"
    return job, {int(version): sha for version, sha in lines}


@pytest.mark.timeout(400)
@pytest.mark.xdist_group("weights-jobs")
def test_logical_rank_0_killed_mid_publication_is_replaced_and_the_versions_go_on_whole(tmp_path, monkeypatch):
    monkeypatch.setenv(wire.TOKEN_VARIABLE, TOKEN)
    reference, published = _job_with_a_follower(tmp_path / "failure-free", nproc=3, spares=0)
    job, received = _job_with_a_follower(tmp_path / "killed", nproc=4, spares=1,
                                         faults="kill@rank=0,step=5,phase=publish")
    [failure] = job.events("failure_detected")
    assert (failure["rank"], failure["code"]) == (0, -9)
    after = [e["version"] for e in job.events("weights_published") if e["time"] > failure["time"]]
    assert after and max(received) >= JOB_STEPS - 1  # the spare that took rank 0 over went on publishing
    for version, sha in received.items():  # every version received is the failure-free run's, bit for bit
        assert sha == published.get(version, sha), f"version {version} differs from the failure-free run's"
    assert set(received) & set(published), "no version received in both runs"
    for rank in range(3):  # publishing changes nothing of the training
        assert differences(reference.state(rank), job.state(rank)) == [], f"rank {rank}"
        assert reference.applied(rank) == list(range(JOB_STEPS))
    assert job.applied(1) == job.applied(2) == list(range(JOB_STEPS))  # the survivors: each step once
    # Rank 0's record: its first process's, then the spare's. The kill comes from the publisher's thread, at
    # any point of the step, possibly between an optimizer step and its record: at most that line is missing.
    assert job.applied(0) == sorted(set(job.applied(0))) and len(set(range(JOB_STEPS)) - set(job.applied(0))) <= 1


def test_a_publisher_whose_port_is_still_held_serves_as_soon_as_it_is_let_go():
    import socket

    held = socket.create_server(("127.0.0.1", 0))  # the process a migrated rank 0 takes over from, still there
    endpoint = f"tcp://127.0.0.1:{held.getsockname()[1]}"
    with WeightPublisher(endpoint, token=TOKEN) as publisher:
        publisher.publish(_state(3), 3)  # kept meanwhile
        threading.Timer(0.5, held.close).start()
        version, state = WeightSubscriber(endpoint, token=TOKEN, retry_s=0.05).latest(timeout=30)
        assert version == 3
        _assert_is(state, 3)


def test_a_version_copied_during_the_step_is_the_boundarys_although_forward_changes_the_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512))
    at_boundary = {k: v.clone() for k, v in model.state_dict().items()}
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN) as publisher:
        publisher.publish(model, 0, fence_later=True)  # the parameters' copy starts in the background
        model(torch.randn(64, 512))  # a training forward: the batch-norm statistics change in place
        changed = {k for k, v in model.state_dict().items() if not torch.equal(v, at_boundary[k])}
        assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= changed
        publisher.fence()  # before the optimizer step would change the parameters
        version, state = WeightSubscriber(publisher.endpoint, token=TOKEN).latest(timeout=10)
        assert version == 0 and state.keys() == at_boundary.keys()
        for name, tensor in at_boundary.items():
            assert torch.equal(state[name], tensor), name
        with pytest.raises(ValueError, match="takes the module"):
            publisher.publish(model.state_dict(), 1, fence_later=True)


def test_a_subscriber_that_asks_without_reading_never_blocks_a_publication():
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN) as publisher:
        flood = _RawSubscriber(publisher.endpoint, receive_buffer=4096)
        request = (b'{"have": 1000000, "wait": 0}\n') * 1000
        sent = [0]

        def ask_and_never_read() -> None:  # nothing newer: the answers pile up unread, the sends block
            with contextlib.suppress(OSError):
                while True:
                    flood.sock.sendall(request)
                    sent[0] += 1

        threading.Thread(target=ask_and_never_read, daemon=True).start()
        still = 0
        for _ in range(120):  # until the publisher stops reading requests for 2 s: it is stuck sending answers
            before = sent[0]
            time.sleep(0.25)
            still = still + 1 if sent[0] == before else 0
            if still == 8:
                break
        done = threading.Event()
        threading.Thread(target=lambda: (publisher.publish(_state(1), 1), done.set()), daemon=True).start()
        assert done.wait(timeout=20), "publish waited for a subscriber that does not read"
        flood.close()


def test_close_lets_go_of_the_port_and_cuts_off_its_subscribers():
    publisher = WeightPublisher("tcp://127.0.0.1:0", token=TOKEN)
    publisher.publish(_state(0), 0)
    connected = _RawSubscriber(publisher.endpoint)
    publisher.close()
    assert connected.sock.recv(1) == b""  # cut off
    host, port = wire.address(publisher.endpoint)
    import socket

    socket.create_server((host, port)).close()  # the port is free for a successor


def test_a_subscriber_takes_weights_only_from_a_publisher_that_proves_the_token():
    import socket

    impostor = socket.create_server(("127.0.0.1", 0))

    def pretend() -> None:
        sock, _ = impostor.accept()
        lines = wire.Lines(sock)
        lines.send({"hello": wire.MAGIC, "nonce": "00"})
        lines.receive()
        lines.send({"ok": True, "proof": "made-up"})

    threading.Thread(target=pretend, daemon=True).start()
    with pytest.raises(TokenRefused, match="did not prove the token"):
        WeightSubscriber(f"tcp://127.0.0.1:{impostor.getsockname()[1]}", token=TOKEN).latest(timeout=10)
    impostor.close()


def test_what_cannot_be_published_is_refused_before_the_version_is_taken():
    with WeightPublisher("tcp://127.0.0.1:0", token=TOKEN) as publisher:
        with pytest.raises(ValueError, match="cannot be published"):
            publisher.publish({"z": torch.zeros(3, dtype=torch.complex64)}, 1)
        assert not publisher.publish(_state(1), 1).skipped  # version 1 is still free



_FORKING_PUBLISHER = textwrap.dedent(f"""
    import multiprocessing, sys, time
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    from test_weights import _state
    from torchpass_plugins.weights import WeightPublisher
    publisher = WeightPublisher(sys.argv[1])
    publisher.publish(_state(0), 0)
    sys.stdin.readline()  # once a subscriber's connection is served
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))  # as a loader worker is
    worker.start()
    print(worker.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_a_process_forked_from_the_publishers_keeps_neither_its_port_nor_its_connections(monkeypatch):
    """A DataLoader worker forked from rank 0's process outlives it by seconds: it must hold neither the
    port (the spare that takes rank 0 over serves there) nor a subscriber's connection (the subscriber
    must learn at once that its version was cut off)."""
    import socket

    monkeypatch.setenv(wire.TOKEN_VARIABLE, TOKEN)
    endpoint = f"tcp://127.0.0.1:{service_port()}"
    publisher = subprocess.Popen([sys.executable, "-c", _FORKING_PUBLISHER, endpoint], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        subscriber = WeightSubscriber(endpoint, token=TOKEN)
        assert subscriber.latest(timeout=30)[0] == 0
        publisher.stdin.write("fork\n")
        publisher.stdin.flush()
        worker = int(publisher.stdout.readline())
        connection = subscriber._lines.sock  # served by the publisher, and copied into the worker at the fork
        os.kill(publisher.pid, signal.SIGKILL)
        publisher.wait()
        connection.settimeout(5)
        assert connection.recv(1) == b""  # closed now, not when the worker ends
        socket.create_server(wire.address(endpoint)).close()  # the port is free at once
    finally:
        publisher.kill()
        publisher.wait()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


@pytest.mark.timeout(500)
@pytest.mark.xdist_group("weights-jobs")
def test_a_sharded_job_publishes_full_weights_through_the_loss_of_rank_0_and_of_a_rank_sending_its_shards(
        tmp_path, monkeypatch):
    """``torchpass_fsdp``: rank 0 is SIGKILLed while it sends a version to the follower, then rank 1 while it
    sends its shards to rank 0. Every version the follower receives is the full weights of that step, bit for
    bit the failure-free run's; the last is the trained weights; the training is the failure-free run's."""
    monkeypatch.setenv(wire.TOKEN_VARIABLE, TOKEN)
    sharded = ("--strategy", "torchpass_fsdp")
    reference, published = _job_with_a_follower(tmp_path / "failure-free", nproc=3, spares=0, train_args=sharded)
    job, received = _job_with_a_follower(tmp_path / "killed", nproc=5, spares=2, train_args=sharded,
                                         faults="kill@rank=0,step=4,phase=publish;kill@rank=1,step=8,phase=publish")
    assert sorted((e["rank"], e["code"]) for e in job.events("failure_detected")) == [(0, -9), (1, -9)]
    assert published[JOB_STEPS] == received[JOB_STEPS] == digest(job.final()["weights"])  # the trained weights
    assert len(received) >= 3, received  # the first, the last and some on the way (others may be passed over)
    for version, sha in received.items():
        assert sha == published.get(version, sha), f"version {version} differs from the failure-free run's"
    for rank in range(3):
        assert differences(reference.state(rank), job.state(rank)) == [], f"rank {rank}"

