"""The one seam through which a step moves KV into and out of an instance's cache, in two halves
as vLLM v1's ``KVConnectorBase_V1``.

The scheduler half lives in the engine and is plain Python: at allocation it says how much of a
prompt past the instance's own cached prefix it can load, and is told the blocks that KV goes
into; before each step it builds the step's metadata (what to load and save, ``build_connector_meta``);
after it, it learns how long the copies took (``update_connector_output``). The worker half runs on
every rank with the step's metadata: it starts the loads before the forward pass, makes the saves
after it, and reports the time of copies that ran on the device beside the forward pass.

A step's ``BatchInput.kv_connectors`` holds one metadata object per connector with work, in the
engine's order of connectors, which is the order of their loads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Protocol

from distserve.core.sequence import Sequence
from distserve.scheduling.block_manager import TierKey

if TYPE_CHECKING:
    import torch


class KVConnectorMetadata:
    """One connector's work for one step, as every rank gets it: kept small, it crosses to the
    workers with the batch. ``connector`` names the connector, which is also the step timer's
    phase its copies are booked to."""

    connector: ClassVar[str]


class KVConnectorScheduler(ABC):
    """A connector's scheduler half, in the engine."""

    name: ClassVar[str]  # its metadata's ``connector``

    def get_num_new_matched_tokens(self, seq: Sequence, keys: list[TierKey]) -> int:
        """Tokens past ``seq``'s cached prefix whose KV it can load: of the longest leading run of
        ``keys`` (the keys of its blocks past that prefix) it holds. What it found is kept for
        ``seq`` until ``update_state_after_alloc``, which the allocation that asked calls next."""
        return 0

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int]) -> None:
        """``block_ids`` are the blocks allocated for what ``get_num_new_matched_tokens`` found:
        their KV is to be loaded before the step's forward pass."""
        return None  # one that finds nothing is never told

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """What the step about to run loads and saves; None when nothing."""

    def update_connector_output(self, meta: KVConnectorMetadata, seconds: float) -> None:
        """The step that ran ``meta`` is done on every rank; its copies took ``seconds`` on the
        driver rank (its phase of the step timer)."""
        return None  # one that learns nothing from the step


class RankKVCache(Protocol):
    """A rank's paged KV cache as a worker half moves KV in and out of it
    (``model_executor.kv_cache.KVCache``)."""

    def swap(self, out: bool, pairs: list[tuple[int, int]]) -> None: ...

    def swap_seconds(self) -> float: ...

    def copy_host(
        self, host: torch.Tensor, out: bool, pairs: list[tuple[int, int]], non_blocking: bool = False
    ) -> None: ...


class KVConnectorWorker(ABC):
    """A connector's worker half, on each rank: its part (layers and KV heads) of each copy."""

    @abstractmethod
    def start_load_kv(self, kv_cache: RankKVCache, meta: KVConnectorMetadata) -> None:
        """This step's copies into the cache, before the forward pass (and before the step's copies
        on write, which may fill a block a load freed). They may run on the device beside the rest
        of the step, ordered before the forward pass."""

    def wait_for_save(self, kv_cache: RankKVCache, meta: KVConnectorMetadata) -> None:
        """This step's copies out of the cache, after the forward pass; done when it returns, so
        that the step's answer means they are there."""
        return None  # one that only loads

    def get_finished(self, kv_cache: RankKVCache) -> float:
        """Seconds of this step's copies that ran on the device beside the forward pass, once they
        are done (they are booked to this connector's phase, out of the forward pass's)."""
        return 0.0
