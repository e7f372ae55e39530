"""The prefill role: run prompts, sample each request's first token, and hand the request on to
decode while the engine holds its KV (``KVHold``) until a decode instance has pulled it; no new
prompt is scheduled while held KV passes its limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distserve.core.handover import Handover
from distserve.core.role import Role
from distserve.core.sequence import Sequence
from distserve.engine.role import InstanceRole, RoleStats
from distserve.scheduling.scheduler import PrefillOnlyScheduler, ScheduledBatch

if TYPE_CHECKING:
    from distserve.engine.llm_engine import LLMEngine


class PrefillRole(InstanceRole):
    role = Role.PREFILL
    decodes = False

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine, PrefillOnlyScheduler(engine.config.scheduler, engine.block_manager))
        self.num_throttled_steps = 0

    def schedule(self) -> ScheduledBatch:
        if self.engine.kv_hold.full:
            self.num_throttled_steps += 1
            return ScheduledBatch([], is_prefill=True)
        return super().schedule()

    def after_prefill(self, seq: Sequence) -> Handover:
        return self.engine.hand_off(seq)

    def stats(self) -> RoleStats:
        return RoleStats(num_throttled_steps=self.num_throttled_steps)
