"""Scheduling of a prefill instance: prompts only, and a prefilled request keeps its blocks until
a decode instance has pulled its KV.

Back-pressure: while the requests held for migration take more than ``kv_hold_fraction`` of the
KV blocks, no new prompt is admitted, so a slow or full decode side throttles prefill instead of
prefill running out of blocks.

Deadline: a request held longer than ``kv_hold_timeout`` (its decode instance died, or never got
to it) is ``expired``; the instance then frees it and reports it failed.
"""

from __future__ import annotations

import time

from distserve.core.config import SchedulerConfig
from distserve.core.sequence import Sequence
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.scheduler import ScheduledBatch
from distserve.scheduling.waiting_queue import WaitingQueue


class PrefillOnlyScheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.prefill = WaitingQueue(config, block_manager)
        self.held: dict[str, Sequence] = {}
        self.held_since: dict[str, float] = {}  # time.monotonic() when its prefill was scheduled
        self.hold_limit = max(1, int(config.kv_hold_fraction * block_manager.num_blocks))
        self.num_throttled_steps = 0

    @property
    def num_preemptions(self) -> int:
        return 0  # a prefill batch allocates all its blocks up front: nothing to preempt

    @property
    def num_waiting(self) -> int:
        return len(self.prefill)

    @property
    def num_running(self) -> int:
        return 0  # a prefill batch runs within one step

    @property
    def num_held_blocks(self) -> int:
        return sum(len(seq.block_table) for seq in self.held.values())

    def has_unfinished(self) -> bool:
        """Whether a step has work; held requests wait for decode, not for a step."""
        return bool(len(self.prefill))

    def add(self, seq: Sequence) -> None:
        self.prefill.add(seq)

    def schedule(self) -> ScheduledBatch:
        if self.num_held_blocks >= self.hold_limit:
            self.num_throttled_steps += 1
            return ScheduledBatch([], is_prefill=True)
        batch = self.prefill.schedule(self.config.max_num_seqs)
        now = time.monotonic()
        for seq in batch:
            self.held[seq.request_id] = seq
            self.held_since[seq.request_id] = now
        return ScheduledBatch(batch, is_prefill=True)

    def expired(self, now: float) -> list[str]:
        """Held requests whose KV has waited longer than ``kv_hold_timeout`` for a pull."""
        return [rid for rid, since in self.held_since.items() if now - since > self.config.kv_hold_timeout]

    def finish(self, seq: Sequence) -> None:
        """Drop a finished, aborted or migrated sequence wherever it is and free its blocks."""
        self.held_since.pop(seq.request_id, None)
        if self.held.pop(seq.request_id, None) is None:
            self.prefill.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
