"""Prefill scheduling: batch waiting prompts under a token budget, in the order of a policy.

Policies: ``fcfs`` (arrival order), ``sjf`` (fewest tokens first, with aging: each prefill step
a prompt waits makes it count ``sjf_aging_tokens`` shorter, so long prompts cannot starve),
``priority`` (lowest ``priority`` value first, then arrival) and ``deadline`` (earliest TTFT
deadline first: a request's arrival plus its TTFT SLO, so that a request with a tight one is not
queued behind earlier ones with loose ones; those without a deadline after, in arrival order) and
``deadline-feasible`` (the same order among the prompts that can still meet their deadline, then
those that cannot: a prompt whose deadline has passed, or is nearer than its prefill alone takes by
the instance's step times, goes after the others, still in deadline order). Under plain earliest
deadline first an overload cascades: the prompt due first is late already, runs first and makes
the next one late. Late prompts then wait for a step no feasible prompt needs: a sustained
overload starves them until it passes.
Preempted sequences come back through ``resume`` and go before all others: they already waited once.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from distserve.core.config import SchedulerConfig
from distserve.core.sequence import Sequence, SequenceStatus
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.step_time import StepTimeModel


def policy_key(config: SchedulerConfig) -> Callable[[Sequence], tuple]:
    if config.policy == "sjf":
        aging = config.sjf_aging_tokens
        return lambda s: (s.num_tokens - aging * s.prefill_steps_waited, s.arrival_time, s.seq_id)
    if config.policy == "priority":
        return lambda s: (s.priority, s.arrival_time, s.seq_id)
    if config.policy in ("deadline", "deadline-feasible"):
        return lambda s: (math.inf if s.ttft_deadline is None else s.ttft_deadline, s.arrival_time, s.seq_id)
    return lambda s: (s.arrival_time, s.seq_id)


def beam_reserve(seq: Sequence) -> int:
    """Blocks a beam search's prompt is admitted with beside its own: one for each beam's first
    token (a block of its own, or its copy of the prompt's last one), so that its beams start
    together. A beam recomputed after preemption reserves none."""
    width = seq.sampling_params.beam_width
    return width if width is not None and not seq.num_output_tokens else 0


class WaitingQueue:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        step_time: StepTimeModel | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.key = policy_key(config)
        self.ages = config.policy == "sjf"
        self.late_last = config.policy == "deadline-feasible"
        self.step_time = step_time  # the instance's step times: how long a prompt's prefill takes
        self.clock = clock  # wall-clock now, which TTFT deadlines are against (a simulation's own time)
        self.waiting: list[Sequence] = []
        # Whether ``waiting`` is in policy order. Keys never change but by SJF's aging, so only an
        # addition out of order, SJF, or the late ones moved last undo it; a sort of a list in order
        # is then skipped (keys end in the unique seq_id, so the order is one whatever the start).
        self.in_order = True
        self.resumed: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.resumed)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.waiting and self.key(seq) < self.key(self.waiting[-1]):
            self.in_order = False
        self.waiting.append(seq)

    def resume(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.resumed.append(seq)

    def seqs(self) -> list[Sequence]:
        return [*self.resumed, *self.waiting]

    def remove(self, seq: Sequence) -> bool:
        for queue in (self.waiting, self.resumed):
            if seq in queue:
                queue.remove(seq)
                return True
        return False

    def schedule(self, max_seqs: int) -> list[Sequence]:
        """Pick the next prefill batch and allocate its blocks.

        The batch stops at the first sequence (in policy order) that does not fit the token
        budget or the free blocks, so a sequence at the head is never overtaken and its wait is
        bounded. A sequence longer than the whole budget runs alone.
        """
        batch: list[Sequence] = []
        num_tokens = 0
        for seq in self._in_order(max_seqs):
            if len(batch) == max_seqs:
                break
            new_tokens = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
            if batch and num_tokens + new_tokens > self.config.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq, reserve=beam_reserve(seq)):
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            batch.append(seq)
            num_tokens += new_tokens
        self._taken(batch)
        return batch

    def admit(self, max_seqs: int, budget: int) -> list[tuple[Sequence, int]]:
        """Chunked prefill: admit sequences in policy order while ``budget`` tokens remain, each with
        the chunk of its uncomputed tokens that fits. Blocks for all its tokens are allocated now (so
        an admitted prompt never waits for blocks half-way); they join the prefix cache as their KV
        is computed. As in ``schedule``, the head is never overtaken."""
        batch: list[tuple[Sequence, int]] = []
        for seq in self._in_order(max_seqs):
            if len(batch) == max_seqs or budget <= 0:
                break
            if not self.block_manager.can_allocate(seq, reserve=beam_reserve(seq)):
                break
            self.block_manager.allocate(seq, register=False)
            seq.status = SequenceStatus.RUNNING
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.append((seq, chunk))
            budget -= chunk
        self._taken([seq for seq, _ in batch])
        return batch

    def _in_order(self, max_seqs: int) -> list[Sequence]:
        """Resumed sequences, then the waiting ones in policy order (none when no slot is free)."""
        if max_seqs <= 0:
            return []
        if not self.in_order or self.ages:
            self.waiting.sort(key=self.key)
            self.in_order = True
        if self.late_last:
            now = self.clock()
            self.waiting.sort(key=lambda seq: self.is_late(seq, now))  # stable: deadline order within
            self.in_order = False
        return [*self.resumed, *self.waiting]

    def is_late(self, seq: Sequence, now: float) -> bool:
        """Whether ``seq`` can no longer meet its TTFT deadline (wall-clock ``now``): it has passed,
        or is nearer than the prefill of its uncached tokens takes in a step of their own, once the
        step times are known (a lower bound: queued with others, it takes longer)."""
        if seq.ttft_deadline is None:
            return False
        if now >= seq.ttft_deadline:
            return True
        line = self.step_time.line() if self.step_time is not None else None
        if line is None:
            return False
        uncached = seq.num_tokens - max(seq.num_computed_tokens, self.block_manager.num_cached_tokens(seq))
        return now + line.seconds(uncached) > seq.ttft_deadline

    def _taken(self, batch: list[Sequence]) -> None:
        """Drop the scheduled sequences, the head of ``_in_order``, from the queues; the others waited
        one more step (counted under SJF, the policy that reads it)."""
        if not batch:
            return
        from_resumed = min(len(batch), len(self.resumed))
        for _ in range(from_resumed):
            self.resumed.popleft()
        del self.waiting[: len(batch) - from_resumed]
        if self.ages:
            for seq in self.waiting:
                seq.prefill_steps_waited += 1
