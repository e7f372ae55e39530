"""The prefill role: run prompts, sample each request's first token, and hold its KV until a
decode instance has pulled it.

Back-pressure: while held KV takes more than ``kv_hold_fraction`` of the blocks, no new prompt is
scheduled, so a slow or full decode side throttles prefill instead of prefill running out of
blocks. Deadline: KV held longer than ``kv_hold_timeout`` (its decode instance died, or never got
to it) is freed and the request reported failed, so a lost hand-over cannot pin blocks forever.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from distserve.core.handover import Handover
from distserve.core.outputs import RequestDelta
from distserve.core.role import Role
from distserve.core.sequence import Sequence
from distserve.engine.role import InstanceRole, RoleStats
from distserve.scheduling.scheduler import PrefillOnlyScheduler, ScheduledBatch

if TYPE_CHECKING:
    from distserve.engine.llm_engine import LLMEngine


class KVHold:
    """The KV of prefilled requests, kept until a decode instance has pulled it.

    A request goes HELD -> RELEASED (pulled; ``take_released`` hands it back to be freed), or
    HELD -> expired (past the deadline; freed), or HELD -> dropped (aborted). ``release`` comes
    from the instance's call threads while the step loop expires, so the states change under a
    lock and a request is released or expired, never both: a release that finds the request no
    longer held is refused, and the puller must not trust what it read.
    """

    def __init__(self, timeout: float, limit_blocks: int) -> None:
        self.timeout = timeout
        self.limit_blocks = limit_blocks
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Sequence, float]] = {}  # request id -> (sequence, held since)
        self._released: list[Sequence] = []

    def hold(self, seq: Sequence, now: float) -> None:
        with self._lock:
            self._held[seq.request_id] = (seq, now)

    def release(self, request_id: str, attempt: int) -> bool:
        """Decode has pulled the KV of this run: True when it was still held, so the pull is valid."""
        with self._lock:
            entry = self._held.get(request_id)
            if entry is None or entry[0].attempt != attempt:
                return False
            del self._held[request_id]
            self._released.append(entry[0])
            return True

    def take_released(self) -> list[Sequence]:
        with self._lock:
            released, self._released = self._released, []
            return released

    def expire(self, now: float) -> list[Sequence]:
        """Requests held longer than the timeout: no longer held, for the caller to fail."""
        with self._lock:
            expired = [rid for rid, (_, since) in self._held.items() if now - since > self.timeout]
            return [self._held.pop(rid)[0] for rid in expired]

    def drop(self, seq: Sequence) -> bool:
        """Stop holding an aborted request; False if it was not held."""
        with self._lock:
            entry = self._held.get(seq.request_id)
            if entry is None or entry[0] is not seq:
                return False
            del self._held[seq.request_id]
            return True

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Blocks still in use for decode: held, or released and not yet freed."""
        with self._lock:
            seqs = [seq for seq, _ in self._held.values()] + self._released
        return sum(len(seq.block_table) for seq in seqs)

    @property
    def full(self) -> bool:
        return self.num_blocks >= self.limit_blocks


class PrefillRole(InstanceRole):
    role = Role.PREFILL

    def __init__(self, engine: LLMEngine) -> None:
        config = engine.config.scheduler
        super().__init__(engine, PrefillOnlyScheduler(config, engine.block_manager))
        limit = max(1, int(config.kv_hold_fraction * engine.block_manager.num_blocks))
        self.hold = KVHold(config.kv_hold_timeout, limit)
        self.num_throttled_steps = 0

    def schedule(self) -> ScheduledBatch:
        if self.hold.full:
            self.num_throttled_steps += 1
            return ScheduledBatch([], is_prefill=True)
        return super().schedule()

    def after_prefill(self, seq: Sequence) -> Handover:
        self.hold.hold(seq, time.monotonic())
        return Handover(
            seq.request_id,
            seq.attempt,
            self.engine.name,
            seq.prompt,
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.sampling_params,
            seq.priority,
            list(seq.block_table),
            self.engine.block_manager.block_size,
        )

    def release_kv(self, request_id: str, attempt: int) -> bool:
        return self.hold.release(request_id, attempt)

    def tick(self, now: float) -> list[RequestDelta]:
        """Free the KV decode has pulled (the request goes on there); fail the KV past its deadline."""
        for seq in self.hold.take_released():
            self.engine.forget(seq)
            self.engine.block_manager.free(seq)
        return [self.engine.finish(seq, "error") for seq in self.hold.expire(now)]

    def finish(self, seq: Sequence) -> None:
        if self.hold.drop(seq):
            self.engine.block_manager.free(seq)
        else:  # waiting, or expired (no longer held but still owning its blocks)
            self.scheduler.finish(seq)

    def stats(self) -> RoleStats:
        return RoleStats(num_held=len(self.hold), num_throttled_steps=self.num_throttled_steps)
