"""Preemption by swap as a connector: the copies ``SwapSpace`` queues (``scheduling/swap.py``: out to
the host pool and back, in order) made by every rank before the step's forward pass, and their time
fed back to the choice between swap and recompute. Which sequence swaps, and when it comes back,
stays the scheduler's decision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distserve.kv_connector.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker, RankKVCache
from distserve.scheduling.swap import SwapCopy, SwapSpace


@dataclass
class SwapMetadata(KVConnectorMetadata):
    connector: ClassVar[str] = "swap"

    copies: list[SwapCopy]

    @property
    def num_blocks(self) -> int:
        return sum(len(copy.pairs) for copy in self.copies)


class SwapConnector(KVConnectorScheduler):
    name = SwapMetadata.connector

    def __init__(self, swap: SwapSpace) -> None:
        self.swap = swap

    def build_connector_meta(self) -> SwapMetadata | None:
        copies = self.swap.take_pending()
        return SwapMetadata(copies) if copies else None

    def update_connector_output(self, meta: SwapMetadata, seconds: float) -> None:
        self.swap.observe(meta.num_blocks, seconds)


class SwapConnectorWorker(KVConnectorWorker):
    """The copies go through the cache's own swap (``KVCache.swap``): on CUDA on a stream of their
    own, timed by events and read once the forward pass is done."""

    def start_load_kv(self, kv_cache: RankKVCache, meta: SwapMetadata) -> None:
        for copy in meta.copies:
            kv_cache.swap(copy.out, copy.pairs)

    def get_finished(self, kv_cache: RankKVCache) -> float:
        return kv_cache.swap_seconds()
