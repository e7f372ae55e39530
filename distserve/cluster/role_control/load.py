"""What a load asks of the cluster, as the controller tells loads apart: the typical ratio of prompt
to requested output tokens, of TPOT to TTFT SLO, and the request rate, all known when a request
arrives. Loads within ``LOAD_SIMILARITY`` of each other count as the same, and requests of similar
ratios are of one kind (``kinds``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from distserve.cluster.role_control.request_records import Arrival, FinishedRequest
from distserve.core.slo import RequestSLO

LOAD_SIMILARITY = 1.5  # loads whose token ratios and rates are within this factor count as the same
# A rate, and what a layout did under it, is said by no fewer arrivals or requests than this.
MIX_ARRIVALS = 3


@dataclass(frozen=True)
class Load:
    """What a window of requests asked of the cluster."""

    tokens_ratio: float  # prompt tokens per requested output token, the geometric mean: how prefill-heavy
    rate: float  # requests per second
    arrivals: int = 0  # how many arrivals the rate was measured from; 0: exact
    # TPOT SLO over TTFT SLO, the geometric mean, relative to the cluster's (1: the cluster's SLOs):
    # how much looser decoding's objective is against prefill's. Which layout wins turns on it
    # (colocation with a tight TTFT and a loose TPOT): requests of one length but other SLOs are
    # another load.
    slo_ratio: float = 1.0

    @classmethod
    def of(cls, requests: list[Arrival], cluster_slo: RequestSLO = RequestSLO()) -> Load:
        """A typical request's ratios (a few of another kind in the window move them little) and the
        rate; a request without its own SLOs has the cluster's."""
        span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
        log_ratio = sum(math.log(r.prompt_len / max(1, r.max_tokens)) for r in requests) / len(requests)
        log_slo_ratio = sum(math.log(_slo_ratio(r.slo, cluster_slo)) for r in requests) / len(requests)
        rate = (len(requests) - 1) / span if span > 0 else math.inf
        return cls(math.exp(log_ratio), rate, len(requests), math.exp(log_slo_ratio))

    def at_rate_of(self, other: Load) -> Load:
        """This mix at ``other``'s rate (a longer window's, less noisy)."""
        return dataclasses.replace(self, rate=other.rate, arrivals=other.arrivals)

    @property
    def lowest_rate(self) -> float:
        """The rate less its measurement's noise (one-sided 95%, the standard error about rate /
        sqrt(arrivals) for Poisson arrivals): what was met at this rate or above may have been
        measured as low as this. A few arrivals a second give a window of tens, whose rate is
        uncertain by a quarter."""
        return self.rate * max(0.0, 1 - self._noise)

    @property
    def highest_rate(self) -> float:
        """The rate plus its measurement's noise: what fell short at this rate or below may have
        been measured as high as this."""
        return self.rate * (1 + self._noise)

    @property
    def _noise(self) -> float:
        return 1.645 / math.sqrt(self.arrivals) if self.arrivals else 0.0

    def similar(self, other: Load, factor: float = LOAD_SIMILARITY) -> bool:
        return self.similar_mix(other, factor) and _within(self.rate, other.rate, factor)

    def similar_mix(self, other: Load, factor: float = LOAD_SIMILARITY) -> bool:
        """Of similar requests, at whatever rate."""
        tokens = _within(self.tokens_ratio, other.tokens_ratio, factor)
        return tokens and _within(self.slo_ratio, other.slo_ratio, factor)


def _within(a: float, b: float, factor: float) -> bool:
    return max(a, b) <= factor * min(a, b)


def kinds(requests: list[FinishedRequest], cluster_slo: RequestSLO = RequestSLO()) -> list[list[FinishedRequest]]:
    """``requests`` in groups of one kind (similar ratios of prompt to output tokens and of SLOs),
    each request in the first group whose first request it is like."""
    groups: list[tuple[Load, list[FinishedRequest]]] = []
    for request in requests:
        one = Load.of([request], cluster_slo)
        group = next((members for first, members in groups if first.similar_mix(one)), None)
        if group is None:
            groups.append((one, [request]))
        else:
            group.append(request)
    return [members for _, members in groups]


def _slo_ratio(slo: RequestSLO, cluster: RequestSLO) -> float:
    """A request's TPOT SLO over its TTFT SLO, relative to the cluster's."""
    if not (cluster.ttft and cluster.tpot):
        return 1.0
    return ((slo.tpot or cluster.tpot) / (slo.ttft or cluster.ttft)) / (cluster.tpot / cluster.ttft)
