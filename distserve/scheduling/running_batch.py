"""Decode scheduling: continuous batching, one token per running sequence per step.

Before each step every running sequence needs a slot for its newest token; when blocks run
out, the most recently admitted sequences are preempted until the rest fit: their blocks freed,
to be recomputed later, or copied out to the host pool first where that costs less (``swap``).
"""

from __future__ import annotations

from collections.abc import Callable

from distserve.core.sequence import Sequence, SequenceStatus
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.swap import SwapSpace


class RunningBatch:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, swap: SwapSpace | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.swap = swap
        self.seqs: list[Sequence] = []
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def free_seq_slots(self) -> int:
        return self.max_num_seqs - len(self.seqs)

    def add(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in this instance's blocks."""
        seq.status = SequenceStatus.RUNNING
        self.seqs.append(seq)

    def remove(self, seq: Sequence) -> bool:
        if seq in self.seqs:
            self.seqs.remove(seq)
            return True
        return False

    def schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """Returns (sequences to decode this step, sequences preempted to make room)."""
        batch, _, preempted = self.grow(lambda seq: True)
        return batch, preempted

    def grow(self, decodes: Callable[[Sequence], bool]) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """A slot for the newest token of each sequence that ``decodes``, in admission order; when no
        block is free, the most recently admitted sequences (decoding or not) are preempted until the
        rest fit. Returns (sequences given a slot, the others, sequences preempted to be recomputed);
        those swapped out wait in the swap space."""
        if self.block_manager.num_free_blocks >= len(self.seqs):
            # A slot takes at most one block, so every sequence gets its own and none is preempted.
            batch: list[Sequence] = []
            others: list[Sequence] = []
            for seq in self.seqs:
                (batch if decodes(seq) else others).append(seq)
            self.block_manager.append_slots(batch)
            return batch, others, []
        queue = list(self.seqs)
        batch, others = [], []
        preempted: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            if not decodes(seq):
                others.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                victim = queue[-1] if queue else others[-1] if others else seq
                gone = self.preempt(victim, slotted=batch)
                for out, swapped in gone:
                    for seqs in (queue, others, batch):
                        if out in seqs:
                            seqs.remove(out)
                    if not swapped:
                        preempted.append(out)
                if any(out is seq for out, _ in gone):
                    break
            else:
                self.block_manager.append_slot(seq)
                batch.append(seq)
        return batch, others, preempted

    def preempt(self, seq: Sequence, slotted: list[Sequence] = ()) -> list[tuple[Sequence, bool]]:
        """Take ``seq`` out and free its blocks, with the other beams of its beam search running here
        (a beam search steps only with all its beams): each swapped out (True) where that costs less,
        else to be recomputed from its tokens when it runs again (False). A beam among ``slotted``
        (given its slot in this step already) may wait for a copy on write into its newest block: its
        beams are recomputed, and that copy dropped, since a swap out is copied before it is made."""
        group = [seq] if seq.beams is None else [beam for beam in self.seqs if beam.beams is seq.beams]
        copying = [out for out in group if out in slotted]
        for out in copying:
            self.block_manager.drop_copies(out)
        swap = self.swap is not None and not copying and self.swap.should_swap(*group)
        if self.swap is not None and not swap:
            self.swap.num_recomputes += len(group)
        for out in group:
            self.seqs.remove(out)
            out.num_preemptions += 1
            self.num_preemptions += 1
            if not swap:
                self.block_manager.free(out)
                out.status = SequenceStatus.WAITING
        if swap:
            self.swap.swap_out(*group)
        return [(out, swap) for out in group]
