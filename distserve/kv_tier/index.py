"""Which blocks the tier holds and where: an LRU index over a fixed number of slots.

A block is keyed by its prefix-cache hash and carries its tokens, so that a hash collision is never
taken for a hit. A slot is in one of three states: free, leased to a writer (which copies blocks
into its slots as it computes them and then commits them; invisible to readers meanwhile), or
holding a committed entry. A writer leases slots ahead, many at a time, so that saving a block
needs no call to the store before its copy. Readers pin the entries they found until their
copies are done; eviction takes the least recently used entry nobody pins. Every pin and lease
belongs to a holder (an instance), so that one that dies leaves none behind (``forget``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

Key = tuple[int, tuple[int, ...]]  # (block hash, the block's tokens)


@dataclass
class TierStats:
    """What the tier has done so far, in blocks."""

    queried: int = 0  # blocks looked up
    hits: int = 0  # of those, found (remote hits included)
    remote_hits: int = 0  # found on another node's tier and copied here
    written: int = 0  # committed by writers
    evicted: int = 0


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    slot: int
    pins: int = 0


@dataclass
class TierIndex:
    capacity: int
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"a tier needs at least one slot, got {self.capacity}")
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by hash, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))  # popped from the end: lowest first
        self._leased: dict[int, str] = {}  # slot: the holder that may write into it
        self._pins: dict[str, Counter[int]] = {}  # holder: hash -> pins

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_pinned(self) -> int:
        """Entries some reader's copies are still to read."""
        return sum(1 for entry in self._entries.values() if entry.pins)

    @property
    def num_leased(self) -> int:
        """Slots leased to writers."""
        return len(self._leased)

    def lookup(self, holder: str, keys: list[Key], pin: bool = True, count: bool = True) -> list[int]:
        """The slots of the longest leading run of ``keys`` held, each pinned for ``holder`` until
        ``release`` (unless not ``pin``: the caller copies them before it lets go of the index);
        ``count``: in the stats of lookups."""
        slots = []
        for h, tokens in keys:
            entry = self._entries.get(h)
            if entry is None or entry.tokens != tokens:
                break
            self._entries.move_to_end(h)
            slots.append(entry.slot)
            if pin:
                entry.pins += 1
                self._pins.setdefault(holder, Counter())[h] += 1
        if count:
            self.stats.queried += len(keys)
            self.stats.hits += len(slots)
        return slots

    def release(self, holder: str, hashes: list[int]) -> None:
        """``holder``'s copies out of these entries are done."""
        pins = self._pins.get(holder, Counter())
        for h in hashes:
            if pins[h] > 0:
                pins[h] -= 1
                if entry := self._entries.get(h):
                    entry.pins -= 1
        self._pins[holder] = +pins

    def lease(self, holder: str, count: int) -> list[int]:
        """Up to ``count`` slots for ``holder`` to write blocks into, fewer where every other slot
        is pinned or leased; each is ``holder``'s until it commits a block to it or is forgotten."""
        slots = []
        while len(slots) < count and (slot := self._take_slot()) is not None:
            self._leased[slot] = holder
            slots.append(slot)
        return slots

    def commit(self, holder: str, written: list[tuple[int, Key]]) -> None:
        """``holder`` wrote these blocks into these leased slots: they become entries, the most
        recently used, unless the tier holds the block already (another writer's came first), when
        the slot is free again."""
        for slot, (h, tokens) in written:
            if self._leased.get(slot) != holder:
                continue  # forgotten meanwhile
            del self._leased[slot]
            if h in self._entries:
                self._free.append(slot)
                continue
            self._entries[h] = _Entry(tokens, slot)
            self.stats.written += 1

    def forget(self, holder: str) -> None:
        """``holder`` is gone: drop its pins and its leases."""
        for h, pins in self._pins.pop(holder, Counter()).items():
            if entry := self._entries.get(h):
                entry.pins -= pins
        for slot, owner in list(self._leased.items()):
            if owner == holder:
                del self._leased[slot]
                self._free.append(slot)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, entry in self._entries.items():  # least recently used first
            if not entry.pins:
                del self._entries[h]
                self.stats.evicted += 1
                return entry.slot
        return None
