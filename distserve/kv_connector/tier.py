"""The node's shared prefix tier (``kv_tier/``) as a connector.

Scheduler half: the block manager asks it, as it allocates a prompt, for the blocks past the
instance's cached prefix (a lookup in the node's store, which pins what it finds until the step is
done), tells it the blocks allocated for them, and hands it each block it computes to save (holding
a reference to the block until the step is done). Each step's copies go into slots leased from the
store ahead (``TierClient.plan``); once the step is done the store commits what was saved and
unpins what was read (``TierClient.settle``). Worker half: each rank maps its layers and KV heads
of the node's pool and copies blocks in before the forward pass and out after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from distserve.core.sequence import Sequence
from distserve.kv_connector.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker, RankKVCache
from distserve.kv_tier.index import Key

if TYPE_CHECKING:
    import torch

    from distserve.kv_tier.client import TierClient
    from distserve.kv_transfer.plan import KVCacheShape, KVLayout
    from distserve.kv_transfer.shared_memory import SharedFile
    from distserve.scheduling.block_manager import BlockManager


@dataclass
class TierMetadata(KVConnectorMetadata):
    connector: ClassVar[str] = "tier"

    loads: list[tuple[int, int]]  # (block, tier slot): copied in before the forward pass
    saves: list[tuple[int, int]]  # (block, tier slot): copied out after it (blocks this step computed, or earlier ones)


class TierConnector(KVConnectorScheduler):
    name = TierMetadata.connector

    def __init__(self, block_manager: BlockManager, client: TierClient) -> None:
        self.block_manager = block_manager
        self.client = client
        self._found: dict[int, list[tuple[Key, int]]] = {}  # by sequence id: (key, slot) found, until allocated
        self._loads: list[tuple[Key, int, int]] = []  # (key, tier slot, block) to copy in
        self._saves: list[tuple[Key, int]] = []  # (key, block) to copy out; the block manager holds the block
        self._step: tuple[list[tuple[Key, int, int]], list[tuple[int, int, Key]], list[tuple[Key, int]]] | None = None

    def get_num_new_matched_tokens(self, seq: Sequence, keys: list[Key]) -> int:
        slots = self.client.lookup(keys)
        if slots:
            self._found[seq.seq_id] = list(zip(keys, slots))
        return len(slots) * self.block_manager.block_size

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int]) -> None:
        found = self._found.pop(seq.seq_id)
        self._loads += [(key, slot, block) for (key, slot), block in zip(found, block_ids)]

    def save_block(self, key: Key, block_id: int) -> None:
        """Block ``block_id`` is computed by the step being scheduled (or was before it): copy it out
        after that step's forward pass. The block manager holds a reference to it until then."""
        self._saves.append((key, block_id))

    def build_connector_meta(self) -> TierMetadata | None:
        loads, saves = self._loads, self._saves
        if not loads and not saves:
            return None
        self._loads, self._saves = [], []
        load_pairs, planned = self.client.plan(loads, saves)
        self._step = loads, planned, saves
        return TierMetadata(load_pairs, [(block, slot) for block, slot, _ in planned])

    def update_connector_output(self, meta: TierMetadata, seconds: float) -> None:
        """The blocks saved are in the tier and those loaded may go from it; the saved blocks'
        references go (a block that found no slot to lease was not saved, and goes too)."""
        loads, planned, saves = self._step
        self._step = None
        self.client.settle(loads, planned)
        self.block_manager.saved([block for _, block in saves])


class TierConnectorWorker(KVConnectorWorker):
    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool  # this rank's layers and KV heads of the node's pool

    @classmethod
    def attach(
        cls, geometry: KVCacheShape, shared: SharedFile, own: KVCacheShape, layout: KVLayout
    ) -> TierConnectorWorker:
        """Map the node's pool (``geometry``, in ``shared``), the part of it a rank of cache ``own``
        and ``layout`` holds. OSError where it cannot be mapped (not this machine's), ValueError
        where its blocks are not this model's."""

        def blocks(shape: KVCacheShape) -> tuple:
            return shape.block_size, shape.head_dim, shape.storage_dtype, shape.cache_dtype

        if blocks(geometry) != blocks(own):
            raise ValueError(f"the tier holds blocks of {geometry}, this rank's are {own}")
        pool = shared.open()
        # Map every page now: each first touch of a page of the pool is a fault in this process, and
        # a step saving 16 blocks (8 MiB) to pages not yet touched took 5 ms, most of it faults.
        # Reading is enough on shared memory (and writing would race with the other processes).
        flat = pool.view(-1)
        flat[:: max(1, 4096 // flat.element_size())].sum()
        layers, heads = layout.layers, layout.kv_heads
        return cls(pool[layers.start : layers.stop, :, :, heads.start : heads.stop])

    def start_load_kv(self, kv_cache: RankKVCache, meta: TierMetadata) -> None:
        kv_cache.copy_host(self.pool, False, meta.loads)

    def wait_for_save(self, kv_cache: RankKVCache, meta: TierMetadata) -> None:
        kv_cache.copy_host(self.pool, True, meta.saves)
