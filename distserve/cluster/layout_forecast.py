"""How a layout would serve a load it has not served yet: a forecast of the requests' latencies as a
share of their SLOs, colocated (chunked prefill) against disaggregated, from the instances' own
step times (``StepTimeModel``'s line, a ``StepCost``: seconds = fixed + per_token * tokens).

The role controller asks it when a kind of request arrives that its memory says nothing of (a
workload that changed), to move at once instead of waiting a window for the misses. The forecast
is a fluid model, not a simulation: each pool's prompts queue as in an M/D/1 queue, decode batches
hold the requests that arrive while one decodes (Little's law). What sets the winner is the kind's
SLOs: under a tight TPOT SLO a colocated step cut to fit it (``tpot_aware_chunking``) runs a small
chunk beside decoding and prefills slowly, where a prefill instance runs whole prompts; under a
tight TTFT SLO and a loose TPOT, every colocated instance prefills, where only half of a
disaggregated cluster does. A measurement that disagrees (a window of misses, or memory) wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distserve.scheduling.scheduler import TPOT_SLO_SHARE
from distserve.scheduling.step_time import StepCost


@dataclass(frozen=True)
class Demand:
    """What the arriving requests ask: their rate, typical lengths and SLOs."""

    rate: float  # requests per second
    prompt_len: float
    output_len: float  # tokens asked for
    slo_ttft: float  # seconds
    slo_tpot: float


@dataclass(frozen=True)
class ChunkedPrefill:
    """How a colocated instance's steps are formed."""

    max_num_batched_tokens: int
    block_size: int  # the least a step cut to a TPOT SLO still prefills
    tpot_aware: bool  # steps are cut to fit the decoding requests' TPOT SLO


@dataclass(frozen=True, order=True)
class Forecast:
    """How a layout would serve a load; the lesser serves it better. Over capacity its queue grows
    without bound (``share`` infinite), and two such layouts rank by how far over they are."""

    share: float  # the worse of the TTFT and the TPOT as a share of its SLO (over 1: missed)
    utilization: float  # of its busiest pool: the share of the time its work keeps it busy

    def __str__(self) -> str:
        if math.isinf(self.share):
            return f"over capacity ({self.utilization:.0%} busy)"
        return f"at {self.share:.0%} of their SLOs"


def forecast(colocated: bool, num_instances: int, demand: Demand, cost: StepCost, chunking: ChunkedPrefill) -> Forecast:
    """``demand`` on ``num_instances`` instances all colocated, or half decode and half prefill (the
    controller's disaggregated layout; the odd one prefills)."""
    if colocated:
        (ttft, busy), tpot = _colocated(demand, num_instances, cost, chunking)
    else:
        num_decode = num_instances // 2
        ttft, busy = _prefill_pool(demand, num_instances - num_decode, cost)
        tpot, decoding = _decode_pool(demand, num_decode, cost)
        busy = max(busy, decoding)
    return Forecast(max(ttft / demand.slo_ttft, tpot / demand.slo_tpot), busy)


def _colocated(
    demand: Demand, num_instances: int, cost: StepCost, chunking: ChunkedPrefill
) -> tuple[tuple[float, float], float]:
    """Each instance takes its share of the requests; while a prompt waits, every step runs the
    decode batch's tokens and a chunk of prompt. The TTFT and utilization, and the TPOT."""
    rate = demand.rate / num_instances
    budget = chunking.max_num_batched_tokens
    step = cost.seconds(budget)
    for _ in range(4):  # the decode batch grows with the step time, which grows with it: a few rounds settle
        batch = min(budget - 1.0, rate * demand.output_len * step)
        tokens = budget
        if chunking.tpot_aware:
            # As the scheduler cuts a chunked step (Scheduler.tokens_within_tpot_slo), at least a block of prompt.
            within = cost.tokens_within(TPOT_SLO_SHARE * demand.slo_tpot)
            tokens = min(budget, max(within, batch + chunking.block_size))
        step = cost.seconds(tokens)
    chunk = max(1.0, tokens - batch)
    service = demand.prompt_len / chunk * step  # a lone prompt's prefill, chunk by chunk
    return _queued(rate * service, service), step


def _prefill_pool(demand: Demand, num_instances: int, cost: StepCost) -> tuple[float, float]:
    """Prompts prefill whole, a step each: the TTFT and utilization."""
    service = cost.seconds(demand.prompt_len)
    return _queued(demand.rate / num_instances * service, service)


def _decode_pool(demand: Demand, num_instances: int, cost: StepCost) -> tuple[float, float]:
    """A decode step of the batch that arrives while one decodes: the TPOT, and the share of a step
    its tokens take (at 1 or over, the batch grows without bound)."""
    tokens_per_second = demand.rate / num_instances * demand.output_len  # the batch per second of step
    busy = cost.per_token * tokens_per_second
    return (cost.fixed / (1.0 - busy) if busy < 1 else math.inf), busy


def _queued(utilization: float, service: float) -> tuple[float, float]:
    """Mean time in an M/D/1 queue with its service, and the utilization."""
    if utilization >= 1:
        return math.inf, utilization
    return service + utilization / (2 * (1 - utilization)) * service, utilization
