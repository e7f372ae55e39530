"""KV block allocation: reference counts, prefix caching by block hash, LRU eviction.

A full block is identified by ``hash((parent_hash, block_tokens))``, so equal hashes mean equal
prefixes up to hash collisions, which are ruled out by comparing the stored tokens. The first
block's parent is the request's ``cache_salt`` (``prefix_root``): prompts of different salts share
no block, here, in the tier or in the router's record of where prefixes went. Freed
blocks that carry a hash stay findable until reused: the free list is ordered least recently
freed first, so allocation evicts the coldest cached block.

The free list is kept in three parts, in the order blocks are handed out: freed blocks without a
hash (the latest first: nothing to reuse in them), blocks never used (by id) and freed blocks in
the order they were freed. Blocks never used are only a counter and get their ``Block`` when first
taken, so a pool of millions of blocks costs nothing to make (the planner simulates many).

The samples of one request share their prompt's blocks (``fork``); the first of them to write a
token into a shared block gets a copy of it (copy on write): the copies a step needs wait in
``pending_copies`` for the workers to make before its forward pass.

With a second tier (``tier``: the scheduler half of the node's shared prefix tier's connector,
``kv_connector/tier.py``), a prompt's blocks past its cached prefix are looked up there too; those
found are copied in before the step's forward pass and count as cached. Every block computed here
is saved to the tier after the step that computes it, holding a reference until then (``saved``),
so that it is not reused before the copy.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Protocol

from distserve.core.sequence import Sequence

TierKey = tuple[int, tuple[int, ...]]  # (block hash, the block's tokens)


class PrefixTier(Protocol):
    """Where a prompt's blocks past this pool's cached prefix may come from, and where blocks
    computed here go (``kv_connector/base.py`` says what each call means)."""

    def get_num_new_matched_tokens(self, seq: Sequence, keys: list[TierKey]) -> int: ...

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int]) -> None: ...

    def save_block(self, key: TierKey, block_id: int) -> None: ...


def chain_hash(parent: int, tokens: list[int]) -> int:
    """The key of a full block: its tokens and, through the parent's key, everything before them."""
    return hash((parent, tuple(tokens)))


