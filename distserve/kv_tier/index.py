"""Which blocks the tier holds and where: an LRU index over a fixed number of slots.

A block is keyed by its prefix-cache hash and carries its tokens, so that a hash collision is never
taken for a hit. A slot is in one of three states: free, reserved by a writer (its KV is being
copied in; invisible to readers), or holding a committed entry. Readers pin the entries they
found until their copies are done; eviction takes the least recently used entry nobody pins.
Every pin and reservation belongs to a holder (an instance), so that one that dies leaves none
behind (``forget``).
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
        self._reserved: dict[int, tuple[str, int, tuple[int, ...]]] = {}  # slot: (holder, hash, tokens)
        self._pins: dict[str, Counter[int]] = {}  # holder: hash -> pins

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_pinned(self) -> int:
        """Entries some reader's copies are still to read."""
        return sum(1 for entry in self._entries.values() if entry.pins)

    @property
    def num_reserved(self) -> int:
        """Slots a writer is copying into."""
        return len(self._reserved)

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

    def reserve(self, holder: str, keys: list[Key]) -> list[int | None]:
        """A slot for each key to write, or None where the tier holds it already (or a writer is on
        it) or no slot can be had: every entry is pinned or reserved."""
        writing = {h for _, h, _ in self._reserved.values()}
        slots: list[int | None] = []
        for h, tokens in keys:
            if h in self._entries or h in writing or (slot := self._take_slot()) is None:
                slots.append(None)
                continue
            self._reserved[slot] = (holder, h, tokens)
            writing.add(h)
            slots.append(slot)
        return slots

    def commit(self, holder: str, slots: list[int]) -> None:
        """The KV of these reserved slots is written: they become entries, the most recently used."""
        for slot in slots:
            owner, h, tokens = self._reserved.get(slot, (None, 0, ()))
            if owner != holder:
                continue  # forgotten meanwhile
            del self._reserved[slot]
            self._entries[h] = _Entry(tokens, slot)
            self.stats.written += 1

    def forget(self, holder: str) -> None:
        """``holder`` is gone: drop its pins and its reservations."""
        for h, pins in self._pins.pop(holder, Counter()).items():
            if entry := self._entries.get(h):
                entry.pins -= pins
        for slot, (owner, _, _) in list(self._reserved.items()):
            if owner == holder:
                del self._reserved[slot]
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
