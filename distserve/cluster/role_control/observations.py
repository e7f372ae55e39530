"""What the controller sees of the requests: those that finished, those in flight, and the load
arriving.

A layout is judged by the requests that finished in the last ``window`` seconds (or the last
``min_requests``, under a load too light to fill a window) and arrived once it had settled, each by
its own SLOs (a request may carry them) or the cluster's. Finished requests tell late: a request
is judged only once it has all its tokens, and a window of them must fill after a change. So a
window also counts the requests in flight whose TTFT is known (their first token came, or they
have queued past their TTFT SLO: a miss whatever comes), and the controller also looks at the load
arriving now: the mix of the last ``arrival_window`` seconds of arrivals, or of the last
``mix_arrivals``.
"""

from __future__ import annotations

import asyncio
from collections import deque

from distserve.cluster.role_control.config import RoleControlConfig
from distserve.cluster.role_control.load import MIX_ARRIVALS, Load
from distserve.cluster.role_control.request_records import Arrival, FinishedRequest, InFlight
from distserve.cluster.role_control.settling import Settling
from distserve.core.slo import RequestSLO


class Observations(Settling):
    def __init__(self, config: RoleControlConfig) -> None:
        super().__init__(config)
        self.arrivals: deque[Arrival] = deque()
        self.finished: deque[FinishedRequest] = deque()
        self._arrived: asyncio.Event | None = None  # set by an arrival while ``run`` waits
        self._mix_looked_at: Load | None = None  # the arriving mix at the last look

    @property
    def cluster_slo(self) -> RequestSLO:
        """The SLOs of a request that carries none of its own."""
        return RequestSLO(self.config.slo_ttft, self.config.slo_tpot)

    def observe_arrival(self, request: Arrival) -> None:
        if self.config.mode == "adaptive":
            self.arrivals.append(request)
            if self._arrived is not None:
                self._arrived.set()

    def observe(self, request: FinishedRequest) -> None:
        if self.config.mode == "adaptive":
            self.finished.append(request)

    def arriving(self, now: float) -> Load | None:
        """The load coming in: the mix of the last ``arrival_window`` seconds of arrivals, or of the
        last ``mix_arrivals`` if fewer came (a change of the mix shows at once), at the rate of the
        last ``window`` seconds (a short window's rate is too noisy to compare), which carries how
        many arrivals it was measured from; None when fewer than ``MIX_ARRIVALS`` came in the
        window. After a quiet spell the first few arrivals say what kind of load is coming, seconds
        before a window's worth of them says its rate well: what memory holds of that kind at
        rates within the noise is enough to act on."""
        mix = self.arriving_mix(now)
        return Load.of(mix, self.cluster_slo).at_rate_of(Load.of(list(self.arrivals))) if mix else None

    def arriving_mix(self, now: float) -> list[Arrival]:
        """The arrivals whose mix is the load coming in (``arriving``), none when too few came."""
        while self.arrivals and self.arrivals[0].arrival < now - max(self.config.window, self.config.arrival_window):
            self.arrivals.popleft()
        if len(self.arrivals) < MIX_ARRIVALS:  # too few for a rate
            return []
        recent = [a for a in self.arrivals if a.arrival >= now - self.config.arrival_window]
        fewest = self.config.mix_arrivals
        return recent if len(recent) >= fewest else list(self.arrivals)[-fewest:]

    def mix_moved(self, now: float) -> bool:
        """Whether the arriving mix has moved since the last look (a steady load has been looked at)."""
        arriving = self.arriving(now)
        moved = arriving is not None and not (self._mix_looked_at and arriving.similar(self._mix_looked_at))
        self._mix_looked_at = arriving or self._mix_looked_at
        return moved

    def window(self, now: float) -> list[FinishedRequest]:
        """The requests that finished in the last ``window`` seconds, or the last ``min_requests`` if
        fewer did, that arrived once the current layout had settled (none before). A light load's
        window reaches back until it holds enough to judge (at half a request a second, ten seconds
        hold five), as long as one finished in the last ``window`` seconds: a load gone quiet is not
        judged again on what came before."""
        config = self.config
        while len(self.finished) > config.min_requests and self.finished[0].finished < now - config.window:
            self.finished.popleft()
        if self.settled_at is None or not self.finished or self.finished[-1].finished < now - config.window:
            return []
        return [r for r in self.finished if r.arrival >= self.settled_at]

    def known_in_flight(self, in_flight: list[InFlight], now: float) -> list[FinishedRequest]:
        """The requests in flight that arrived once the layout settled and whose TTFT is known:
        their first token came, or they have waited past their TTFT SLO, a miss whatever comes.
        Their TPOT is unknown (None) unless it is a sure miss: its tokens so far have taken longer
        than all of ``max_tokens`` may within the TPOT SLO, so however many more come, and however
        fast, the mean time per token stays over it (that lower bound stands as its TPOT). A request
        is judged only once it finishes, seconds after its first token: a layout short of prefill
        shows here first in the prompts that queue past their SLOs, one short of decode in the
        requests that fall behind while decoding."""
        if self.settled_at is None:
            return []
        known = []
        for r in in_flight:
            request = r.request
            if request.arrival < self.settled_at:
                continue
            waited = (r.first_token if r.first_token is not None else now) - request.arrival
            if r.first_token is None and waited <= (request.slo.ttft or self.config.slo_ttft):
                continue
            tpot = None
            if r.first_token is not None and r.last_token is not None and request.max_tokens > 1:
                at_least = (r.last_token - r.first_token) / (request.max_tokens - 1)
                tpot = at_least if at_least > (request.slo.tpot or self.config.slo_tpot) else None
            known.append(FinishedRequest(**vars(request), finished=now, ttft=waited, tpot=tpot))
        return known
