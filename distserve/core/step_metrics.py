"""Where an engine step's time goes: schedule, swap (KV copies to and from the host pool), tier (KV
copies to and from the node's prefix tier), prepare inputs, forward, sample (on the driver rank),
dispatch (calls to the workers and back) and postprocess."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

PHASES = ("schedule", "swap", "tier", "prepare", "forward", "sample", "dispatch", "postprocess")


@dataclass
class StepRecord:
    is_prefill: bool
    batch_size: int
    num_tokens: int
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class StepTimer:
    """Times the phases of one step; ``lap(phase)`` closes the phase that just ran (a phase that runs
    twice in a step adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


class StepStats:
    """Totals over all steps, plus the latest ``max_records`` steps in full."""

    def __init__(self, max_records: int = 0) -> None:
        self.num_steps = 0
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.records: deque[StepRecord] = deque(maxlen=max_records)

    def add(self, record: StepRecord) -> None:
        self.num_steps += 1
        for phase, seconds in record.seconds.items():
            self.totals[phase] += seconds
        if self.records.maxlen:
            self.records.append(record)
