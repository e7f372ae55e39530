"""Analytic latency of one instance (a TP x PP group), roofline style as in DistServe's simulator.

Each decoder layer on a rank takes max(compute time, memory time) at achieved fractions of the GPU's peaks,
plus two ring all-reduces of the hidden states (after attention and after the MLP) when TP > 1. Pipeline
stages run one after another for a batch, with the hidden states sent between them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from distserve.core.kv_cache_dtype import check_kv_cache_dtype
from distserve.core.model_presets import ModelShape
from placement.hardware import ClusterSpec


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak FLOP/s, memory bandwidth and link bandwidth."""

    compute: float = 0.6
    memory: float = 0.8
    communication: float = 0.7

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "communication"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RooflineModel:
    """``dtype_bytes`` is the model's (weights, activations, an ``auto`` KV cache); ``kv_cache_dtype``
    what the KV cache stores, as the engine's ``cache.kv_cache_dtype``: it sets the KV a rank holds,
    the bytes a step reads and writes of it, and what a hand-over moves."""

    model: ModelShape
    cluster: ClusterSpec
    tp: int
    pp: int
    dtype_bytes: int = 2
    efficiency: Efficiency = field(default_factory=Efficiency)
    cross_node: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        m = self.model
        for name in ("tp", "pp", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        check_kv_cache_dtype(self.kv_cache_dtype, m.head_dim)
        # The engine's rule: what it refuses is never a candidate (KV heads are split when tp divides
        # them and replicated, one per rank, when they divide tp).
        problem = m.tensor_parallel_problem(self.tp)
        if problem is not None:
            raise ValueError(f"tp={self.tp}: {problem}")
        if self.pp > m.num_layers:
            raise ValueError(f"pp={self.pp} exceeds num_layers={m.num_layers}")
        gpus = self.tp * self.pp
        if not self.cross_node and gpus > self.cluster.gpus_per_node:
            raise ValueError(
                f"tp*pp={gpus} exceeds gpus_per_node={self.cluster.gpus_per_node}; set cross_node to span nodes"
            )
        if gpus > self.cluster.num_gpus:
            raise ValueError(f"tp*pp={gpus} exceeds the cluster's {self.cluster.num_gpus} GPUs")

    # --- shapes per rank -------------------------------------------------------------------------------------

    @cached_property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.model.num_kv_heads // self.tp)

    @cached_property
    def stage_layers(self) -> list[int]:
        """Decoder layers of each pipeline stage, the first stages taking one more when they do not divide."""
        base, extra = divmod(self.model.num_layers, self.pp)
        return [base + (i < extra) for i in range(self.pp)]

    @cached_property
    def _layer_params_per_rank(self) -> float:
        m = self.model
        q_o = 2 * m.hidden_size * m.num_heads * m.head_dim / self.tp
        k_v = 2 * m.hidden_size * self.kv_heads_per_rank * m.head_dim
        mlp = (3 if m.gated_mlp else 2) * m.hidden_size * m.intermediate_size / self.tp
        return q_o + k_v + mlp

    @cached_property
    def _vocab_params_per_rank(self) -> float:
        # Embedding and LM head are vocab-parallel across TP, or whole on each rank when the vocabulary
        # does not divide.
        shards = self.tp if self.model.splits_vocab(self.tp) else 1
        return self.model.vocab_size * self.model.hidden_size / shards

    @cached_property
    def _kv_bytes_per_token_per_layer(self) -> int:
        """KV bytes one rank stores for one token in one layer, in the cache's dtype (not the weights')."""
        return 2 * self.kv_heads_per_rank * self.model.kv_head_bytes(self.dtype_bytes, self.kv_cache_dtype)

    # --- memory ----------------------------------------------------------------------------------------------

    def _stage_weight_bytes(self, stage: int) -> float:
        # The first stage holds the embedding, the last the LM head (both when pp == 1).
        vocab_tables = (stage == 0) + (stage == self.pp - 1)
        params = self.stage_layers[stage] * self._layer_params_per_rank + vocab_tables * self._vocab_params_per_rank
        return params * self.dtype_bytes

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Weight bytes on the most loaded GPU of the instance."""
        return max(self._stage_weight_bytes(s) for s in range(self.pp))

    def kv_capacity_tokens(self, memory_fraction: float = 0.9, activation_reserve_bytes: int = 1 << 30) -> int:
        """Tokens of KV the instance holds; 0 or less means the weights alone do not fit.

        Every token has KV on every rank, so the rank with the least room left sets the capacity.
        ``activation_reserve_bytes`` per GPU covers the CUDA context, NCCL buffers and peak activations.
        """
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        if activation_reserve_bytes < 0:
            raise ValueError(f"activation_reserve_bytes must be non-negative, got {activation_reserve_bytes!r}")
        usable = self.cluster.gpu.memory_bytes * memory_fraction - activation_reserve_bytes
        return min(
            math.floor((usable - self._stage_weight_bytes(s)) / (layers * self._kv_bytes_per_token_per_layer))
            for s, layers in enumerate(self.stage_layers)
        )

    @property
    def fits(self) -> bool:
        """Whether the weights fit with room for at least one token of KV, at the default memory settings."""
        return self.kv_capacity_tokens() > 0

    # --- time ------------------------------------------------------------------------------------------------

    def _roofline(self, flops: float, bytes_moved: float) -> float:
        gpu, eff = self.cluster.gpu, self.efficiency
        compute, memory = flops / (gpu.flops * eff.compute), bytes_moved / (gpu.memory_bandwidth * eff.memory)
        if isinstance(compute, np.ndarray):  # the times of several steps at once (``decode_times``)
            return np.maximum(compute, memory)
        return max(compute, memory)

    @cached_property
    def _spans_nodes(self) -> bool:
        return self.tp * self.pp > self.cluster.gpus_per_node

    def _link_bandwidth(self, crosses_node: bool) -> float:
        c = self.cluster
        return (c.inter_node_bandwidth if crosses_node else c.intra_node_bandwidth) * self.efficiency.communication

    def _allreduce_time(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        # A ring all-reduce moves 2(tp-1)/tp of the buffer over each link; one crossing a node is the bottleneck.
        size = tokens * self.model.hidden_size * self.dtype_bytes
        return 2 * (self.tp - 1) / self.tp * size / self._link_bandwidth(self.tp > self.cluster.gpus_per_node)

    def _send_time(self, tokens: int) -> float:
        # Stages are laid out node by node, so once an instance spans nodes assume its sends cross them.
        return tokens * self.model.hidden_size * self.dtype_bytes / self._link_bandwidth(self._spans_nodes)

    def _lm_head_time(self, num_tokens: int) -> float:
        params = self._vocab_params_per_rank
        return self._roofline(2 * params * num_tokens, params * self.dtype_bytes)

    def _stage_times(self, tokens: int, layer_flops: float, layer_bytes: float, sequences: int) -> list[float]:
        layer = self._roofline(layer_flops, layer_bytes) + 2 * self._allreduce_time(tokens)
        times = [n * layer for n in self.stage_layers]
        times[-1] += self._lm_head_time(sequences)
        return times

    def _prefill_stage_times(self, lengths: Sequence[int]) -> list[float]:
        if not lengths or any(length < 1 for length in lengths):
            raise ValueError(f"lengths must be a non-empty sequence of positive integers, got {lengths!r}")
        m = self.model
        tokens = sum(lengths)
        # QK^T and AV each take 2*l^2*head_dim FLOPs per head; causal masking halves that, since flash-attention
        # kernels skip the blocks above the diagonal.
        attention = 2 * sum(length * length for length in lengths) * m.head_dim * m.num_heads / self.tp
        flops = 2 * self._layer_params_per_rank * tokens + attention
        # Weights read once per layer, plus the new tokens' KV written to the cache.
        bytes_moved = self._layer_params_per_rank * self.dtype_bytes + tokens * self._kv_bytes_per_token_per_layer
        return self._stage_times(tokens, flops, bytes_moved, len(lengths))

    def prefill_stage_time(self, lengths: Sequence[int]) -> float:
        """Seconds of the slowest stage for one prefill batch: the pipeline's throughput bound."""
        return max(self._prefill_stage_times(lengths))

    def prefill_time(self, lengths: Sequence[int]) -> float:
        """Seconds one prefill batch (prompt lengths ``lengths``) takes through all stages."""
        return sum(self._prefill_stage_times(lengths)) + (self.pp - 1) * self._send_time(sum(lengths))

    def _decode_stage_times(self, batch_size: int, total_context: int) -> list[float]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size!r}")
        if total_context < 0:
            raise ValueError(f"total_context must be non-negative, got {total_context!r}")
        return self._decode_stage_times_of(batch_size, total_context)

    def _decode_stage_times_of(self, batch_size: int, total_context: int) -> list[float]:
        """The stages' times, ``total_context`` a number or an array of them (each a step's)."""
        m = self.model
        # Each new token attends to its whole context: QK^T and AV are 2*context*head_dim FLOPs per head each.
        attention = 4 * total_context * m.head_dim * m.num_heads / self.tp
        flops = 2 * self._layer_params_per_rank * batch_size + attention
        bytes_moved = (
            self._layer_params_per_rank * self.dtype_bytes + total_context * self._kv_bytes_per_token_per_layer
        )
        return self._stage_times(batch_size, flops, bytes_moved, batch_size)

    def decode_stage_time(self, batch_size: int, total_context: int) -> float:
        """Seconds of the slowest stage for one decode step: the pipeline's throughput bound."""
        return max(self._decode_stage_times(batch_size, total_context))

    def decode_time(self, batch_size: int, total_context: int) -> float:
        """Seconds of one decode step of ``batch_size`` sequences whose contexts sum to ``total_context`` tokens."""
        stages = self._decode_stage_times(batch_size, total_context)
        return _added_in_order(stages) + (self.pp - 1) * self._send_time(batch_size)

    def decode_times(self, batch_size: int, total_context: int, steps: int) -> np.ndarray:
        """``decode_time`` of ``steps`` decode steps of the same sequences, the first from
        ``total_context`` tokens, each one token per sequence more: the same arithmetic in the same
        order over an array, so each time is the very float ``decode_time`` gives."""
        self._decode_stage_times(batch_size, total_context)  # the arguments' checks
        contexts = total_context + batch_size * np.arange(steps, dtype=np.int64)
        stages = self._decode_stage_times_of(batch_size, contexts)  # type: ignore[arg-type]
        return _added_in_order(stages) + (self.pp - 1) * self._send_time(batch_size)


def _added_in_order(times: list) -> float:
    """The stages' times added first to last (``sum`` may add floats otherwise, which would part a
    step's time from the same step's in ``decode_times``)."""
    total = times[0]
    for time in times[1:]:
        total = total + time
    return total


def kv_transfer_time(
    model: ModelShape, tokens: int, bandwidth_bytes_per_s: float, dtype_bytes: int = 2, kv_cache_dtype: str = "auto"
) -> float:
    """Seconds to move ``tokens`` tokens of KV cache (all layers) over a link of the given bandwidth:
    a hand-over copies the cache's blocks as they are, so an 8-bit cache moves its codes and scales."""
    if tokens < 0:
        raise ValueError(f"tokens must be non-negative, got {tokens!r}")
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be positive, got {bandwidth_bytes_per_s!r}")
    return tokens * model.kv_bytes_per_token(dtype_bytes, kv_cache_dtype) / bandwidth_bytes_per_s
