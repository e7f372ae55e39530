"""An engine's side of its node's tier store: lookups while it schedules, and each step's copies.

The tier is a cache: when its store cannot be reached the engine goes on without it (lookups find
nothing, nothing is saved), and says so once in its log.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from distserve.kv_tier.index import Key

logger = logging.getLogger(__name__)


class TierClient:
    def __init__(self, store: Any, holder: str) -> None:
        self.store = store
        self.holder = holder
        # A replacement may take a failed instance's name: what that one held goes now.
        ray.get(store.forget.remote(holder))
        self.geometry, self.shared = ray.get(store.describe.remote())
        self.broken = False
        self.loaded_blocks = 0
        self.saved_blocks = 0

    def lookup(self, keys: list[Key]) -> list[int]:
        return self._call("lookup", keys) or []

    def plan(
        self, loads: list[tuple[Key, int, int]], saves: list[tuple[Key, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """A step's (block, slot) copies in from the tier, and out to it: each block to save gets a
        slot unless the tier holds it already or has no room."""
        slots = self._call("reserve", [key for key, _ in saves]) if saves else None
        out = [(block, slot) for (_, block), slot in zip(saves, slots or ()) if slot is not None]
        return [(block, slot) for _, slot, block in loads], out

    def settle(self, loads: list[tuple[Key, int, int]], saved: list[tuple[int, int]]) -> None:
        """The step is done: the blocks it saved are in the tier, and those it loaded may go."""
        self.loaded_blocks += len(loads)
        self.saved_blocks += len(saved)
        if not self.broken:  # not waited for: the next lookup need not see it
            self.store.settle.remote(self.holder, [slot for _, slot in saved], [key[0] for key, _, _ in loads])

    def _call(self, method: str, *args: Any) -> Any:
        if self.broken:
            return None
        try:
            return ray.get(getattr(self.store, method).remote(self.holder, *args))
        except ray.exceptions.RayError as e:
            logger.error("%s: the KV tier's store is gone (%s); going on without it", self.holder, e)
            self.broken = True
            return None
