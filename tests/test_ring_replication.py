"""Ring replication between two real processes: the replica a rank holds is its predecessor's shard state
of that step, and it outlives a SIGKILLed predecessor, whether it was mapped from the predecessor's memory
(same host) or received over the side group; so does the gradient log, which a same-host successor reads
from its predecessor's mailbox."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchpass_plugins.core import mailbox
from torchpass_plugins.core.peer_memory import SegmentId, map_predecessor
from torchpass_plugins.core.process_group import PeerFailure
from torchpass_plugins.core.rank_state import RankStateRing
from torchpass_plugins.core.ring_replication import RingReplicator
from torchpass_plugins.core.state_transfer import pack, unpack

ROUNDS = 4
LOG_ROUNDS = 8  # enough for the mailbox to write entries over older ones' memory
TIMEOUT_S = 60


class _Side:
    """The part of ``ReconfigurableGroup`` the replicator uses, over a plain gloo group that no roster
    replaces."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, world_size: int = 2) -> None:
        self.pg, self.rank, self.world_size, self.gen = pg, rank, world_size, 0

    def check(self) -> None:
        """No roster ever replaces this group."""

    def send(self, tensors, dst, tag=0) -> dist.Work:
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0) -> dist.Work:
        return self.pg.recv(tensors, src, tag)

    def wait_all(self, works: list[dist.Work], what: str) -> None:
        for work in works:
            work.wait()


def _shard(rank: int, step: int, many: int = 0) -> dict:
    """A shard state whose size changes after step 0, as AdamW's does (no optimizer state before it);
    ``many`` more one-element tensors make its structure too large to travel in the round's header."""
    params = {"w": torch.full((300_000,), 100.0 * rank + step), "b": torch.arange(7) + step}
    params.update({f"t{i}": torch.tensor([i + step]) for i in range(many)})
    optim = {} if step == 0 else {"w": {"exp_avg": torch.full((300_000,), -step - rank / 10)}}
    return {"params": params, "optim": optim}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _worker(rank: int, port: int, share_memory: bool, many: int, results: mp.Queue, verify: mp.Event) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=TIMEOUT_S))
    replicator = RingReplicator(_Side(pg, rank), every=1, share_memory=share_memory)
    for step in range(ROUNDS):
        replicator.start_round(step, _shard(rank, step, many), host=None)
        replicator.fence()
    pg.barrier().wait()
    results.put((rank, "replicated", replicator.host_bytes() - replicator.abandoned_bytes))
    if rank == 0:
        signal.pause()  # until SIGKILLed
    verify.wait(TIMEOUT_S)
    held = {}
    for step, packed in replicator.replicas.items():
        held[step] = (_same(unpack(packed.meta, packed.payload), _shard(0, step, many)), packed.mapped)
    results.put((rank, "held", held))


def _kill_the_predecessor_and_look(worker, *args) -> tuple[dict[int, int], dict, int]:
    """Run ``worker`` as ranks 0 and 1 of a ring; once both report, SIGKILL rank 0 and let rank 1 look at
    what it holds of it. Returns each rank's first report, rank 1's second, and rank 1's exit code."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    # A queue per rank: a process SIGKILLed while it held a shared queue's lock would block the other's puts.
    results, verify = [ctx.Queue(), ctx.Queue()], ctx.Event()
    procs = [ctx.Process(target=worker, args=(r, store.port, *args, results[r], verify)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        first = dict(q.get(timeout=TIMEOUT_S)[::2] for q in results)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(TIMEOUT_S)
        verify.set()
        rank, what, held = results[1].get(timeout=TIMEOUT_S)
        procs[1].join(TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    assert (rank, what) == (1, "held")
    return first, held, procs[1].exitcode


@pytest.mark.parametrize(("share_memory", "many"), [(True, 0), (False, 0), (True, 1000)],
                         ids=["mapped", "sent", "mapped-structure-beyond-header"])
def test_a_replica_is_the_predecessors_shard_and_outlives_it(share_memory, many):
    replicated, held, survivor_exit = _kill_the_predecessor_and_look(_worker, share_memory, many)
    assert survivor_exit == 0
    assert held == {ROUNDS - 2: (True, share_memory), ROUNDS - 1: (True, share_memory)}
    meta, payload = (t.numel() for t in pack(_shard(1, ROUNDS - 1, many)))
    # Mapped: KEEP + 1 own segments, replicas cost nothing more; sent: KEEP own + KEEP received copies;
    # the structures of KEEP own snapshots and KEEP replicas either way (besides segments given up on while
    # a busy CPU starved the idle copier).
    assert replicated[1] == (3 * payload if share_memory else 4 * payload) + 4 * meta


def test_a_segment_gone_with_its_writer_is_a_peer_failure_not_a_crash():
    """Once a generation maps its predecessor's segments, a segment that cannot be opened means the
    predecessor died after announcing it: the round fails like any lost peer's (the older replica stays)."""
    gone = SegmentId(pid=2**22 + 1, fd=3, dev=0, ino=0)  # above the default pid_max: no such process
    assert map_predecessor(gone, 4096, settled=False) is None  # not settled yet: the bytes come over the group
    with pytest.raises(PeerFailure, match="segment is gone"):
        map_predecessor(gone, 4096, settled=True)


