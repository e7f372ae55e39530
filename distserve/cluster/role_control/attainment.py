"""How well requests met their SLOs, and how sure a share of them is. An SLO counts as missed when
its attainment is under the target by more than the window's sampling noise (``miss_margin``); a
share of remembered requests counts as better than another, or as meeting the target, only beyond
its samples' noise (``Share``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distserve.cluster.role_control.request_records import FinishedRequest


@dataclass
class Attainment:
    ttft: float  # share of requests within the TTFT SLO
    tpot: float  # of the requests whose TPOT is known, within the TPOT SLO
    both: float  # share within both
    num_requests: int
    # The target quantile of each latency as a fraction of its SLO (1 or more: under the target):
    # how close to its SLO each phase runs, which attainment alone does not say while it is met.
    ttft_level: float
    tpot_level: float
    num_decoded: int  # requests whose TPOT is known (finished, or in flight and past its SLO already)


def attainment(requests: list[FinishedRequest], slo_ttft: float, slo_tpot: float, target: float = 0.9) -> Attainment:
    """Each request judged by its own SLOs, else by ``slo_ttft`` and ``slo_tpot``."""
    ttft_ratio = [r.ttft / (r.slo.ttft or slo_ttft) for r in requests]
    tpot_ratio = [None if r.tpot is None else r.tpot / (r.slo.tpot or slo_tpot) for r in requests]
    decoded = [x for x in tpot_ratio if x is not None]
    tpot = sum(x <= 1.0 for x in decoded) / len(decoded) if decoded else 1.0
    both = sum(t <= 1.0 and (p is None or p <= 1.0) for t, p in zip(ttft_ratio, tpot_ratio)) / len(requests)
    ttft = sum(x <= 1.0 for x in ttft_ratio) / len(requests)
    ttft_level, tpot_level = _quantile(ttft_ratio, target), _quantile(decoded, target)
    return Attainment(ttft, tpot, both, len(requests), ttft_level, tpot_level, len(decoded))


def _quantile(values: list[float], q: float) -> float:
    """The smallest value that ``q`` of ``values`` are at most (0 for none)."""
    return sorted(values)[max(0, math.ceil(q * len(values)) - 1)] if values else 0.0


def miss_margin(target: float, num_requests: int) -> float:
    """How far under the target a share of ``num_requests`` must be to count as missed: one-sided
    95% for a binomial share, so that a window's noise alone rarely moves an instance."""
    return 1.645 * math.sqrt(target * (1 - target) / num_requests)


@dataclass(frozen=True)
class Share:
    """Of ``num_requests`` requests, ``met`` met both SLOs."""

    met: int
    num_requests: int

    @property
    def value(self) -> float:
        return self.met / self.num_requests

    def clearly_above(self, other: Share) -> bool:
        """Higher than ``other`` by more than both samples' noise (one-sided 95%). The noise is
        estimated as if each sample had two more requests that met and two that missed (Agresti-
        Coull): otherwise 8 of 8 met has no noise at all and is "clearly above" 90% of a thousand."""
        variance = sum(s.adjusted * (1 - s.adjusted) / (s.num_requests + 4) for s in (self, other))
        return self.value - other.value > 1.645 * math.sqrt(variance)

    @property
    def adjusted(self) -> float:
        return (self.met + 2) / (self.num_requests + 4)

    def surely_at_least(self, target: float) -> bool:
        """At ``target`` or above beyond the sample's noise (one-sided 95%, Agresti-Coull as above):
        40 of 40 met is surely 90%, 20 of 20 is not."""
        noise = 1.645 * math.sqrt(self.adjusted * (1 - self.adjusted) / (self.num_requests + 4))
        return self.adjusted - noise >= target
