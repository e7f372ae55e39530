"""The torch.distributed groups of an instance, and the rendezvous stores they are built on.

Every worker is its own process, so the instance's group is each worker's default process
group; groups that cross instances (KV migration) are built separately and never touch it.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from distserve.parallel.ranks import ParallelRank

# A collective that waits longer than this has lost a peer; the executor notices dead workers
# much sooner through Ray, this only bounds a hang that Ray cannot see.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def node_ip() -> str:
    """This machine's address as other machines see it (loopback when it has no route out)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def create_store(world_size: int) -> dist.TCPStore:
    """The instance's rendezvous store on a port the OS picks, so instances never collide."""
    return dist.TCPStore(node_ip(), 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


def init_process_group(
    rank: ParallelRank, device: torch.device, host: str, port: int, store: dist.TCPStore | None = None
) -> dist.ProcessGroup | None:
    """Join the instance's group (NCCL on CUDA, gloo on CPU); returns this rank's TP group."""
    if store is None:
        store = dist.TCPStore(host, port, rank.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank.rank, world_size=rank.world_size, timeout=COLLECTIVE_TIMEOUT
    )
    tp_group = None
    # Every rank creates every stage's group, in the same order, as new_group requires.
    for stage in range(rank.pp_size):
        ranks = list(range(stage * rank.tp_size, (stage + 1) * rank.tp_size))
        group = dist.new_group(ranks)
        if stage == rank.pp_rank:
            tp_group = group
    return tp_group
