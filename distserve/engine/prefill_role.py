"""The prefill role: run prompts, sample each request's first token, and hand the request on to
decode while the engine holds its KV (``KVHold``) until a decode instance has pulled it; no step is
scheduled while held KV passes its limit.
"""

from __future__ import annotations

from distserve.core.role import Role
from distserve.core.sequence import Sequence
from distserve.engine.role import InstanceRole, RoleContext, RoleStats
from distserve.scheduling.scheduler import StepMode


class PrefillRole(InstanceRole):
    role = Role.PREFILL
    decodes = False

    def __init__(self, context: RoleContext, finishing: bool = False) -> None:
        """``finishing``: the engine leaves colocated with requests still decoding, which this role
        decodes to their end (``finish_decoding_as_prefill``). Until its next role change its
        scheduler forms steps as a colocated instance's, so their tokens run beside the new prompts,
        and it hands every new prompt on after its first token, so no request joins them."""
        super().__init__(context)
        self.finishing = finishing
        self.num_throttled_steps = 0

    @property
    def step_mode(self) -> StepMode:
        return super().step_mode if self.finishing else StepMode.PREFILL_ONLY

    def may_schedule(self) -> bool:
        if self.context.kv_hold.full:
            self.num_throttled_steps += 1
            return False
        return True

    def after_prefill(self, seq: Sequence) -> bool:
        if self.finishing:
            self.scheduler.finish_running(seq)
        return True

    def after_prefill_samples(self, prompt_seq: Sequence, samples: list[Sequence]) -> bool:
        # The first carries the prompt's KV; the others share it and cross with it.
        return self.after_prefill(samples[0])

    def stats(self) -> RoleStats:
        return RoleStats(num_throttled_steps=self.num_throttled_steps)
