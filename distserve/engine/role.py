"""An engine's role: what it does with the requests it is given.

The engine (block manager, detokenizer, executor, output deltas) is the same in every role; the
role object decides what a step schedules and what happens around it, and holds the role's own
state machine (``PrefillRole``: back-pressure from the KV held for decode; ``DecodeRole``: the
admission of handed-over requests). An engine swaps its role object to change role while running
(``LLMEngine.change_role``); the new role adopts the requests it can serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distserve.core.handover import Handover
from distserve.core.outputs import RequestDelta
from distserve.core.role import Role
from distserve.core.sequence import Sequence
from distserve.scheduling.scheduler import (
    ChunkedPrefillScheduler,
    PrefillFirstScheduler,
    ScheduledBatch,
    Scheduler,
)

if TYPE_CHECKING:
    from distserve.engine.llm_engine import LLMEngine


@dataclass
class RoleStats:
    """The role's own counters, as ``InstanceInfo`` reports them."""

    num_pending: int = 0  # decode: handed-over requests waiting for blocks or for their KV
    num_throttled_steps: int = 0  # prefill: steps that admitted nothing because held KV passed its limit
    num_admission_waits: int = 0  # decode: handed-over requests that had to wait for free blocks


class InstanceRole:
    """Behaviour shared by all roles; a subclass overrides what its role does differently."""

    role: Role
    prefix_caching = True  # whether the role may share KV blocks through the prefix cache
    takes_prompts = True  # whether it runs new prompts (a decode role only recomputes its own)
    decodes = True  # whether it decodes (a prefill role hands every request on after its first token)

    def __init__(self, engine: LLMEngine, scheduler: Scheduler) -> None:
        self.engine = engine
        self.scheduler = scheduler

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.name})"

    def add(self, seq: Sequence) -> None:
        """A new request, to run from its prompt."""
        self.scheduler.add(seq)

    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule()

    def has_work(self) -> bool:
        """Whether a step can run."""
        return self.scheduler.has_unfinished()

    def ready_to_leave(self) -> bool:
        """Whether the engine may swap this role for another now (a decode role: no KV arriving)."""
        return True

    def after_prefill(self, seq: Sequence) -> Handover | None:
        """Called when an unfinished request has sampled its token after a prefill (its first, or
        the next after a recompute); a prefill role keeps its KV for decode and returns the hand-over."""
        return None

    def after_prefill_samples(self, prompt_seq: Sequence, samples: list[Sequence]) -> Handover | None:
        """As ``after_prefill`` for a request of n samples at its prompt's end: ``samples`` are
        those that go on (``prompt_seq``, which ran the prompt, among them unless it ended at its
        first token), the others forked from it. A decoding role runs the forks beside it; a
        prefill role hands them all over at once."""
        for sample in samples:
            if sample is not prompt_seq:
                self.scheduler.running.add(sample)
        return None

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted request wherever the role has it and free its blocks."""
        self.scheduler.finish(seq)

    def abort(self, seq: Sequence, reason: str) -> RequestDelta | None:
        """Stop ``seq``; its final delta, or None when that comes later (decode: KV still arriving)."""
        return self.engine.finish(seq, reason)

    def tick(self, now: float) -> list[RequestDelta]:
        """Housekeeping between steps (``now``: ``time.monotonic()``); the deltas it produced."""
        return []

    def stats(self) -> RoleStats:
        return RoleStats()

    def _not_this_role(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.engine.name} is a {self.role} instance: {what}")

    def add_handover(self, handover: Handover) -> None:
        raise self._not_this_role("only decode instances take requests over from prefill")

    def adopt(self, seq: Sequence) -> None:
        """Decode a request whose KV is in this engine's blocks already (it held it for decode)."""
        if not self.decodes:
            raise self._not_this_role("a prefill role decodes nothing")
        self.scheduler.running.add(seq)

    def pull_done(
        self, request_id: str, attempt: int, start: float | None, end: float | None, error: str | None
    ) -> list[RequestDelta]:
        raise self._not_this_role("only decode instances pull KV")


def colocated_scheduler(engine: LLMEngine) -> Scheduler:
    """A scheduler of both phases for ``engine``: chunked prefill or prefill-first, as configured."""
    config = engine.config.scheduler
    if config.enable_chunked_prefill:
        return ChunkedPrefillScheduler(config, engine.block_manager, engine.step_time)
    return PrefillFirstScheduler(config, engine.block_manager, engine.step_time)


class ColocatedRole(InstanceRole):
    """Both phases of its own requests in one instance: the vLLM-style baseline."""

    role = Role.COLOCATED

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine, colocated_scheduler(engine))
