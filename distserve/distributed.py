"""Ranks of an instance and its torch.distributed group.

Rank ``r`` of a TP x PP instance is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``.
Every worker is its own process, so the instance's group is each worker's default process
group; groups that cross instances (KV migration) are built separately and never touch it.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distserve.config import ParallelConfig
from distserve.tensor_parallel import check_tensor_parallel

# A collective that waits longer than this has lost a peer; the executor notices dead workers
# much sooner through Ray, this only bounds a hang that Ray cannot see.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class ParallelRank:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def peer_in_stage(self, pp_rank: int) -> int:
        """The global rank with this rank's TP rank in stage ``pp_rank``."""
        return pp_rank * self.tp_size + self.tp_rank


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Contiguous decoder layers of a stage; the first ``num_layers % pp_size`` stages get one more."""
    if num_layers < pp_size:
        raise ValueError(
            f"{pp_size} pipeline stages need at least {pp_size} decoder layers, the model has {num_layers}"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def check_parallel_config(hf_config, parallel: ParallelConfig) -> None:
    """Raise ValueError when the model cannot run at these degrees, before any worker starts."""
    check_tensor_parallel(hf_config, parallel.tensor_parallel_size)
    stage_layers(hf_config.get_text_config().num_hidden_layers, parallel.pipeline_parallel_size, 0)


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
