"""Which rank of one instance sends which KV to which rank of another.

Every rank holds some decoder layers (its pipeline stage) and some KV heads (its tensor parallel
share, or one replicated head). A transfer plan gives each destination rank the source ranks
that cover its layers and heads, each (layer, head) from exactly one source, so two instances of
any TP and PP degrees can hand KV over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distserve.core.kv_cache_dtype import is_quantized, slot_width
from distserve.parallel.ranks import ParallelRank, stage_layers


@dataclass(frozen=True)
class KVCacheShape:
    """The KV blocks of some layers and KV heads: a rank's cache, or a whole model's (the prefix tier's)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's
    cache_dtype: str = "auto"  # what the cache stores: the model's dtype, or 8-bit codes and scales

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's element type."""
        return torch.int8 if is_quantized(self.cache_dtype) else self.dtype

    @property
    def slot_width(self) -> int:
        """Elements of one KV head in a slot (``head_dim``, and an 8-bit cache's 4 scale bytes)."""
        return slot_width(self.head_dim, self.cache_dtype)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.slot_width * element

    def dims(self, num_blocks: int) -> tuple[int, ...]:
        """A cache tensor's: ``[layers, 2, num_blocks * block_size, kv_heads, slot_width]``."""
        return (self.num_layers, 2, num_blocks * self.block_size, self.num_kv_heads, self.slot_width)

    def block_slots(self, blocks: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """The slots of ``blocks`` on a cache tensor's slot axis, in order."""
        ids = torch.tensor(blocks, dtype=torch.long, device=device)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size, device=device)).flatten()


@dataclass(frozen=True)
class KVLayout:
    """The part of the model's KV that one rank holds."""

    layers: range  # model layer indices
    kv_heads: range  # model KV head indices


def rank_layout(num_layers: int, num_kv_heads: int, rank: ParallelRank) -> KVLayout:
    layers = stage_layers(num_layers, rank.pp_size, rank.pp_rank)
    if num_kv_heads >= rank.tp_size:
        per_rank = num_kv_heads // rank.tp_size
        return KVLayout(layers, range(rank.tp_rank * per_rank, (rank.tp_rank + 1) * per_rank))
    head = rank.tp_rank * num_kv_heads // rank.tp_size  # replicated: the head this rank's queries read
    return KVLayout(layers, range(head, head + 1))


@dataclass(frozen=True)
class TransferPart:
    """Source rank ``src`` sends destination rank ``dst`` these layers and KV heads."""

    src: int
    dst: int
    layers: range
    kv_heads: range


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def plan_transfer(sources: list[KVLayout], destinations: list[KVLayout]) -> list[TransferPart]:
    """Parts that give every destination rank all of its layers and heads, each exactly once.

    Replicated heads on the source side appear on several ranks: the lowest rank sends them.
    """
    parts = []
    for dst, want in enumerate(destinations):
        covered: set[tuple[range, range]] = set()
        for src, have in enumerate(sources):
            layers, heads = _overlap(have.layers, want.layers), _overlap(have.kv_heads, want.kv_heads)
            if len(layers) and len(heads) and (layers, heads) not in covered:
                covered.add((layers, heads))
                parts.append(TransferPart(src, dst, layers, heads))
    return parts


def transfer_rounds(plan: list[TransferPart]) -> list[list[TransferPart]]:
    """The plan's parts in rounds in which no rank takes part twice.

    A rank moves one transfer at a time through its staging buffers, so two parts that share a
    rank must not be asked for together: a source serving one destination while another
    destination waits for it, and that one waits for a third, can close a cycle. Run round by
    round, every destination rank waits for one source at a time, which is free to serve it.
    """
    rounds: list[list[TransferPart]] = []
    left = list(plan)
    while left:
        busy: set[tuple[str, int]] = set()
        round_ = []
        for part in left:
            if ("src", part.src) not in busy and ("dst", part.dst) not in busy:
                busy |= {("src", part.src), ("dst", part.dst)}
                round_.append(part)
        left = [part for part in left if part not in round_]
        rounds.append(round_)
    return rounds


def token_slots(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    """The cache slots of the first ``num_tokens`` tokens of a sequence with this block table."""
    return [block_table[i // block_size] * block_size + i % block_size for i in range(num_tokens)]


@dataclass
class KVEndpoint:
    """A rank reachable for KV transfers: its Worker actor, or the Instance actor that runs its only
    rank in process. Both answer ``kv(method, *args)``."""

    handle: Any
    layout: KVLayout

    def call(self, method: str, *args):
        return self.handle.kv.remote(method, *args)


@dataclass
class KVSource:
    """How a puller reaches the KV an instance holds for it, carried in each hand-over: the
    instance's ranks, and its holder, which answers ``release_kv(request_id, attempt)`` (True: the
    KV was still held, so what was pulled is valid; its blocks go now)."""

    endpoints: list[KVEndpoint]
    holder: Any

    def release(self, request_id: str, attempt: int):
        return self.holder.release_kv.remote(request_id, attempt)
