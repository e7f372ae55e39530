"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distserve.kv_transfer.migrator import PrefilledRequest


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's stages; None where it has not got there
    (or, for migration, never goes: a colocated request)."""

    arrival_time: float | None = None  # the orchestrator accepted it
    prefill_start: float | None = None  # its prefill batch began
    prefill_end: float | None = None  # its first token was sampled
    migration_start: float | None = None  # the decode instance began pulling its KV
    migration_end: float | None = None
    token_times: list[float] = field(default_factory=list)  # each output token reached the orchestrator
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.arrival_time is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (tokens - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far
    new_token_ids: list[int]  # tokens added by this step
    new_text: str  # text added by this step
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" (cancelled) or "error" (could not go on) once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    prefilled: PrefilledRequest | None = None  # from a prefill instance: what decode needs to take over
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


STAGE_TIMES = ("prefill_start", "prefill_end", "migration_start", "migration_end")


@dataclass
class RequestDelta:
    """What one step adds to a request, as an instance sends it to the orchestrator: new tokens and
    text only, so a message stays the same size however long the request grows (a RequestOutput
    repeats the prompt and everything generated so far). The orchestrator keeps the rest."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    prefilled: PrefilledRequest | None = None
    # RequestMetrics' STAGE_TIMES: a tuple pickles in about half the time of a dataclass.
    stage_times: tuple[float | None, ...] = (None,) * len(STAGE_TIMES)

    @classmethod
    def of(cls, output: RequestOutput) -> RequestDelta:
        return cls(
            output.request_id,
            output.new_token_ids,
            output.new_text,
            output.finished,
            output.finish_reason,
            output.num_cached_tokens,
            output.prefilled,
            tuple(getattr(output.metrics, name) for name in STAGE_TIMES),
        )
