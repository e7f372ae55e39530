"""The engine's KV-block and batching rules, over simulated sequences.

Each class follows one of ``distserve/scheduling``, rule for rule, so the block-mode simulator makes
the same choices the engine would: ``BlockPool`` is ``BlockManager``, ``BatchScheduler`` is
``WaitingQueue`` (FCFS) plus ``RunningBatch`` under ``PrefillFirstScheduler``, and
``ChunkedBatchScheduler`` is ``ChunkedPrefillScheduler``. Prompts are taken to
share no prefix with one another (a block's key is its request and index), so the prefix cache only
ever hits when a preempted request is recomputed where its freed blocks are still cached.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class SimSeq:
    """A request's run on one instance, as a ``Sequence``."""

    request: int
    num_tokens: int  # prompt plus the tokens sampled so far
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the blocks (kept by the chunked scheduler only)


class BlockPool:
    """``BlockManager``'s free list is, in order: freed uncached blocks (the latest first), blocks never
    used (by id), freed cached blocks (least recently freed first). It is kept here as those three
    parts, so that a pool of millions of blocks costs nothing to make."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.uncached: deque[int] = deque()
        self.next_unused = 0
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.key: dict[int, tuple[int, int]] = {}  # block -> (request, block index), once full and registered
        self.by_key: dict[tuple[int, int], int] = {}

    @property
    def num_free(self) -> int:
        return len(self.uncached) + self.num_blocks - self.next_unused + len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, seq: SimSeq) -> list[int]:
        """``BlockManager._cached_prefix``: cached blocks of the longest prefix, short of the last token."""
        if not self.prefix_caching:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.by_key.get((seq.request, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: SimSeq) -> bool:
        # ``BlockManager.can_allocate``: a hit on a free cached block still takes it off the free list,
        # and with no shared prefixes every hit is free, so all the sequence's blocks must be free.
        return self.blocks_needed(seq.num_tokens) <= self.num_free

    def allocate(self, seq: SimSeq, hits: list[int], register: bool = True) -> None:
        for block in hits:
            del self.cached[block]
        seq.blocks = list(hits)
        num_full = seq.num_tokens // self.block_size
        for i in range(len(hits), self.blocks_needed(seq.num_tokens)):
            seq.blocks.append(self.take())
            if register and i < num_full:
                self.register(seq, i)

    def register_computed(self, seq: SimSeq, from_token: int) -> None:
        """``BlockManager.register_computed``."""
        for index in range(from_token // self.block_size, seq.num_computed // self.block_size):
            self.register(seq, index)

    def release(self, seq: SimSeq) -> None:
        """``BlockManager.free``: tail first, uncached blocks to the front, so the prefix stays longest."""
        for block in reversed(seq.blocks):
            if block in self.key:
                self.cached[block] = None
            else:
                self.uncached.appendleft(block)
        seq.blocks = []
        seq.num_computed = 0

    def take(self) -> int:
        if self.uncached:
            return self.uncached.popleft()
        if self.next_unused < self.num_blocks:
            self.next_unused += 1
            return self.next_unused - 1
        block, _ = self.cached.popitem(last=False)
        key = self.key.pop(block)  # evicted from the prefix cache, unless a newer block holds the key now
        if self.by_key.get(key) == block:
            del self.by_key[key]
        return block

    def register(self, seq: SimSeq, index: int) -> None:
        if self.prefix_caching:
            block = seq.blocks[index]
            self.key[block] = (seq.request, index)
            self.by_key[(seq.request, index)] = block


class BatchScheduler:
    """The waiting queue and running batch of one instance; ``schedule`` is ``PrefillFirstScheduler``'s."""

    def __init__(self, pool: BlockPool, max_batch_tokens: int, max_num_seqs: int) -> None:
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SimSeq] = deque()
        self.resumed: deque[SimSeq] = deque()  # preempted: before all others
        self.running: dict[int, SimSeq] = {}  # by request, in admission order

    def schedule_prefill(self, max_seqs: int) -> tuple[list[SimSeq], list[int]]:
        """``WaitingQueue.schedule`` (FCFS): the batch, blocks allocated, and the tokens each computes."""
        batch: list[SimSeq] = []
        computed: list[int] = []
        total = 0
        for seq in (*self.resumed, *self.waiting):
            if len(batch) >= max_seqs:
                break
            hits = self.pool.cached_prefix(seq)
            new_tokens = seq.num_tokens - len(hits) * self.pool.block_size
            if batch and total + new_tokens > self.max_batch_tokens:
                break
            if not self.pool.can_allocate(seq):
                break
            self.pool.allocate(seq, hits)
            batch.append(seq)
            computed.append(new_tokens)
            total += new_tokens
        # The batch is a prefix of resumed + waiting, so popping from the left removes exactly it.
        for _ in batch:
            (self.resumed or self.waiting).popleft()
        return batch, computed

    def schedule_decode(self) -> tuple[list[SimSeq], list[SimSeq]]:
        """``RunningBatch.schedule``: (sequences to decode, sequences preempted), most recent preempted first."""
        batch, _, preempted = self.grow(prompts_apart=False)
        return batch, preempted

    def grow(self, prompts_apart: bool) -> tuple[list[SimSeq], list[SimSeq], list[SimSeq]]:
        """``RunningBatch.grow``: (sequences given a slot, the others, sequences preempted). With
        ``prompts_apart``, only a sequence with just its newest token uncomputed decodes (chunked
        prefill); else all do. ``BlockManager.can_append`` and ``append_slot`` are inlined: this loop
        runs once per running sequence per step, the simulator's hottest."""
        pool = self.pool
        block_size = pool.block_size
        queue = deque(self.running.values())
        batch: list[SimSeq] = []
        others: list[SimSeq] = []
        preempted: list[SimSeq] = []
        while queue:
            seq = queue.popleft()
            if prompts_apart and seq.num_tokens - seq.num_computed != 1:
                others.append(seq)
                continue
            if len(seq.blocks) * block_size < seq.num_tokens:  # its newest token starts a block
                if not self._make_room(seq, queue, others, preempted):
                    continue
                seq.blocks.append(pool.take())
            if seq.num_tokens % block_size == 0:  # its newest token fills its last block
                pool.register(seq, seq.num_tokens // block_size - 1)
            batch.append(seq)
        return batch, others, preempted

    def _make_room(self, seq: SimSeq, queue: deque[SimSeq], others: list[SimSeq], preempted: list[SimSeq]) -> bool:
        """Preempt the most recently admitted sequences until a block is free; False if ``seq`` went too."""
        while not self.pool.num_free:
            victim = queue.pop() if queue else others.pop() if others else seq
            del self.running[victim.request]
            self.pool.release(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def schedule(self) -> tuple[list[SimSeq], list[int] | None, list[SimSeq]]:
        """``PrefillFirstScheduler.schedule``: (batch, tokens each computes for a prefill batch or None
        for a decode step, sequences preempted)."""
        batch, computed = self.schedule_prefill(self.max_num_seqs - len(self.running))
        if batch:
            for seq in batch:
                self.running[seq.request] = seq
            return batch, computed, []
        batch, preempted = self.schedule_decode()
        self.resumed.extend(reversed(preempted))
        return batch, None, preempted

    def finish(self, seq: SimSeq) -> None:
        del self.running[seq.request]
        self.pool.release(seq)


class ChunkedBatchScheduler(BatchScheduler):
    """``ChunkedPrefillScheduler``: one budget of ``max_batch_tokens`` per step, every decoding
    sequence's token first, then chunks of prompts begun, then of new ones (FCFS). The caller
    advances ``num_computed`` (and ``num_tokens`` for a sequence whose chunk reaches its end)."""

    def __init__(self, pool: BlockPool, max_batch_tokens: int, max_num_seqs: int) -> None:
        super().__init__(pool, max_batch_tokens, max_num_seqs)
        self.chunks: list[tuple[SimSeq, int]] = []  # the last step's prompt chunks: (sequence, first token)

    def schedule(self) -> tuple[list[SimSeq], list[int] | None, list[SimSeq]]:
        """(batch: decoding sequences then prompt chunks, tokens each computes, sequences preempted)."""
        for seq, first in self.chunks:  # their KV is in the blocks now
            if seq.blocks:
                self.pool.register_computed(seq, first)
        decode, prompts, preempted = self.grow(prompts_apart=True)
        budget = max(0, self.max_batch_tokens - len(decode))
        chunks: list[tuple[SimSeq, int]] = []
        for seq in prompts:
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            if chunk == 0:
                break
            chunks.append((seq, chunk))
            budget -= chunk
        self.resumed.extend(reversed(preempted))
        if not preempted:
            chunks += self._admit(budget)
        self.chunks = [(seq, seq.num_computed) for seq, _ in chunks]
        batch = decode + [seq for seq, _ in chunks]
        return batch, [1] * len(decode) + [chunk for _, chunk in chunks], preempted

    def _admit(self, budget: int) -> list[tuple[SimSeq, int]]:
        """``WaitingQueue.admit``: FCFS while budget, sequence slots and blocks last."""
        admitted: list[tuple[SimSeq, int]] = []
        for seq in (*self.resumed, *self.waiting):
            if len(self.running) >= self.max_num_seqs or budget <= 0 or not self.pool.can_allocate(seq):
                break
            hits = self.pool.cached_prefix(seq)
            self.pool.allocate(seq, hits, register=False)
            seq.num_computed = len(hits) * self.pool.block_size
            self.running[seq.request] = seq
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            admitted.append((seq, chunk))
            budget -= chunk
        for _ in admitted:
            (self.resumed or self.waiting).popleft()
        return admitted
