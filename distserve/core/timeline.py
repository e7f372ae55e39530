"""The per-request timeline that the simulator predicts and the real system records, so the two can
be compared request by request. Both write it as JSON lines, one request a line, under the field
names below; times are seconds on one clock (the simulator's starts at 0)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from distserve.core.latency import time_per_output_token


@dataclass
class RequestTimeline:
    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    # None where the request has not been (or never goes: handover, admission, migration colocated).
    prefill_queued: float | None = None  # reached its prefill (or colocated) instance's queue
    prefill_start: float | None = None  # its (first) prefill batch began
    prefill_end: float | None = None  # its first token was sampled
    prefill_batch_size: int | None = None  # requests in that prefill batch
    prefill_batch_tokens: int | None = None  # tokens computed in that batch
    handover: float | None = None  # disaggregated: handed to a decode instance (None colocated)
    decode_admitted: float | None = None  # decode allocated its blocks (the KV pull is queued then)
    migration_start: float | None = None  # the pull began (a decode instance pulls one request at a time)
    migration_end: float | None = None
    # (start, end, batch size) of every step after its first token that gave it a token; a recompute
    # after preemption is a prefill batch and counts as such a step.
    steps: list[tuple[float, float, int]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # each output token's time, first token included
    finish: float | None = None
    num_preemptions: int = 0
    prefill_instance: str | None = None  # where it was sent first (a colocated request: its only instance)
    decode_instance: str | None = None  # None colocated
    local_prefill: bool = False  # prefilled by its decode instance (``cluster.local_prefill``): no pull
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """``time_per_output_token``: 0.0 with one token, None with none."""
        return time_per_output_token(self.token_times)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["steps"] = [list(s) for s in self.steps]
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestTimeline:
        # Unknown keys are refused rather than dropped: they mean the writer's schema has drifted.
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown timeline fields: {', '.join(sorted(unknown))}")
        return cls(**{**d, "steps": [tuple(s) for s in d.get("steps", ())]})


def write_jsonl(path: str | Path, timelines: Iterable[RequestTimeline]) -> None:
    with open(path, "w") as f:
        for t in timelines:
            f.write(json.dumps(t.to_json()) + "\n")


def read_jsonl(path: str | Path) -> list[RequestTimeline]:
    with open(path) as f:
        return [RequestTimeline.from_json(json.loads(line)) for line in f if line.strip()]
