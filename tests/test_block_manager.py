"""Block manager invariants: allocation, freeing, sharing, hashing and eviction."""

import random

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence
from distserve.scheduling.block_manager import BlockManager


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams())


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and not seq.block_table


def test_shared_prefix_is_reused_and_refcounted():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = _seq(list(range(13))), _seq(list(range(12)) + [99, 98])
    bm.allocate(a)
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.num_cached_tokens == 12
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table[:3])
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(8)))
    bm.allocate(first)
    bm.free(first)
    again = _seq(list(range(8)))
    bm.allocate(again)
    # Two full blocks are cached, but the second holds the last token, whose logits are needed.
    assert again.num_cached_tokens == 4


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = _seq([1, 2, 3]), _seq([5, 6, 7])
    bm.allocate(old)
    bm.free(old)
    bm.allocate(new)
    bm.free(new)
    # The unhashed tail blocks go first, then the oldest cached block ([1, 2]).
    filler = _seq([9, 9, 9, 9, 9])
    bm.allocate(filler)
    assert bm.num_cached_tokens(_seq([1, 2, 3])) == 0
    assert bm.num_cached_tokens(_seq([5, 6, 7])) == 2
    bm.free(filler)


def test_hash_collision_is_not_a_hit():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _seq([1, 2, 3])
    bm.allocate(a)
    # Forge a collision: make b's first-block hash point at a's block although tokens differ.
    b = _seq([7, 8, 9])
    bm.hash_to_block_id[bm._block_hash(b, 0)] = a.block_table[0]
    assert bm.num_cached_tokens(b) == 0
    bm.allocate(b)
    assert b.block_table[0] != a.block_table[0]


def test_decode_growth_registers_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = _seq([1, 2, 3])
    bm.allocate(seq)
    seq.append_token(4)
    assert bm.can_append(seq)
    bm.append_slot(seq)  # block [3, 4] is now full and findable
    seq.append_token(5)
    bm.append_slot(seq)
    other = _seq([1, 2, 3, 4, 6])
    assert bm.num_cached_tokens(other) == 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of allocate / grow / free over a small pool with shared prefixes."""

    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(self, num_blocks, block_size, caching, seed):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.live: list[Sequence] = []
        self.rng = random.Random(seed)

    @rule(length=st.integers(1, 20), prefix_of=st.integers(0, 10))
    def allocate(self, length, prefix_of):
        # Half the time start from a live sequence's tokens, so prefixes are shared.
        base = self.live[prefix_of % len(self.live)].all_token_ids if self.live and prefix_of % 2 else []
        tokens = (base + [self.rng.randrange(3) for _ in range(length)])[: max(length, 1)]
        seq = _seq(tokens)
        if self.bm.can_allocate(seq):
            free_before = self.bm.num_free_blocks
            self.bm.allocate(seq)
            new_blocks = len(seq.block_table) - seq.num_cached_tokens // self.bm.block_size
            assert self.bm.num_free_blocks <= free_before - new_blocks + len(seq.block_table)
            assert seq.num_cached_tokens < seq.num_tokens
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), token=st.integers(0, 2))
    def grow(self, index, token):
        seq = self.live[index % len(self.live)]
        seq.append_token(token)
        if self.bm.can_append(seq):
            self.bm.append_slot(seq)
        else:
            seq.all_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def free(self, index):
        seq = self.live.pop(index % len(self.live))
        self.bm.free(seq)

    @invariant()
    def refcounts_match_live_tables(self):
        counts = [0] * self.bm.num_blocks
        for seq in self.live:
            assert len(seq.block_table) == seq.num_blocks(self.bm.block_size)
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block_id in seq.block_table:
                counts[block_id] += 1
        assert [b.ref_count for b in self.bm.blocks] == counts
        assert set(self.bm.free_block_ids) == {i for i, c in enumerate(counts) if c == 0}

    @invariant()
    def shared_and_cached_blocks_hold_the_right_tokens(self):
        bs = self.bm.block_size
        for seq in self.live:
            for i, block_id in enumerate(seq.block_table):
                block = self.bm.blocks[block_id]
                if block.hash is not None and block.ref_count > 0 and (i + 1) * bs <= seq.num_tokens:
                    assert block.token_ids == tuple(seq.block_tokens(i, bs))
        for h, block_id in self.bm.hash_to_block_id.items():
            assert self.bm.blocks[block_id].hash == h
        if not self.bm.enable_prefix_caching:
            assert not self.bm.hash_to_block_id

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
