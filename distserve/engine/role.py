"""An engine's role: a policy of its one scheduler.

The engine (scheduler, block manager, detokenizer, executor, output deltas) is the same in every
role; the role object decides what the engine admits (new prompts, hand-overs, whether a step may
schedule at all), how its scheduler forms a step (``step_mode``) and what follows a prefill, and
holds the role's own state machine (``PrefillRole``: back-pressure from the KV held for decode;
``DecodeRole``: the admission of handed-over requests). A role decides and the engine acts: a role
sees only the engine's parts that outlive it (``RoleContext``) and returns what is to happen (a
request leaves for decode, a pull starts, a request ends), never calling back into the engine. To
change role while running (``LLMEngine.change_role``) the engine changes the policy (the role
object, the scheduler's mode); the requests the new role can serve stay where they
are in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.config import SchedulerConfig
from distserve.core.handover import Handover
from distserve.core.role import Role
from distserve.core.sequence import Sequence
from distserve.engine.kv_hold import KVHold
from distserve.scheduling.scheduler import Scheduler, StepMode


@dataclass
class RoleContext:
    """The parts of an engine a role works with: they outlive a role change."""

    name: str  # the instance's
    config: SchedulerConfig
    scheduler: Scheduler  # the engine's one scheduler, and through it the block manager
    kv_hold: KVHold


@dataclass
class PullOutcome:
    """How a run whose KV pull ended goes on: its samples, and the reason they end (None: they decode)."""

    samples: list[Sequence]
    finish_reason: str | None


@dataclass
class RoleStats:
    """The role's own counters, as ``InstanceInfo`` reports them."""

    num_pending: int = 0  # decode: handed-over requests waiting for blocks or for their KV
    num_throttled_steps: int = 0  # prefill: steps that admitted nothing because held KV passed its limit
    num_admission_waits: int = 0  # decode: handed-over requests that had to wait for free blocks


class InstanceRole:
    """Behaviour shared by all roles; a subclass overrides what its role does differently."""

    role: Role
    takes_prompts = True  # whether it runs new prompts (a decode role only recomputes its own)
    decodes = True  # whether it decodes (a prefill role hands every request on after its first token)

    def __init__(self, context: RoleContext) -> None:
        self.context = context

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.context.name})"

    @property
    def scheduler(self) -> Scheduler:
        return self.context.scheduler

    @property
    def step_mode(self) -> StepMode:
        """How the scheduler forms a step in this role: both phases, as configured."""
        return StepMode.both_phases(self.context.config)

    def add(self, seq: Sequence, local_prefill: bool = False) -> None:
        """A new request, to run from its prompt; ``local_prefill``: the orchestrator chose this
        instance to prefill and decode it (all a decode role runs from a prompt but recomputes)."""
        self.scheduler.add(seq)

    def may_schedule(self) -> bool:
        """Whether a step may be scheduled now."""
        return True

    def ready_to_leave(self) -> bool:
        """Whether the engine may change this role for another now (a decode role: no KV arriving)."""
        return True

    def after_prefill(self, seq: Sequence) -> bool:
        """Called when an unfinished request has sampled its token after a prefill (its first, or
        the next after a recompute); whether it leaves for decode now (a prefill role: the engine
        holds its KV for a decode instance to pull)."""
        return False

    def after_prefill_samples(self, prompt_seq: Sequence, samples: list[Sequence]) -> bool:
        """As ``after_prefill`` for a request of n samples at its prompt's end: ``samples`` are
        those that go on (``prompt_seq``, which ran the prompt, among them unless it ended at its
        first token), the others forked from it. A decoding role runs the forks beside it; a
        prefill role hands them all over at once, the first carrying the prompt's KV."""
        for sample in samples:
            if sample is not prompt_seq:
                self.scheduler.running.add(sample)
        return False

    def cancel(self, seq: Sequence) -> bool:
        """Stop ``seq``: True when it ends now, False when it ends later (decode: its KV still arriving)."""
        return True

    def admit(self) -> list[tuple[Sequence, Handover]]:
        """Between steps: the handed-over requests given blocks, whose KV pulls are to start now."""
        return []

    def stats(self) -> RoleStats:
        return RoleStats()

    def _not_this_role(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.context.name} is a {self.role} instance: {what}")

    def add_handover(self, seq: Sequence, handover: Handover, siblings: list[Sequence]) -> None:
        """Take a prefilled request over: ``seq`` carries its KV, ``siblings`` are its other samples."""
        raise self._not_this_role("only decode instances take requests over from prefill")

    def adopt(self, seq: Sequence) -> None:
        """Decode a request whose KV is in this engine's blocks already (it held it for decode)."""
        if not self.decodes:
            raise self._not_this_role("a prefill role decodes nothing")
        self.scheduler.running.add(seq)

    def pull_done(
        self, request_id: str, attempt: int, start: float | None, end: float | None, error: str | None
    ) -> PullOutcome | None:
        raise self._not_this_role("only decode instances pull KV")


class ColocatedRole(InstanceRole):
    """Both phases of its own requests in one instance: the vLLM-style baseline."""

    role = Role.COLOCATED
