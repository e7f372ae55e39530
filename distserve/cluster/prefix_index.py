"""Which prompt prefixes each instance has lately been sent, so the orchestrator can send a
request where its prefix is likely still in the prefix cache.

It is the orchestrator's own memory of where prompts went (bounded, oldest forgotten first),
not a view of the instances' caches: a hit is a good guess, not a promise.
"""

from __future__ import annotations

from collections import OrderedDict

from distserve.scheduling.block_manager import chain_hash, prefix_root


class PrefixIndex:
    def __init__(self, block_size: int, capacity: int = 1 << 16) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        """Keys of the prompt's full blocks, as the block manager computes them."""
        hashes, parent = [], prefix_root(cache_salt)
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = chain_hash(parent, token_ids[start : start + self.block_size])
            hashes.append(parent)
        return hashes

    def matched_blocks(self, instance: str, hashes: list[int]) -> int:
        """How many leading blocks of the prompt were sent to ``instance`` before."""
        count = 0
        for h in hashes:
            if (instance, h) not in self._seen:
                break
            count += 1
        return count

    def add(self, instance: str, hashes: list[int]) -> None:
        for h in hashes:
            self._seen[(instance, h)] = None
            self._seen.move_to_end((instance, h))
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
