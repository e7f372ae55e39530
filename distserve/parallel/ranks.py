"""Ranks of a tensor x pipeline parallel instance and the decoder layers of each stage.

Rank ``r`` of a TP x PP instance is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.config import ParallelConfig
from distserve.core.model_presets import ModelShape
from distserve.parallel.tensor_parallel import check_tensor_parallel


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


def check_parallel_config(hf_config, shape: ModelShape, parallel: ParallelConfig) -> None:
    """Raise ValueError when the model cannot run at these degrees, before any worker starts."""
    check_tensor_parallel(hf_config, shape, parallel.tensor_parallel_size)
    stage_layers(shape.num_layers, parallel.pipeline_parallel_size, 0)
