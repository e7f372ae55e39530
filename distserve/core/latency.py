"""Latency objectives met or missed: the one definition of TPOT and of SLO attainment that the
server, the role controller, the benchmark and the planner all use."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def time_per_output_token(token_times: Sequence[float]) -> float | None:
    """Mean seconds per output token after the first: (last - first) / (tokens - 1). A request of
    one token has no decode phase: 0.0, which meets any TPOT SLO (as in DistServe). None without
    tokens."""
    if not token_times:
        return None
    if len(token_times) == 1:
        return 0.0
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def meets_slos(ttft: float | None, tpot: float | None, slo_ttft: float, slo_tpot: float) -> tuple[bool, bool]:
    """Whether a request met its TTFT SLO and its TPOT SLO; one without a token (failed) met neither."""
    if ttft is None or tpot is None:
        return False, False
    return ttft <= slo_ttft, tpot <= slo_tpot


@dataclass(frozen=True)
class Attainment:
    """Shares of requests meeting both SLOs, the TTFT SLO, and the TPOT SLO."""

    both: float
    ttft: float
    tpot: float


def attainment(latencies: Iterable[tuple[float | None, float | None]], slo_ttft: float, slo_tpot: float) -> Attainment:
    """SLO attainment of requests given as (TTFT, TPOT), None for a failed request's."""
    met = [meets_slos(ttft, tpot, slo_ttft, slo_tpot) for ttft, tpot in latencies]
    if not met:
        raise ValueError("attainment of no requests")
    n = len(met)
    return Attainment(
        both=sum(a and b for a, b in met) / n, ttft=sum(a for a, _ in met) / n, tpot=sum(b for _, b in met) / n
    )
