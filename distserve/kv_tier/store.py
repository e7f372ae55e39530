"""One node's share of the tier: a Ray actor on that node holding the index and a pool of KV blocks
in shared memory, which every rank on the node maps and copies blocks in and out of itself.

The pool is laid out as a KV cache of the whole model, ``[layers, 2, slots * block_size, kv_heads,
head_dim]``, so a rank moves its layers and heads of a block with the copies its cache's swap
uses, whatever its TP and PP degrees. The store only keeps the index: a lookup answers slots, and
KV never passes through the actor on one node. A lookup that misses here asks the other nodes'
stores, and copies what the best of them holds into this pool through Ray's object store, so a
prefix computed on one node is read, not recomputed, on another.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distserve.kv_tier.index import Key, TierIndex
from distserve.kv_transfer.plan import KVCacheShape
from distserve.kv_transfer.shared_memory import SharedFile, shared_zeros

logger = logging.getLogger(__name__)

STORE_CONCURRENCY = 8  # lookups of several instances, and other nodes' exports, at once


@dataclass
class TierInfo:
    """A store's state and what it has done, for metrics."""

    node_id: str
    capacity_blocks: int
    num_entries: int
    num_pinned: int  # entries a reader still copies from
    num_leased: int  # slots leased to writers, not yet written
    bytes_per_block: int
    queried_blocks: int
    hit_blocks: int
    remote_hit_blocks: int
    written_blocks: int
    evicted_blocks: int


class KVTierStore:
    def __init__(self, geometry: KVCacheShape, num_blocks: int) -> None:
        self.geometry = geometry
        self.node_id = ray.get_runtime_context().get_node_id()
        self.pool, self.shared = shared_zeros(geometry.dims(num_blocks), geometry.storage_dtype)
        self.index = TierIndex(num_blocks)
        self._lock = threading.Lock()
        self._peers: list[Any] = []

    def describe(self) -> tuple[KVCacheShape, SharedFile, int]:
        """What a rank on this node needs to map the pool, and how many blocks it holds."""
        return self.geometry, self.shared, self.index.capacity

    def set_peers(self, peers: list[Any]) -> None:
        """The other nodes' stores, asked when a lookup misses here."""
        self._peers = peers

    def lookup(self, holder: str, keys: list[Key]) -> list[int]:
        """Slots of the longest leading run of ``keys`` held here or, past what is held here, on
        another node; pinned for ``holder`` until ``settle`` releases them."""
        with self._lock:
            slots = self.index.lookup(holder, keys)
        if len(slots) < len(keys) and self._peers:
            slots += self._fetch(holder, keys[len(slots) :])
        return slots

    def lease(self, holder: str, count: int) -> list[int]:
        with self._lock:
            return self.index.lease(holder, count)

    def settle(self, holder: str, written: list[tuple[int, Key]], read: list[int]) -> None:
        """``holder``'s step is done: the blocks it ``written`` into its leased slots are entries
        now, and the entries it ``read`` (by hash) are no longer pinned."""
        with self._lock:
            self.index.commit(holder, written)
            self.index.release(holder, read)

    def forget(self, holder: str) -> None:
        with self._lock:
            self.index.forget(holder)

    def export(self, keys: list[Key]) -> np.ndarray | None:
        """The KV of the longest leading run of ``keys`` held here, as bytes (``[layers, 2, blocks *
        block_size, heads, head_dim]``), for another node's store; None when the first is not held."""
        with self._lock:
            slots = self.index.lookup("", keys, pin=False, count=False)
            if not slots:
                return None
            data = self.pool.index_select(2, self.geometry.block_slots(slots))
        return data.view(-1).view(torch.uint8).numpy()

    def _fetch(self, holder: str, keys: list[Key]) -> list[int]:
        """Copy the longest leading run of ``keys`` any other node holds into this pool; its slots,
        pinned for ``holder``."""
        exports = ray.get([peer.export.remote(keys) for peer in self._peers])
        best = max((e for e in exports if e is not None), key=len, default=None)
        if best is None:
            return []
        geometry = self.geometry
        count = len(best) // geometry.bytes_per_block
        # A copy: the object store's buffer is read-only, which torch does not take without a warning.
        data = torch.from_numpy(best.copy()).view(geometry.storage_dtype).view(geometry.dims(count))
        fetcher = f"fetch:{holder}"
        with self._lock:
            slots = self.index.lease(fetcher, count)
            if len(slots) < count:  # no room
                self.index.forget(fetcher)
                return []
            self.pool.index_copy_(2, geometry.block_slots(slots), data)
            self.index.commit(fetcher, list(zip(slots, keys)))
            self.index.stats.remote_hits += count
            found = self.index.lookup(holder, keys[:count], count=False)
            self.index.stats.hits += len(found)
            return found

    def info(self) -> TierInfo:
        with self._lock:
            stats, entries = dataclasses.replace(self.index.stats), len(self.index)
            pinned, leased = self.index.num_pinned, self.index.num_leased
        return TierInfo(
            self.node_id,
            self.index.capacity,
            entries,
            pinned,
            leased,
            self.geometry.bytes_per_block,
            stats.queried,
            stats.hits,
            stats.remote_hits,
            stats.written,
            stats.evicted,
        )


def tier_blocks(space_gib: float, geometry: KVCacheShape) -> int:
    """Blocks of ``space_gib`` GiB."""
    return int(space_gib * 2**30) // geometry.bytes_per_block


def start_tier_stores(prefix: str, geometry: KVCacheShape, num_blocks: int) -> dict[str, Any]:
    """A store on every alive Ray node, each knowing the others; by node id."""
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    stores = {
        node: ray.remote(KVTierStore)
        .options(
            name=f"{prefix}-kv-tier-{node[:12]}",
            num_cpus=0,
            max_concurrency=STORE_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote(geometry, num_blocks)
        for node in nodes
    }
    ray.get([store.set_peers.remote([s for n, s in stores.items() if n != node]) for node, store in stores.items()])
    logger.info("KV tier: %d blocks (%.1f MiB) on each of %d nodes", num_blocks,
                num_blocks * geometry.bytes_per_block / 2**20, len(stores))  # fmt: skip
    return stores
