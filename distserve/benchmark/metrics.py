"""Serving-benchmark metrics from client-side timelines: TTFT, TPOT, ITL, E2E, SLO attainment,
throughput, and goodput (the highest rate that still meets the attainment target)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from distserve.core.latency import Attainment, time_per_output_token
from distserve.core.latency import attainment as latency_attainment


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are absolute seconds on one clock (e.g.
    ``time.perf_counter()``); a chunk of k tokens arriving at t adds t to ``token_times`` k times."""

    prompt_len: int
    output_len: int  # requested
    send_time: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None  # "CODE: the server's message"
    scheduled: float = 0.0  # its arrival on the workload's schedule, seconds from the run's start
    timeline: Any = None  # the server's pb.Timeline of it, when asked for

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        """Time to first token; NaN without tokens."""
        return self.token_times[0] - self.send_time if self.token_times else math.nan

    @property
    def tpot(self) -> float:
        """``time_per_output_token``: 0.0 for a single token; NaN without tokens."""
        tpot = time_per_output_token(self.token_times)
        return math.nan if tpot is None else tpot

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive tokens (0 inside a chunk)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        """Send to last token; NaN without tokens."""
        return self.token_times[-1] - self.send_time if self.token_times else math.nan


@dataclass
class Stats:
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        """Mean and percentiles (numpy's linear interpolation); all NaN for no values."""
        if len(values) == 0:
            return cls(math.nan, math.nan, math.nan, math.nan)
        a = np.asarray(values, dtype=float)
        median, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(a.mean()), float(median), float(p90), float(p99))


@dataclass
class SLO:
    ttft: float  # seconds
    tpot: float  # seconds

    def scaled(self, factor: float) -> SLO:
        """Both SLOs times ``factor``: the x axis of DistServe's attainment-vs-SLO-scale plots."""
        return SLO(self.ttft * factor, self.tpot * factor)


def attainment(records: Sequence[RequestRecord], slo: SLO) -> Attainment:
    """SLO attainment over all records; a failed request misses all three."""
    return latency_attainment(((r.ttft, r.tpot) if r.ok else (None, None) for r in records), slo.ttft, slo.tpot)


@dataclass
class BenchResult:
    """A run's summary. Latency stats are over successful requests (TPOT over those with >= 2
    tokens, ITL over all their gaps); throughputs count successful requests over ``duration``,
    from the first send to the last token. ``rate`` is the offered rate, None when not given;
    ``first_error`` is the error of the first failed request sent."""

    num_requests: int
    num_ok: int
    num_errors: int
    first_error: str | None
    duration: float
    request_throughput: float
    output_throughput: float
    input_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    attainment: Attainment | None = None
    slo: SLO | None = None
    rate: float | None = None

    def to_dict(self) -> dict:
        """JSON-ready (times in seconds); NaN becomes None and an infinite rate the string "inf"."""
        return _json_ready(asdict(self))


def _json_ready(value: object) -> object:
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None, rate: float | None = None) -> BenchResult:
    if not records:
        raise ValueError("no requests to summarize")
    ok = [r for r in records if r.ok]
    failed = sorted((r for r in records if r.error is not None), key=lambda r: r.send_time)
    ends = [r.token_times[-1] for r in records if r.token_times] or [r.send_time for r in records]
    duration = max(ends) - min(r.send_time for r in records)

    def per_second(total: float) -> float:
        return total / duration if duration > 0 else math.nan

    return BenchResult(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        first_error=failed[0].error if failed else None,
        duration=duration,
        request_throughput=per_second(len(ok)),
        output_throughput=per_second(sum(r.num_tokens for r in ok)),
        input_throughput=per_second(sum(r.prompt_len for r in ok)),
        ttft=Stats.of([r.ttft for r in ok]),
        tpot=Stats.of([r.tpot for r in ok if r.num_tokens >= 2]),
        itl=Stats.of([gap for r in ok for gap in r.itls]),
        e2e=Stats.of([r.e2e for r in ok]),
        attainment=attainment(records, slo) if slo is not None else None,
        slo=slo,
        rate=rate,
    )


def format_result(result: BenchResult) -> str:
    """A compact table in the spirit of vLLM's benchmark printout (latencies in ms)."""
    width = 60
    lines = [" Serving benchmark result ".center(width, "=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<34}{value:>{width - 34}}")

    row("Requests (ok / errors)", f"{result.num_ok} / {result.num_errors}")
    if result.first_error is not None:
        lines.append(f"First error: {result.first_error}")
    if result.rate is not None:
        row("Offered rate (req/s)", f"{result.rate:.2f}")
    row("Duration (s)", f"{result.duration:.2f}")
    row("Request throughput (req/s)", f"{result.request_throughput:.2f}")
    row("Output token throughput (tok/s)", f"{result.output_throughput:.2f}")
    row("Input token throughput (tok/s)", f"{result.input_throughput:.2f}")
    lines.append("-" * width)
    lines.append(f"{'Latency (ms)':<16}" + "".join(f"{h:>11}" for h in ("mean", "median", "p90", "p99")))
    for name, stats in (("TTFT", result.ttft), ("TPOT", result.tpot), ("ITL", result.itl), ("E2E", result.e2e)):
        values = (stats.mean, stats.median, stats.p90, stats.p99)
        lines.append(f"{name:<16}" + "".join(f"{v * 1000:>11.2f}" for v in values))
    if result.attainment is not None:
        lines.append("-" * width)
        if result.slo is not None:
            row("SLO (TTFT / TPOT, ms)", f"{result.slo.ttft * 1000:.1f} / {result.slo.tpot * 1000:.1f}")
        att = result.attainment
        row("SLO attainment (%): both", f"{att.both * 100:.1f}")
        row("SLO attainment (%): TTFT", f"{att.ttft * 100:.1f}")
        row("SLO attainment (%): TPOT", f"{att.tpot * 100:.1f}")
    lines.append("=" * width)
    return "\n".join(lines)
