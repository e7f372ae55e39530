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


# Slots an engine leases at a time: at most this many (with 16-token blocks, 1,024 tokens to save),
# and at most this share of the tier, which leased slots are taken from.
LEASE_BLOCKS = 64
LEASE_SHARE = 1 / 16


class TierClient:
    """Saving a block needs a slot leased from the store beforehand: a decode step, which saves a
    block or two, makes no call to the store. A step that saves more than the slots at hand (a
    prefill) leases the rest before its copies, and while the slots run low the next lease is asked
    for in the background. Measured on this machine's CPU, a call to the store before each saving
    step cost 2.1-2.6 ms of a 50 ms decode step."""

    def __init__(self, store: Any, holder: str) -> None:
        self.store = store
        self.holder = holder
        # A replacement may take a failed instance's name: what that one held goes now.
        ray.get(store.forget.remote(holder))
        self.geometry, self.shared, capacity = ray.get(store.describe.remote())
        self.lease_blocks = max(1, min(LEASE_BLOCKS, int(capacity * LEASE_SHARE)))
        self.broken = False
        self._slots = self._call("lease", self.lease_blocks) or []  # leased, free to write into
        self._refill: Any = None  # the next lease, asked for while the slots run low
        self.loaded_blocks = 0
        self.saved_blocks = 0

    def lookup(self, keys: list[Key]) -> list[int]:
        return self._call("lookup", keys) or []

    def plan(
        self, loads: list[tuple[Key, int, int]], saves: list[tuple[Key, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, Key]]]:
        """A step's copies in from the tier, (block, slot) each, and out to it, (block, slot, key)
        each, into leased slots (a block finds none only where the tier has no slot to lease)."""
        self._take_refill()
        if len(saves) > len(self._slots):
            self._slots += self._call("lease", len(saves) - len(self._slots)) or []
        out = [(block, self._slots.pop(), key) for key, block in saves[: len(self._slots)]]
        if len(self._slots) < self.lease_blocks // 2 and self._refill is None and not self.broken:
            self._refill = self.store.lease.remote(self.holder, self.lease_blocks - len(self._slots))
        return [(block, slot) for _, slot, block in loads], out

    def settle(self, loads: list[tuple[Key, int, int]], saved: list[tuple[int, int, Key]]) -> None:
        """The step is done: the blocks it saved are in the tier, and those it loaded may go."""
        self.loaded_blocks += len(loads)
        self.saved_blocks += len(saved)
        if not self.broken and (loads or saved):  # not waited for: the next lookup need not see it
            written = [(slot, key) for _, slot, key in saved]
            self.store.settle.remote(self.holder, written, [key[0] for key, _, _ in loads])

    def _take_refill(self) -> None:
        """The slots of the lease asked for, if it has come."""
        if self._refill is None or not ray.wait([self._refill], timeout=0)[0]:
            return
        refill, self._refill = self._refill, None
        try:
            self._slots += ray.get(refill)
        except ray.exceptions.RayError as e:
            self._lost(e)

    def _call(self, method: str, *args: Any) -> Any:
        if self.broken:
            return None
        try:
            return ray.get(getattr(self.store, method).remote(self.holder, *args))
        except ray.exceptions.RayError as e:
            self._lost(e)
            return None

    def _lost(self, error: Exception) -> None:
        logger.error("%s: the KV tier's store is gone (%s); going on without it", self.holder, error)
        self.broken = True
        self._slots = []
