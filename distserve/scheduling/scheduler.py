"""An engine's one scheduler: what the next step computes.

The scheduler owns the instance's KV blocks (``BlockManager``), its waiting queue and its running
batch, and outlives role changes: a role is a policy of it, not a scheduler of its own, so a
request a new role can serve stays where it is. How a step is formed is the scheduler's
``StepMode``, which the engine sets from its role:

* ``PREFILL_FIRST`` (colocated and decode instances): a prefill batch whenever one can be formed,
  otherwise a decode step of every running sequence. A decode instance needs prefill too, because a
  sequence it preempts is recomputed through the waiting queue (unless it is swapped out: with a
  ``SwapSpace`` its KV goes to host memory where that costs less, and comes back, before any
  prompt is admitted, once its blocks fit again).
* ``CHUNKED`` (colocated instances with chunked prefill): both phases in one step under one token
  budget, as vLLM and Sarathi-Serve do.
* ``PREFILL_ONLY`` (prefill instances): prompts only, at most ``max_num_seqs`` of them, and no
  running batch between steps: a sequence leaves with its first token, and its blocks go with it
  to the KV hold.

The scheduler takes a ``clock``, the wall-clock time TTFT deadlines are against: the placement
planner, which runs this scheduler in its simulation, gives it the simulated time.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from distserve.core.config import SchedulerConfig
from distserve.core.sequence import Sequence
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.running_batch import RunningBatch
from distserve.scheduling.step_time import StepTimeModel
from distserve.scheduling.swap import SwapSpace
from distserve.scheduling.waiting_queue import WaitingQueue

# The share of the tightest TPOT SLO among the decoding requests that a step cut to fit it aims at:
# the line's error and the steps that run longer than predicted (a chunk late in a long prompt
# attends over more of it) stay within the SLO.
TPOT_SLO_SHARE = 0.8


class StepMode(enum.Enum):
    """How the scheduler forms a step (see the module's docstring)."""

    PREFILL_ONLY = "prefill-only"
    PREFILL_FIRST = "prefill-first"
    CHUNKED = "chunked"

    @classmethod
    def both_phases(cls, config: SchedulerConfig) -> StepMode:
        """The mode of an instance that runs both phases: chunked prefill or prefill-first, as configured."""
        return cls.CHUNKED if config.enable_chunked_prefill else cls.PREFILL_FIRST


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool  # whether prompt tokens run (the first ``num_decode`` of ``seqs`` run one token each)
    num_decode: int = 0
    num_new_tokens: list[int] | None = None  # tokens each sequence runs; None: all it has not computed


class Scheduler:
    """The waiting queue, the running batch and the blocks they hold, and the step formed of them.

    In ``CHUNKED`` mode each step has one token budget (``max_num_batched_tokens``): every decoding
    sequence's newest token first, then chunks of prompts, those begun before admission order, then
    new ones in policy order. A prompt's blocks are allocated when it is admitted and join the
    prefix cache once their KV is computed (the step after its chunk ran, whatever the mode is by
    then), so no other request reads a block a later chunk has yet to fill. When decode growth runs
    out of blocks the most recently admitted sequences are preempted, prompts half-way included,
    and that step admits no new prompt.

    With ``tpot_aware_chunking`` (and the engine's ``step_time``), while a request with a TPOT SLO
    decodes, a chunked step runs only the tokens that ``step_time`` says fit ``TPOT_SLO_SHARE`` of
    the tightest such SLO, and at least a block of prompt tokens, so prompts still move while
    decoding alone fills the steps: the budget a Sarathi-Serve user sets from the SLO by hand, here
    set each step from the SLOs of the requests in it, so a step with none of them prefills at full
    speed.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        step_time: StepTimeModel | None = None,
        clock: Callable[[], float] = time.time,
        mode: StepMode | None = None,
        swap: SwapSpace | None = None,
    ) -> None:
        """``mode``: how steps are formed until ``set_mode``; None: both phases, as configured.
        ``swap``: where preempted sequences' KV may go instead of being recomputed."""
        self.block_manager = block_manager
        self.waiting = WaitingQueue(config, block_manager, step_time, clock)
        self.swap = swap
        self.running = RunningBatch(block_manager, config.max_num_seqs, swap)
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.step_time = step_time if config.tpot_aware_chunking else None  # what cuts a chunked step
        self.chunks: list[tuple[Sequence, int]] = []  # the last step's prompt chunks: (sequence, first token)
        self.mode = StepMode.both_phases(config)
        if mode is not None:
            self.set_mode(mode)

    def set_mode(self, mode: StepMode) -> None:
        if mode is StepMode.PREFILL_ONLY and len(self.running):
            raise RuntimeError(f"{len(self.running)} sequences still run: a prefill-only scheduler keeps none")
        self.mode = mode

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_preemptions(self) -> int:
        return self.running.num_preemptions

    @property
    def num_swapped(self) -> int:
        return len(self.swap) if self.swap is not None else 0

    def has_unfinished(self) -> bool:
        """Whether a step has work."""
        return bool(len(self.waiting) or len(self.running) or self.num_swapped)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for prefill."""
        self.waiting.add(seq)

    def schedule(self) -> ScheduledBatch:
        """The next batch, its blocks allocated; empty when nothing can run."""
        for seq, first in self.chunks:  # their KV is in the cache now
            if seq.block_table:
                self.block_manager.register_computed(seq, first)
        self.chunks = []
        if self.mode is not StepMode.PREFILL_ONLY:
            self._swap_in()
        if self.mode is StepMode.CHUNKED:
            return self._schedule_chunked()
        if self.mode is StepMode.PREFILL_ONLY:
            return ScheduledBatch(self.waiting.schedule(self.max_num_seqs), is_prefill=True)
        return self._schedule_prefill_first()

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is and free its blocks."""
        if not self.running.remove(seq) and not self.waiting.remove(seq) and self.swap is not None:
            self.swap.drop(seq)
        if seq.block_table:
            self.block_manager.free(seq)

    def finish_running(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running batch, keeping its blocks (it is handed on)."""
        self.running.remove(seq)

    def waiting_seqs(self) -> list[Sequence]:
        """Sequences queued to run: swapped out, then queued for prefill (preempted ones first)."""
        swapped = self.swap.seqs() if self.swap is not None else []
        return [*swapped, *self.waiting.seqs()]

    def _swap_in(self) -> None:
        """Bring swapped sequences back, oldest first, while their blocks fit with one to spare for
        each running sequence (so that the step's growth does not preempt at once) and a slot is
        free; until they are all back, no prompt is admitted (``waiting`` sees no free slot)."""
        swap = self.swap
        while swap is not None and self.running.free_seq_slots and swap.can_swap_in(reserve=len(self.running)):
            for seq in swap.swap_in():
                self.running.add(seq)

    def running_seqs(self) -> list[Sequence]:
        """Sequences with blocks in the running batch."""
        return list(self.running.seqs)

    def _admits(self) -> bool:
        """Whether a step may take prompts: not while a swapped-out sequence waits to come back."""
        return not self.num_swapped

    def _schedule_prefill_first(self) -> ScheduledBatch:
        batch = self.waiting.schedule(self.running.free_seq_slots) if self._admits() else []
        if batch:
            for seq in batch:
                self.running.add(seq)
            return ScheduledBatch(batch, is_prefill=True)
        seqs, preempted = self.running.schedule()
        for seq in reversed(preempted):
            self.waiting.resume(seq)
        return ScheduledBatch(seqs, is_prefill=False)

    def _schedule_chunked(self) -> ScheduledBatch:
        decode, prompts, preempted = self.running.grow(lambda seq: seq.num_tokens - seq.num_computed_tokens == 1)
        budget = max(0, self.budget - len(decode))
        if (within_slo := self.tokens_within_tpot_slo(decode)) is not None:
            budget = min(budget, max(within_slo - len(decode), self.block_manager.block_size))
        chunks: list[tuple[Sequence, int]] = []
        for seq in prompts:
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if chunk == 0:
                break
            chunks.append((seq, chunk))
            budget -= chunk
        for seq in reversed(preempted):
            self.waiting.resume(seq)
        if not preempted and self._admits():
            for seq, chunk in self.waiting.admit(self.running.free_seq_slots, budget):
                self.running.add(seq)
                chunks.append((seq, chunk))
        self.chunks = [(seq, seq.num_computed_tokens) for seq, _ in chunks]
        return ScheduledBatch(
            decode + [seq for seq, _ in chunks],
            is_prefill=bool(chunks),
            num_decode=len(decode),
            num_new_tokens=[1] * len(decode) + [chunk for _, chunk in chunks],
        )

    def tokens_within_tpot_slo(self, decode: list[Sequence]) -> int | None:
        """The tokens a step may run and keep the tightest TPOT SLO of ``decode``; None: no limit
        (off, none of them has one, or the step times are not known yet)."""
        if self.step_time is None:
            return None
        slos = [seq.tpot_slo for seq in decode if seq.tpot_slo]
        if not slos:
            return None
        return self.step_time.tokens_within(TPOT_SLO_SHARE * min(slos))
