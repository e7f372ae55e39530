"""Preemption by swap: a preempted sequence's KV blocks copied out to host memory and back.

When decode growth runs out of blocks, a preempted sequence either gives up its KV, to be
recomputed from its tokens when it runs again, or has it copied out to a pool of host blocks and
copied back when blocks are free again, as vLLM's v0 scheduler did. ``SwapSpace`` chooses per
preemption by cost: the copies out and back (its blocks at the time per block the copies have
taken so far) against prefilling its tokens again (the engine's step time model), less the prefix
other sequences hold too, which stays cached. Before either has been timed it swaps: a block's
copy is far cheaper than prefilling its tokens on any machine measured. The copies it asks for
wait in ``pending`` for the workers to make, in order, before the next forward pass, as a
sample's copy on write does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from distserve.core.sequence import Sequence, SequenceStatus
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.step_time import StepTimeModel

DECAY = 0.8  # weight of the time per block measured so far against a new measurement


@dataclass
class SwapCopy:
    """Blocks to copy before a forward pass: ``(device block, host block)`` pairs, out to the host
    pool (``out``) or back in."""

    out: bool
    pairs: list[tuple[int, int]]


@dataclass
class Swapped:
    """Sequences whose KV is in the host pool, swapped out together: one, or the beams of a beam
    search, whose shared blocks are copied once. Each one's host blocks, and the tokens their KV covers."""

    seqs: list[Sequence]
    host_tables: list[list[int]]
    num_computed_tokens: list[int]

    @property
    def host_blocks(self) -> list[int]:
        """Every host block it holds, once."""
        return list(dict.fromkeys(block for table in self.host_tables for block in table))


class SwapSpace:
    def __init__(self, num_blocks: int, block_manager: BlockManager, step_time: StepTimeModel | None) -> None:
        self.num_blocks = num_blocks
        self.block_manager = block_manager
        self.step_time = step_time
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest ids first
        self.queue: deque[Swapped] = deque()  # in the order they were swapped out, resumed in it
        self.pending: list[SwapCopy] = []
        self.seconds_per_block: float | None = None  # a block's copy, one way, as measured
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_recomputes = 0  # preemptions that chose recompute
        self.blocks_copied = 0
        self.copy_seconds = 0.0

    def __len__(self) -> int:
        return len(self.queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def seqs(self) -> list[Sequence]:
        return [seq for entry in self.queue for seq in entry.seqs]

    def should_swap(self, *seqs: Sequence) -> bool:
        """Whether copying the KV of ``seqs`` (one sequence, or the beams of a beam search, which go
        together) out and back costs less than computing it again."""
        blocks = len({block for seq in seqs for block in seq.block_table})
        if not blocks or blocks > len(self._free):
            return False
        line = self.step_time.line() if self.step_time is not None else None
        if line is None or self.seconds_per_block is None:
            return True
        shared = [self.block_manager.num_shared_tokens(seq) for seq in seqs]
        recompute = sum(line.seconds(max(1, seq.num_computed_tokens - s)) for seq, s in zip(seqs, shared))
        return 2 * blocks * self.seconds_per_block < recompute

    def swap_out(self, *seqs: Sequence) -> None:
        """Copy the blocks of ``seqs`` (a block they share, once) out to host blocks and free them on
        the device."""
        host: dict[int, int] = {}
        for seq in seqs:
            for block in seq.block_table:
                if block not in host:
                    host[block] = self._free.pop()
        self._copy(True, list(host.items()))
        tables = [[host[block] for block in seq.block_table] for seq in seqs]
        self.queue.append(Swapped(list(seqs), tables, [seq.num_computed_tokens for seq in seqs]))
        for seq in seqs:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.SWAPPED
        self.num_swap_outs += len(seqs)

    def can_swap_in(self, reserve: int) -> bool:
        """Whether the oldest swapped sequences' blocks fit, ``reserve`` blocks left over."""
        if not self.queue:
            return False
        return len(self.queue[0].host_blocks) + reserve <= self.block_manager.num_free_blocks

    def swap_in(self) -> list[Sequence]:
        """Give the oldest swapped sequences device blocks (shared again where they shared them) and
        copy their KV back into them."""
        entry = self.queue.popleft()
        device = self.block_manager.allocate_shared([seq for seq in entry.seqs], entry.host_tables)
        self._copy(False, list(device.items()))
        self._free += reversed(entry.host_blocks)
        for seq, computed in zip(entry.seqs, entry.num_computed_tokens):
            seq.num_computed_tokens = computed
            self.block_manager.register_computed(seq, 0, save=False)  # saved to the tier when first computed
        self.num_swap_ins += len(entry.seqs)
        return entry.seqs

    def drop(self, seq: Sequence) -> bool:
        """Forget a swapped sequence (finished or aborted), and free the host blocks no other
        sequence swapped out with it holds."""
        for entry in self.queue:
            if seq in entry.seqs:
                i = entry.seqs.index(seq)
                before = set(entry.host_blocks)
                del entry.seqs[i], entry.host_tables[i], entry.num_computed_tokens[i]
                self._free += sorted(before - set(entry.host_blocks), reverse=True)
                if not entry.seqs:
                    self.queue.remove(entry)
                return True
        return False

    def take_pending(self) -> list[SwapCopy]:
        pending, self.pending = self.pending, []
        return pending

    def observe(self, num_blocks: int, seconds: float) -> None:
        """A step's copies of ``num_blocks`` took ``seconds``: the time per block decisions use."""
        if num_blocks and seconds > 0:
            per_block = seconds / num_blocks
            last = self.seconds_per_block
            self.seconds_per_block = per_block if last is None else DECAY * last + (1 - DECAY) * per_block
            self.blocks_copied += num_blocks
            self.copy_seconds += seconds

    def _copy(self, out: bool, pairs: list[tuple[int, int]]) -> None:
        if self.pending and self.pending[-1].out == out:
            self.pending[-1].pairs += pairs
        else:
            self.pending.append(SwapCopy(out, pairs))
