"""Request timelines of a benchmark run, as the server recorded them, in the simulator's schema
(``distserve.core.timeline.RequestTimeline``) and on the workload's clock, so a run and its simulation
can be compared request by request (``distserve place compare``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from distserve.benchmark.metrics import RequestRecord
from distserve.core.timeline import RequestTimeline, write_jsonl

# pb.Timeline fields that are times, and their RequestTimeline names.
_TIMES = {
    "arrival": "arrival", "prefill_queued": "prefill_queued", "prefill_start": "prefill_start",
    "prefill_end": "prefill_end", "handover": "handover", "decode_admitted": "decode_admitted",
    "migration_start": "migration_start", "migration_end": "migration_end", "finished": "finish",
}  # fmt: skip


def request_timelines(records: Sequence[RequestRecord]) -> list[RequestTimeline]:
    """The server's timeline of each request, shifted from the server's clock onto the schedule's:
    the request that reached the server soonest after its scheduled arrival arrives on time, and
    the others as late as their calls took longer. A request without one (it failed) keeps only its
    lengths, arrival and error."""
    lags = [r.timeline.arrival - r.scheduled for r in records if r.timeline is not None]
    offset = min(lags) if lags else 0.0
    return [_timeline(i, r, offset) for i, r in enumerate(records)]


def _timeline(index: int, record: RequestRecord, offset: float) -> RequestTimeline:
    timeline = RequestTimeline(str(index), record.prompt_len, record.output_len, record.scheduled, error=record.error)
    t = record.timeline
    if t is None:
        return timeline
    for source, name in _TIMES.items():
        if t.HasField(source):
            setattr(timeline, name, getattr(t, source) - offset)
    for name in ("prefill_batch_size", "prefill_batch_tokens"):
        if t.HasField(name):
            setattr(timeline, name, getattr(t, name))
    timeline.steps = [(a - offset, b - offset, n) for a, b, n in zip(t.step_starts, t.step_ends, t.step_batch_sizes)]
    timeline.token_times = [x - offset for x in t.token_times]
    timeline.num_preemptions = t.num_preemptions
    timeline.prefill_instance = t.prefill_instance or None
    timeline.decode_instance = t.decode_instance or None
    timeline.local_prefill = t.local_prefill
    return timeline


def trace_path(base: str, rate: float, several: bool) -> Path:
    """Where a run's timelines go: ``base`` itself, or with the rate before the suffix when a
    command makes several runs (``trace.jsonl`` -> ``trace-rate2.5.jsonl``)."""
    path = Path(base)
    return path.with_name(f"{path.stem}-rate{rate:g}{path.suffix}") if several else path


def write_trace(base: str, rate: float, several: bool, records: Sequence[RequestRecord]) -> Path:
    path = trace_path(base, rate, several)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, request_timelines(records))
    return path
