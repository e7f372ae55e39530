"""Both phases in one instance, vLLM-style: a prefill batch whenever one can be formed,
otherwise a decode step. This is the baseline that disaggregation is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.config import SchedulerConfig
from distserve.core.sequence import Sequence
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.running_batch import RunningBatch
from distserve.scheduling.waiting_queue import WaitingQueue


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool


class PrefillFirstScheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.prefill = WaitingQueue(config, block_manager)
        self.decode = RunningBatch(block_manager, config.max_num_seqs)

    @property
    def num_preemptions(self) -> int:
        return self.decode.num_preemptions

    @property
    def num_waiting(self) -> int:
        return len(self.prefill)

    @property
    def num_running(self) -> int:
        return len(self.decode)

    def has_unfinished(self) -> bool:
        return bool(len(self.prefill) or len(self.decode))

    def add(self, seq: Sequence) -> None:
        self.prefill.add(seq)

    def schedule(self) -> ScheduledBatch:
        batch = self.prefill.schedule(self.decode.free_seq_slots)
        if batch:
            for seq in batch:
                self.decode.add(seq)
            return ScheduledBatch(batch, is_prefill=True)
        seqs, preempted = self.decode.schedule()
        for seq in reversed(preempted):
            self.prefill.resume(seq)
        return ScheduledBatch(seqs, is_prefill=False)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is and free its blocks."""
        if not self.decode.remove(seq):
            self.prefill.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