def prefix_root(cache_salt: str | None) -> int:
    """The parent key of a prompt's first block: 0 unsalted, else one drawn from the salt, so that
    every block of the prompt hashes apart from the same tokens under another salt or none (vLLM
    puts the salt in its first block's hash, as here). A digest, not ``hash()``: keys must agree
    between processes (the tier is shared), and Python salts the hashes of strings per process."""
    if cache_salt is None:
        return 0
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little", signed=True)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._used: list[Block] = []  # blocks 0 .. next never-used id - 1
        self._free_front: deque[int] = deque()  # freed without a hash, the latest first
        self._free_back: OrderedDict[int, None] = OrderedDict()  # freed with a hash, least recently first
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.pending_copies: list[tuple[int, int]] = []  # (source block, destination block)
        self.num_copied_blocks = 0  # copies on write so far
        self.tier: PrefixTier | None = None
        self.tier_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_front) + self._num_blocks - len(self._used) + len(self._free_back)

    @property
    def blocks(self) -> list[Block]:
        """Every block, by id (those never used made now)."""
        return self._used + [Block(i) for i in range(len(self._used), self._num_blocks)]

    @property
    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they are handed out."""
        return [*self._free_front, *range(len(self._used), self._num_blocks), *self._free_back]

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix caching on or off; off forgets every cached block (they stay free)."""
        self.enable_prefix_caching = enabled
        if not enabled:
            for block in self._used:
                block.hash, block.token_ids = None, ()
            self.hash_to_block_id.clear()

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # Prefix lookup -------------------------------------------------------------------------

    def _block_hash(self, seq: Sequence, index: int) -> int:
        """Hash of full block ``index`` of ``seq``, memoised on the sequence (its tokens never change)."""
        hashes = seq.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i else prefix_root(seq.sampling_params.cache_salt)
            hashes.append(chain_hash(parent, seq.block_tokens(i, self.block_size)))
        return hashes[index]

    def _shareable_blocks(self, seq: Sequence) -> int:
        """How many leading blocks of ``seq`` may come from a cache: full blocks inside the first
        ``num_tokens - 1`` tokens (the last token is always computed, because its logits are needed
        to sample the next one); none without prefix caching or for a prompt whose logprobs are asked
        for, which come from computing every prompt token."""
        if not self.enable_prefix_caching:
            return 0
        if seq.sampling_params.prompt_logprobs is not None and not seq.num_output_tokens:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``."""
        hits: list[int] = []
        for i in range(self._shareable_blocks(seq)):
            block_id = self.hash_to_block_id.get(self._block_hash(seq, i))
            if block_id is None:
                break
            if self._used[block_id].token_ids != tuple(seq.block_tokens(i, self.block_size)):
                break  # hash collision
            hits.append(block_id)
        return hits

    def num_cached_tokens(self, seq: Sequence) -> int:
        return len(self._cached_prefix(seq)) * self.block_size

    def num_shared_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s leading full blocks that other sequences hold too: the prefix that
        stays cached when ``seq`` frees its blocks (its own go to the free list, first to be reused)."""
        shared = 0
        for block_id in seq.block_table[: seq.num_computed_tokens // self.block_size]:
            if self._used[block_id].ref_count < 2 or self._used[block_id].hash is None:
                break
            shared += 1
        return shared * self.block_size

    # Allocation ---------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, share_cached: bool = True, reserve: int = 0) -> bool:
        """Whether ``seq``'s blocks can be allocated with ``reserve`` more left free."""
        hits = self._cached_prefix(seq) if share_cached else []
        reused_free = sum(1 for b in hits if self._used[b].ref_count == 0)
        return seq.num_blocks(self.block_size) - len(hits) + reused_free + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence, register: bool = True, share_cached: bool = True) -> None:
        """Give ``seq`` blocks for all its tokens, sharing cached prefix blocks unless not
        ``share_cached`` (blocks its KV is to be copied into whole). With ``register`` its full
        blocks join the prefix cache now, for a batch that computes them all in its step; a prompt
        computed over several steps, or KV copied in, registers them as they are (``register_computed``)."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks")
        hits = self._cached_prefix(seq) if share_cached else []
        for block_id in hits:
            block = self._used[block_id]
            if block.ref_count == 0:  # free and hashed, so among the blocks freed with a hash
                del self._free_back[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        found = self._tier_prefix(seq, len(hits)) if share_cached else 0
        num_full = seq.num_tokens // self.block_size
        # In ascending ids: blocks freed together come back tail first, and sorted they are runs of
        # consecutive slots again, which a KV transfer moves whole instead of gathering them.
        fresh = sorted(self._take_free_block() for _ in range(len(hits), seq.num_blocks(self.block_size)))
        for i, block_id in enumerate(fresh, start=len(hits)):
            seq.block_table.append(block_id)
            if i < len(hits) + found:  # its KV comes from the tier before the forward pass
                self._register(seq, i, block_id, save=False)
            elif register and i < num_full:
                self._register(seq, i, block_id)
        if found:
            self.tier.update_state_after_alloc(seq, fresh[:found])
        seq.num_cached_tokens = seq.num_computed_tokens = (len(hits) + found) * self.block_size
        if share_cached:  # tokens to compute, less those found; not KV copied in whole
            self.prefix_cache_queried_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += seq.num_cached_tokens
            self.tier_hit_tokens += found * self.block_size

    def allocate_shared(self, seqs: list[Sequence], tables: list[list[int]]) -> dict[int, int]:
        """Give ``seqs`` blocks whose KV is to be copied in whole, one block for each distinct entry of
        their ``tables`` (keys of the source's blocks: the beams of a beam search swapped out share
        them), shared as the entries are. Returns {device block: source key}. Nothing is cached yet."""
        if any(seq.block_table for seq in seqs):
            raise RuntimeError(f"{seqs} already hold blocks")
        keys = list(dict.fromkeys(key for table in tables for key in table))
        # In ascending ids, as ``allocate`` takes them: runs of consecutive blocks copy whole.
        device = dict(zip(keys, sorted(self._take_free_block() for _ in keys)))  # source key -> device block
        for block in device.values():
            self._used[block].ref_count = 0  # one per table that names it, below
        for seq, table in zip(seqs, tables):
            seq.block_table = [device[key] for key in table]
            for block in seq.block_table:
                self._used[block].ref_count += 1
        return {block: key for key, block in device.items()}

    def _tier_prefix(self, seq: Sequence, start: int) -> int:
        """How many of the blocks of ``seq`` that follow its ``start`` cached ones the tier holds."""
        end = self._shareable_blocks(seq)
        if self.tier is None or start >= end:
            return 0
        keys = [(self._block_hash(seq, i), tuple(seq.block_tokens(i, self.block_size))) for i in range(start, end)]
        return self.tier.get_num_new_matched_tokens(seq, keys) // self.block_size

    def register_computed(self, seq: Sequence, from_token: int, save: bool = True) -> None:
        """Enter ``seq``'s full blocks whose KV is computed, from the one holding ``from_token`` on,
        into the prefix cache; ``save``: and into the tier (not KV that came from elsewhere)."""
        for index in range(from_token // self.block_size, seq.num_computed_tokens // self.block_size):
            self._register(seq, index, seq.block_table[index], save)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (a sample forked from ``parent``) ``parent``'s blocks, shared."""
        if child.block_table:
            raise RuntimeError(f"{child} already holds blocks")
        for block_id in parent.block_table:
            self._used[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def _needs_new_block(self, seq: Sequence) -> bool:
        """Whether the slot of ``seq``'s last token needs a block: past its blocks, or in one it shares."""
        index = (seq.num_tokens - 1) // self.block_size
        return index >= len(seq.block_table) or self._used[seq.block_table[index]].ref_count > 1

    def drop_copies(self, seq: Sequence) -> None:
        """Forget the copies on write still to be made into ``seq``'s blocks: it is freed before them."""
        blocks = set(seq.block_table)
        kept = [(src, dst) for src, dst in self.pending_copies if dst not in blocks]
        self.num_copied_blocks -= len(self.pending_copies) - len(kept)
        self.pending_copies = kept

    def can_append(self, seq: Sequence) -> bool:
        """Whether the KV of ``seq``'s last token has a slot (possibly after taking one new block)."""
        return self.num_free_blocks > 0 or not self._needs_new_block(seq)

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of ``seq``'s last token, copying its block first if another sample
        shares it; register the block once it is full."""
        index = (seq.num_tokens - 1) // self.block_size
        if index >= len(seq.block_table):
            seq.block_table.append(self._take_free_block())
        elif (shared := self._used[seq.block_table[index]]).ref_count > 1:
            copy = self._take_free_block()
            shared.ref_count -= 1
            self.pending_copies.append((shared.block_id, copy))
            self.num_copied_blocks += 1
            seq.block_table[index] = copy
        if seq.num_tokens % self.block_size == 0:
            index = seq.num_tokens // self.block_size - 1
            self._register(seq, index, seq.block_table[index])

    def append_slots(self, seqs: list[Sequence]) -> None:
        """``append_slot`` for each of ``seqs`` in turn. It does nothing for a sequence whose newest
        token has a slot in its own last block and does not fill it, the most of them at most steps:
        those are passed over here at the cost of a check, as this runs every step for every
        decoding sequence."""
        size, used = self.block_size, self._used
        for seq in seqs:
            num_tokens, table = seq.num_tokens, seq.block_table
            index = (num_tokens - 1) // size
            if num_tokens % size and index < len(table) and used[table[index]].ref_count == 1:
                continue
            self.append_slot(seq)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks. Tail blocks are freed first so that they are evicted first."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _unref(self, block_id: int) -> None:
        block = self._used[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:  # nothing to reuse: hand it out before cached blocks
                self._free_front.appendleft(block_id)
            else:
                self._free_back[block_id] = None

    def saved(self, block_ids: list[int]) -> None:
        """The step that copied these blocks out to the tier is done: the references held for it go."""
        for block_id in block_ids:
            self._unref(block_id)

    def _take_free_block(self) -> int:
        if self._free_front:
            block = self._used[self._free_front.popleft()]
        elif len(self._used) < self._num_blocks:
            block = Block(len(self._used))
            self._used.append(block)
        elif self._free_back:
            block = self._used[self._free_back.popitem(last=False)[0]]
        else:
            raise RuntimeError("out of KV blocks: the scheduler must check can_allocate/can_append first")
        if block.hash is not None:  # evict from the prefix cache
            if self.hash_to_block_id.get(block.hash) == block.block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block.block_id

    def _register(self, seq: Sequence, index: int, block_id: int, save: bool = True) -> None:
        """Block ``index`` of ``seq`` is (or after this step's forward pass will be) computed: it
        joins the prefix cache, and with ``save`` the tier."""
        if not self.enable_prefix_caching:
            return
        block = self._used[block_id]
        block.hash = self._block_hash(seq, index)
        block.token_ids = tuple(seq.block_tokens(index, self.block_size))
        self.hash_to_block_id[block.hash] = block_id
        if save and self.tier is not None:
            block.ref_count += 1
            self.tier.save_block((block.hash, block.token_ids), block_id)
