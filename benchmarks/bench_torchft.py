"""One TorchFT replica group (one process): ``bench_train.py``'s MLP, data and optimizer in TorchFT's idiom.

TorchFT's own loop: a ``Manager`` (its ``ManagerServer`` talks to the lighthouse), a reconfigurable
``ProcessGroupGloo`` across replica groups, ``torchft.Optimizer`` (``zero_grad`` starts the quorum, ``step``
steps only if ``should_commit``), ``manager.allreduce`` of every gradient (averaged over the replica groups
that take part), TorchFT's ``DistributedSampler`` sharding the data by replica group, and healing (a group
that joins late gets model and optimizer state from a peer over TorchFT's checkpoint transport).

Records in ``OUT`` the same way ``bench_train.py`` does: ``steps_rank{r}.txt`` (``step time perf_counter
pid`` after every committed step), ``kill_marks_rank{r}.txt``, plus ``discarded_rank{r}.txt`` (steps whose
commit failed), ``participants_rank{r}.txt`` (replica groups in each committed step) and, at the end, the
final weights (``weights_rank{r}.pt``). The first group to finish sets ``done`` in the driver's store: a
replacement still on its way then leaves instead of training alone from step 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from _bench_data import add_run_args, claim, make_dataset, mlp
from torch import nn
from torch.utils.data import DataLoader


def build_mlp(features: int, hidden: int, depth: int, classes: int, seed: int) -> nn.Sequential:
    """``bench_train.MLP.net``, built after the same seeding, so the initial weights are the same."""
    torch.manual_seed(seed)
    return mlp(features, hidden, depth, classes)


def batches(loader: DataLoader, sampler, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches pass after pass, from batch ``skip`` on (a restarted group resumes its shard where
    the healed step puts it, as a per-group data loader checkpoint would)."""
    epoch, skip = divmod(skip, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address (http://host:port)")
    p.add_argument("--store", required=True, help="host:port of the driver's store (the start barrier)")
    add_run_args(p)
    p.add_argument("--restarted", action="store_true", help="a replacement: skip the start barrier")
    args = p.parse_args(argv)

    import torchft

    r = args.replica
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_mlp(args.features, args.hidden, args.depth, args.classes, args.seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    samples = 2 * args.batch_size * args.groups * args.accumulate * args.max_steps
    dataset = make_dataset(samples, args.features, args.classes, args.seed)
    sampler = torchft.DistributedSampler(dataset, replica_rank=r, num_replica_groups=args.groups, group_rank=0,
                                         num_replicas=1, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's own store
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optim.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        replica_id=f"bench_{r}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=30),
    )
    optimizer = torchft.Optimizer(manager, optim)
    host, port = args.store.rsplit(":", 1)
    shared = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    if not args.restarted:  # every group heartbeats before anyone asks for the first quorum: all three join it
        shared.add("ready", 1)
        while int(shared.add("ready", 0)) < args.groups:
            time.sleep(0.05)

    steps = open(args.out / f"steps_rank{r}.txt", "a", buffering=1)
    discarded = open(args.out / f"discarded_rank{r}.txt", "a", buffering=1)
    participants = open(args.out / f"participants_rank{r}.txt", "a", buffering=1)
    data: Iterator | None = None
    while manager.current_step() < args.max_steps:
        if shared.check(["done"]):  # the job ended before this replacement got back into it
            manager.shutdown(wait=False)
            return
        optimizer.zero_grad()  # starts the quorum
        if data is None:
            manager.wait_quorum()  # a healed group knows its step only now
            if shared.check(["done"]):
                manager.shutdown(wait=False)
                return
            data = batches(loader, sampler, manager.current_step() * args.accumulate)
        step = manager.current_step()
        for _ in range(args.accumulate):
            x, y = next(data)
            (nn.functional.cross_entropy(model(x), y) / args.accumulate).backward()
        if (r, step) == (args.kill_rank, args.kill_step) and claim(args.out / "kill.fired"):
            with open(args.out / f"kill_marks_rank{r}.txt", "a") as f:
                f.write(f"{step} {time.time():.6f} {os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)  # before its gradients reach the others
        for work in [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]:
            work.wait()
        optimizer.step()  # only if should_commit
        if manager.current_step() > step:
            steps.write(f"{step} {time.time():.6f} {time.perf_counter():.6f} {os.getpid()}\n")
            participants.write(f"{step} {manager.num_participants()}\n")
        else:
            discarded.write(f"{step} {time.time():.6f} {manager.num_participants()}\n")
    shared.set("done", str(r))
    torch.save(model.state_dict(), args.out / f"weights_rank{r}.pt")
    for f in (steps, discarded, participants):
        f.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