def _entry(rank: int, step: int) -> dict:
    """A step's log entry as ``torchpass_fsdp`` writes it: a shard-sized gradient and the rank's own state."""
    grads = {"w": torch.full((300_000,), step + rank / 8)}
    return {"own": {"seen": torch.tensor([step, rank])}, "step": {"grads": grads}}


def _log_worker(rank: int, port: int, share_memory: bool, results: mp.Queue, verify: mp.Event) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=TIMEOUT_S))
    side = _Side(pg, rank)
    replicator = RingReplicator(side, every=1, share_memory=share_memory)
    log = RankStateRing(keep_votes=False, share_memory=share_memory)
    for step in range(LOG_ROUNDS):
        replicator.start_round(step, _shard(rank, step), host=None)
        replicator.fence()
        log.exchange(side, "vote", step, _entry(rank, step), keep_votes_from=replicator.successor_replays_from())
        log.forget_votes_before(min(replicator.replicas))
    pg.barrier().wait()
    results.put((rank, "logged", log.nbytes()))
    if rank == 0:
        signal.pause()  # until SIGKILLed
    verify.wait(TIMEOUT_S)
    held = {step: (_same(log.get("vote", step), _entry(0, step)), step not in log.copies["vote"])
            for step in log.logged()}
    results.put((rank, "held", held))


@pytest.mark.parametrize("share_memory", [True, False], ids=["mapped", "sent"])
def test_the_gradient_log_outlives_its_writer_and_reuses_its_memory(share_memory):
    logged, held, survivor_exit = _kill_the_predecessor_and_look(_log_worker, share_memory)
    assert survivor_exit == 0
    meta, payload = (t.numel() for t in pack(_entry(1, LOG_ROUNDS - 1)))
    if share_memory:
        # The first entry is sent (it settles that the successor maps the mailbox), the rest are written
        # to the mailbox, which keeps those since the writer's KEEP + 1-th newest round: 3 entries, each
        # written over the memory of an older one, so the mailbox holds 3 entries' memory.
        assert held == {step: (True, True) for step in range(LOG_ROUNDS - 3, LOG_ROUNDS)}
        assert 3 * (meta + payload) <= logged[1] - mailbox._DATA <= 3 * (meta + payload + 2 * mailbox._ALIGN)
    else:
        # Sent, the successor keeps its copies of the entries since its oldest replica.
        assert held == {LOG_ROUNDS - 2: (True, False), LOG_ROUNDS - 1: (True, False)}
        assert logged[1] == 2 * (meta + payload)


def _mixed_worker(rank: int, port: int, results: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    pg = dist.ProcessGroupGloo(store, rank, 3, timedelta(seconds=TIMEOUT_S))
    ring = RankStateRing(share_memory=rank != 1)  # rank 1 as if on another host
    for step in range(5):
        ring.exchange(_Side(pg, rank, 3), "boundary", step, {"rank": rank, "step": step, "t": torch.ones(9) * step})
        ring.exchange(_Side(pg, rank, 3), "vote", step, {"rank": rank, "vote": step})
    pg.barrier().wait()
    pred = (rank - 1) % 3
    right = all(ring.get("boundary", s)["rank"] == pred and torch.equal(ring.get("boundary", s)["t"], torch.ones(9) * s)
                for s in ring.held("boundary"))
    results.put((rank, sorted(ring.held("boundary")), sorted(ring.copies["boundary"]), ring.for_entry(4)[0], right))


def test_ranks_on_either_side_of_a_host_boundary_pair_up():
    """Rank 1 can neither map nor be mapped (another host): ranks 0 and 2 exchange messages with it, and
    rank 0 reads rank 2's copies from its mailbox, with nothing sent between them after the first."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_mixed_worker, args=(r, store.port, results)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = {r: rest for r, *rest in (results.get(timeout=TIMEOUT_S) for _ in procs)}
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert got[0] == [[0, 3, 4], [0], "boundary", True]  # the first sent (it settles), the rest mapped
    assert got[1] == [[3, 4], [3, 4], "boundary", True]  # all sent
    assert got[2] == [[3, 4], [3, 4], "boundary", True]
