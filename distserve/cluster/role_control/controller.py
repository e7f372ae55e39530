"""Roles that follow the load: a controller in the orchestrator that moves instances between
colocated and disaggregated (prefill + decode) layouts from the latency SLOs' live attainment.

Every ``interval`` seconds it looks at the requests that finished in the last ``window`` seconds
(or the last ``min_requests``, under a load too light to fill a window) and arrived once the layout
had settled, each judged by its own SLOs (a request may carry them) or the cluster's; only those of
the kind now arriving when the window also holds the kind that came before a change of workload,
which would hide the new kind's misses. A layout has settled once the work from before its change
is done and the queue that formed meanwhile has been prefilled: requests that arrive earlier wait
behind the change, not the layout. A queue that lasts a whole window past the change is the
layout's own (a load at its capacity), and the layout is judged from the change on. Until a whole
window has passed since, only memory (below) moves it. An SLO counts as missed when its attainment
is under the target by more than the window's sampling noise. TTFT missed while TPOT holds means
too little prefill: one decode instance fewer, or all colocated when one is left, if decode steps
have room for prompt chunks beside them (the TPOT quantile well within its SLO; then TTFT near its
SLO is enough, before a window misses); without that room colocating would trade TTFT misses for
TPOT ones. Colocated already and without that room, prompts wait behind decoding in mixed steps,
and half the instances prefill alone (unless the forecast below ranks colocation above for the load
arriving: steps cut to the TPOT SLO run near it by design). TPOT missed while TTFT holds means
prefill interferes with decoding, or too little decode: from colocated to half prefill, half
decode, else one decode instance more. Both met: no change. Both missed (an overload, or the wrong
layout for the load): the other of colocated and disaggregated is tried.

The controller remembers how the requests each layout served did (how many met both SLOs) under the
load they came in: the typical ratio of prompt to requested output tokens, of TPOT to TTFT SLO, and
the request rate, all known when a request arrives; a layout left before it settled (a load at its
capacity keeps a queue) by the requests that arrived since the change to it. A change to a layout
whose requests did no better under a similar load within ``memory`` seconds than the current
layout's (in the window, or as remembered) is not made, so a layout that is worse for this load is
left after one try and not tried again for a window's dip, and an overload in which both miss does
not flap. Nor does a window's miss move it from a layout whose requests met the target under a
similar load at this rate or above as remembered: under bursty arrivals misses come in runs, and
one window of them is a dip; what a lower rate met says nothing of a rising one.

Finished requests tell late: a request is judged only once it has all its tokens, and a window of
them must fill after a change. So a window also counts the requests in flight whose TTFT is known
(their first token came, or they have queued past their TTFT SLO: a miss whatever comes), and the
controller also looks at the load arriving now (the mix of the last ``arrival_window`` seconds of
arrivals, or of the last ``mix_arrivals``): when the current layout's requests fell short of the
target under a load like it (or, none recorded at a rate like it, under a lighter one) and another
layout's did clearly better under one at this rate or above (or the current layout served none
like it, and another surely met the target), it moves there at once. It looks on every arrival
that moves the mix, not only every ``interval``: a workload that switches between kinds of
requests is then followed on the few arrivals after each switch, once each kind has been seen (and
is still remembered). A layout just moved to is judged there by what it did before the change
until a whole window has passed since it settled: its first requests wait behind the backlog of
the layout before.

A kind of request that memory says nothing of (the first of a workload, or one not seen within
``memory``) would wait a window for its misses. On the arrivals that bring it, the controller asks
a forecast (``layout_forecast``) how colocated and disaggregated would serve it, from the step
times the instances measure and the SLOs the requests carry, and moves to the other of the two
when the forecast says the current one misses (or nearly) and the other does better, once for each
kind that arrives, unless memory says otherwise (the current layout met this load or a heavier
one, or the other did no better under a similar load). Windows then judge as before.

Against flapping besides: a proposal from a window's attainment must come ``patience`` times in a
row (one from memory rests on every request remembered, and needs none), and a change waits
``min_dwell`` seconds after the previous one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import fmean
from typing import TYPE_CHECKING, Literal

from distserve.cluster.layout_forecast import ChunkedPrefill, Demand, forecast
from distserve.cluster.role_control.config import RoleControlConfig
from distserve.core.role import Role
from distserve.core.slo import RequestSLO
from distserve.scheduling.step_time import StepCost

if TYPE_CHECKING:
    from distserve.cluster.orchestrator import Orchestrator
    from distserve.cluster.routing import InstanceState

logger = logging.getLogger(__name__)

LOAD_SIMILARITY = 1.5  # loads whose token ratios and rates are within this factor count as the same
# A prompt chunk lengthens the decode step it joins: decoding has room for prompts beside it while
# the target share of requests' TPOT is within this fraction of the SLO. Prefill short of capacity
# (TTFT missed or near its SLO) is then met by colocating; without that room colocation trades TTFT
# misses for TPOT ones, and prompts in mixed steps are better served apart.
DECODE_ROOM = 0.6
NEAR_SLO = 0.9  # a quantile this close to its SLO is pressure on it, before a window misses
# A rate, and what a layout did under it, is said by no fewer arrivals or requests than this.
MIX_ARRIVALS = 3


@dataclass
class Arrival:
    arrival: float  # wall-clock time
    prompt_len: int
    max_tokens: int  # the output it asks for: known on arrival, unlike the output's length
    slo: RequestSLO = RequestSLO()


@dataclass
class InFlight:
    """A request in flight as the controller sees it, before it finishes."""

    request: Arrival
    first_token: float | None = None  # wall-clock times of its first and latest tokens: None, none yet
    last_token: float | None = None


@dataclass
class FinishedRequest(Arrival):
    finished: float = 0.0  # wall-clock time of its last token
    ttft: float = 0.0
    tpot: float | None = None  # None: a single token


@dataclass
class Attainment:
    ttft: float  # share of requests within the TTFT SLO
    tpot: float  # of requests with more than one token, within the TPOT SLO
    both: float  # share within both
    num_requests: int
    # The target quantile of each latency as a fraction of its SLO (1 or more: under the target):
    # how close to its SLO each phase runs, which attainment alone does not say while it is met.
    ttft_level: float
    tpot_level: float
    num_decoded: int  # requests whose TPOT is known (more than one token, finished)


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


@dataclass(frozen=True)
class Outcome:
    """Requests that finished under one layout and load: how many met both of their SLOs."""

    layout: tuple[Role, ...]
    load: Load
    met: int
    num_requests: int
    when: float


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


def miss_margin(target: float, num_requests: int) -> float:
    """How far under the target a share of ``num_requests`` must be to count as missed: one-sided
    95% for a binomial share, so that a window's noise alone rarely moves an instance."""
    return 1.645 * math.sqrt(target * (1 - target) / num_requests)


def propose(
    layout: dict[str, Role], seen: Attainment, target: float, disaggregated_better: bool | None = None
) -> tuple[dict[str, Role], str] | None:
    """The roles to move to (with why), or None to stay. ``layout``: each healthy instance's role,
    most loaded first (the instances that become decode keep the requests they decode).
    ``disaggregated_better``: whether a forecast for the load (``layout_forecast``) says the
    disaggregated layout would serve it better than all colocated; None: no forecast."""
    names = list(layout)
    decode = [n for n in names if layout[n] is Role.DECODE]
    # Each SLO's noise is of the requests it judges: a window's requests in flight have a TTFT only.
    missing_ttft = seen.ttft < target - miss_margin(target, seen.num_requests)
    missing_tpot = seen.num_decoded > 0 and seen.tpot < target - miss_margin(target, seen.num_decoded)
    decode_has_room = seen.tpot_level <= DECODE_ROOM
    # With room in decode steps, prefill near its SLO is worth more capacity before a window misses.
    short_of_prefill = missing_ttft or (decode_has_room and seen.ttft_level >= NEAR_SLO)
    if not short_of_prefill and not missing_tpot:
        return None
    why = (
        f"TTFT attainment {seen.ttft:.0%}, TPOT {seen.tpot:.0%} over {seen.num_requests} requests "
        f"(quantiles at {seen.ttft_level:.0%} and {seen.tpot_level:.0%} of the SLOs)"
    )
    if missing_ttft and missing_tpot:  # the other layout may do better: try it
        if decode:
            return {n: Role.COLOCATED for n in names}, f"{why}: both missed, trying colocated"
        return _disaggregated(names), f"{why}: both missed, trying disaggregated"
    if short_of_prefill and len(decode) == 1 and decode_has_room:
        return {n: Role.COLOCATED for n in names}, f"{why}: too little prefill, colocating"
    if missing_ttft and len(decode) > 1:
        return {**layout, decode[-1]: Role.PREFILL}, f"{why}: too little prefill, one decode instance fewer"
    colocated = _all_colocated(layout)
    # Whether half the instances prefilling alone beats all of them prefilling beside decoding turns
    # on decoding's share of the steps, which a TPOT near its SLO only hints at: steps cut to fit
    # the TPOT SLO (tpot_aware_chunking) run near it by design. A forecast, where there is one, says.
    if missing_ttft and not missing_tpot and colocated and not decode_has_room and disaggregated_better is not False:
        return _disaggregated(names), f"{why}: prompts wait behind decoding, disaggregating"
    if missing_tpot and not decode and len(names) > 1:
        return _disaggregated(names), f"{why}: prefill interferes with decoding, disaggregating"
    prefill = [n for n in names if layout[n] is Role.PREFILL]
    if missing_tpot and len(prefill) > 1:
        return {**layout, prefill[-1]: Role.DECODE}, f"{why}: too little decode, one decode instance more"
    return None


def _all_colocated(layout: dict[str, Role]) -> bool:
    """More than one instance, every one colocated: the layout the controller disaggregates."""
    return len(layout) > 1 and all(r is Role.COLOCATED for r in layout.values())


def _disaggregated(names: list[str]) -> dict[str, Role]:
    """Half decode (the first, busiest, keep decoding what they hold), half prefill."""
    num_decode = len(names) // 2
    return {n: Role.DECODE if i < num_decode else Role.PREFILL for i, n in enumerate(names)}


def _layout_key(roles: dict[str, Role]) -> tuple[Role, ...]:
    return tuple(sorted(roles.values()))


def _roles_for(key: tuple[Role, ...], names: list[str]) -> dict[str, Role]:
    """A layout's roles given to ``names`` (most loaded first): decode roles first, so that the
    instances that decode most keep what they decode, then colocated, then prefill."""
    order = {Role.DECODE: 0, Role.COLOCATED: 1, Role.PREFILL: 2}
    return dict(zip(names, sorted(key, key=order.__getitem__)))


class RoleController:
    def __init__(self, orchestrator: Orchestrator, config: RoleControlConfig) -> None:
        self.orchestrator = orchestrator
        self.config = config
        self.arrivals: deque[Arrival] = deque()
        self.finished: deque[FinishedRequest] = deque()
        self.outcomes: deque[Outcome] = deque()
        self.last_change = 0.0
        # Requests that arrived before the previous layout's work was done, and the queue that
        # formed meanwhile prefilled, waited behind the change: only those after count for the layout.
        self.settled_at: float | None = None
        self._previous_done_at: float | None = None
        self._recorded_until = 0.0
        self._proposal: dict[str, Role] | None = None
        self._repeats = 0
        # What the last window proposal judged, and those of them not remembered yet.
        self._judged: tuple[list[FinishedRequest], list[FinishedRequest]] = ([], [])
        self._arrived: asyncio.Event | None = None  # set by an arrival while ``run`` waits
        self._mix_looked_at: Load | None = None  # the arriving mix at the last look
        self._forecast_mix: Load | None = None  # the arriving mix at the last forecast
        # Each judgement that proposed a change or kept the layout, by why: what an operator reads
        # to tell a controller held by its memory from one that saw nothing to change.
        self.verdicts: Counter[str] = Counter()
        self.resume(time.time())  # counts from start-up: the first window fills first

    @property
    def cluster_slo(self) -> RequestSLO:
        """The SLOs of a request that carries none of its own."""
        return RequestSLO(self.config.slo_ttft, self.config.slo_tpot)

    def remember(self, layout: dict[str, Role], load: Load, met: int, num_requests: int, now: float) -> None:
        self.outcomes.append(Outcome(_layout_key(layout), load, met, num_requests, now))

    def remembered(
        self,
        layout: tuple[Role, ...],
        load: Load,
        now: float,
        rates: Literal["similar", "heavier", "lighter"] = "similar",
        before: float = math.inf,
    ) -> Share | None:
        """How the requests that ``layout`` served under loads similar to ``load`` did, within memory;
        ``rates="heavier"``: under loads of its mix at ``load``'s rate or above, to within that
        rate's measurement (``Load.lowest_rate``), however far above (what held a heavier load
        holds this one); ``"lighter"``: at its rate or below, to within ``Load.highest_rate``
        (what fell short under a lighter load falls short under this one); only as recorded by
        ``before``."""
        while self.outcomes and now - self.outcomes[0].when >= self.config.memory:
            self.outcomes.popleft()

        def like(recorded: Load) -> bool:
            if rates == "heavier":
                return recorded.similar_mix(load) and recorded.rate >= load.lowest_rate
            if rates == "lighter":
                return recorded.similar_mix(load) and recorded.rate <= load.highest_rate
            return recorded.similar(load)

        alike = [o for o in self.outcomes if o.layout == layout and like(o.load) and o.when <= before]
        if sum(o.num_requests for o in alike) < self.config.min_requests:
            return None
        return Share(sum(o.met for o in alike), sum(o.num_requests for o in alike))

    def consider(
        self,
        layout: dict[str, Role],
        seen: Attainment,
        load: Load,
        now: float,
        disaggregated_better: bool | None = None,
    ) -> tuple[dict[str, Role], str] | None:
        """The roles to move to (with why) after ``layout`` did ``seen`` under ``load``, or None: none
        is proposed; or this layout's requests met the target under a similar load as remembered,
        so the window is a dip, not this layout failing the load (under bursty arrivals misses
        come in runs, and a window of them is not the layout's share), counting only loads at this
        rate or above; or the proposed layout did no better under a similar load lately than this
        one, in this window or as remembered. ``disaggregated_better``: as ``propose``."""
        proposal = propose(layout, seen, self.config.target, disaggregated_better)
        if proposal is None:
            return None
        # Met under this load or a heavier one: a rising rate is not held by what a lower one met.
        held = self.remembered(_layout_key(layout), load, now, rates="heavier")
        if held and held.value >= self.config.target:
            self.verdicts["held by memory"] += 1
            return None
        current = self.remembered(_layout_key(layout), load, now)
        known = self.remembered(_layout_key(proposal[0]), load, now)
        if known and known.value <= max(seen.both, current.value if current else 0.0):
            self.verdicts["proposed layout did no better"] += 1
            return None
        self.verdicts["proposed"] += 1
        return proposal

    def recall(
        self, layout: dict[str, Role], arriving: Load, now: float, before: float = math.inf
    ) -> tuple[dict[str, Role], str] | None:
        """The layout whose requests did best under loads like ``arriving`` (with why), at
        ``arriving``'s rate or above, when the current layout's fell short of the target under
        them (as recorded by ``before``) and the other's did clearly better; or when the current
        layout has served no load like it and the other surely met the target (a layout known to
        hold the load is worth more than one not tried under it); else None. What another layout
        met at a lower rate says nothing of this one."""
        current = self.remembered(_layout_key(layout), arriving, now, before=before)
        if current is None:  # none at a similar rate (a short window's rate is noisy): a shortfall at a lower one
            lower = self.remembered(_layout_key(layout), arriving, now, rates="lighter", before=before)
            current = lower if lower and lower.value < self.config.target else None
        if current is not None and current.value >= self.config.target:
            return None
        others = {o.layout for o in self.outcomes if o.layout != _layout_key(layout) and len(o.layout) == len(layout)}
        known = [(key, share) for key in others if (share := self.remembered(key, arriving, now, rates="heavier"))]
        if not known:
            return None
        key, best = max(known, key=lambda ks: ks[1].value)
        if not (best.clearly_above(current) if current else best.surely_at_least(self.config.target)):
            return None
        other = "+".join(r.name.lower() for r in key)
        seen = (
            f"{current.value:.0%} of {current.num_requests} requests met both SLOs in this layout"
            if current
            else "none served in this layout"
        )
        why = f"arriving load like one under which {seen} and {best.value:.0%} of {best.num_requests} in {other}"
        return _roles_for(key, list(layout)), why

    def observe_arrival(self, request: Arrival) -> None:
        if self.config.mode == "adaptive":
            self.arrivals.append(request)
            if self._arrived is not None:
                self._arrived.set()

    def observe(self, request: FinishedRequest) -> None:
        if self.config.mode == "adaptive":
            self.finished.append(request)

    async def run(self) -> None:
        """Decide every ``interval`` while the mode is adaptive, and on arrivals in between (from
        memory only). An operator may take roles back ("fixed") and hand them over again: the
        controller then starts afresh, memory kept."""
        deciding = self.config.mode == "adaptive"  # from start-up, as constructed
        loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        next_tick = loop.time() + self.config.interval
        while True:
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=max(0.0, next_tick - loop.time()))
            except asyncio.TimeoutError:  # the tick (TimeoutError itself from Python 3.11)
                pass
            self._arrived.clear()
            tick = loop.time() >= next_tick
            if tick:
                next_tick = loop.time() + self.config.interval
            if self.config.mode != "adaptive":
                deciding = False
                continue
            try:
                if not deciding:
                    self.resume(time.time())
                    deciding = True
                else:
                    await self.decide(tick)
            except Exception:  # a bug here must not stop serving
                logger.exception("role controller")

    def resume(self, now: float) -> None:
        """Decide from ``now`` on as if started then: what it observed before is dropped (not what
        it remembers), and a window of requests fills before one is judged."""
        self.arrivals.clear()
        self.finished.clear()
        self.last_change = self.settled_at = self._previous_done_at = self._recorded_until = now
        self._proposal, self._repeats = None, 0

    def layout_changed(self, now: float) -> None:
        """Roles changed (by the controller or an operator): the next change waits ``min_dwell``, and
        the requests of the new layout count once it has settled."""
        self.last_change, self.settled_at, self._previous_done_at = now, None, None

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

    def settle(self, in_flight: list[InFlight], now: float) -> None:
        """The layout has settled once no request that arrived before the last change is in flight,
        and then none that arrived before that moment still waits for its first token (the queue
        that formed during the change). One that has not a whole window after its change counts as
        settled at the change: a queue that outlasts the change's transient is this layout's under
        this load (a load at its capacity), and waiting for it to drain would leave every window
        empty while it grows - under a backlog, for as long as the phase that needs another layout."""
        if now - self.last_change >= self.config.window:
            self.settled_at = self.last_change
            return
        if self._previous_done_at is None and all(r.request.arrival >= self.last_change for r in in_flight):
            self._previous_done_at = now
        done = self._previous_done_at
        if done is not None and all(r.first_token is not None or r.request.arrival >= done for r in in_flight):
            self.settled_at = self._recorded_until = now

    def record(self, layout: dict[str, Role], window: list[FinishedRequest], now: float) -> None:
        """Remember how the requests that finished since the last record did in ``layout``: each
        kind of them under its own mix (the window's still holds the kind of requests that came
        before, while a workload changes, and a record may span the change) at the rate of
        ``window``. Until the window holds enough requests to say its rate they wait, not lost."""
        new = [r for r in window if r.finished > self._recorded_until]
        if not new or len(window) < self.config.min_requests:
            return
        self._recorded_until = now
        self._remember_kinds(layout, new, Load.of(window), now)

    def record_judged(self, layout: dict[str, Role], now: float) -> None:
        """Remember what the window proposal about to be carried out judged, those of its requests
        not recorded yet (the ones in flight among them too): the evidence that ``layout`` fell
        short under this load. A layout is left before a window of its settled requests finishes,
        as a workload that moves every half a minute leaves it, so without this what it did under
        the load it was left for is never remembered, and the next time that load comes the layout
        is kept until a window shows its misses again."""
        judged, new = self._judged
        if new:
            self._recorded_until = now
            self._remember_kinds(layout, new, Load.of(judged), now)

    def record_left(self, layout: dict[str, Role], now: float) -> None:
        """Remember, as ``layout`` is left (by the controller or an operator), what it served and was
        not remembered yet: the requests that finished in the last window (or the last
        ``min_requests``) and arrived once it had settled, or since the change to it if it never
        did. A load at a layout's capacity keeps a queue, so the layout may not settle before a
        workload that moves every half minute moves on, and its requests never fill a window:
        without this, what it did under that load is never remembered, and when the load comes back
        memory cannot move to it. Requests that arrived before it settled waited behind the change
        as well: they count for what moving to this layout gives, which is what moving to it again
        will."""
        since = self.settled_at if self.settled_at is not None else self.last_change
        new = [r for r in self.finished if r.arrival >= since and r.finished > self._recorded_until]
        if len(new) >= MIX_ARRIVALS:  # a few say the rate, roughly; one or two say none
            self._recorded_until = now
            self._remember_kinds(layout, new, Load.of(new), now)

    def _remember_kinds(self, layout: dict[str, Role], new: list[FinishedRequest], rate: Load, now: float) -> None:
        for kind in kinds(new, self.cluster_slo):
            met = round(attainment(kind, self.config.slo_ttft, self.config.slo_tpot).both * len(kind))
            self.remember(layout, Load.of(kind, self.cluster_slo).at_rate_of(rate), met, len(kind), now)

    def propose_now(
        self,
        layout: dict[str, Role],
        window: list[FinishedRequest],
        now: float,
        tick: bool = True,
        started: Iterable[FinishedRequest] = (),
        forecast_from: tuple[StepCost, ChunkedPrefill] | None = None,
    ) -> tuple[dict[str, Role], str, bool] | None:
        """A change for the load arriving now, from memory, else from a forecast by ``forecast_from``
        (``forecast_change``) when one is due; else, on a ``tick``, one from the attainment of the
        requests in ``window`` and of those ``started`` (in flight, their TTFT known:
        ``known_in_flight``), the forecast's ranking of the layouts beside it. The flag: whether it
        is from memory or a forecast, which need no patience (they rest on every request remembered,
        or on the instances' step times, not on one window)."""
        arriving = self.arriving(now)
        # A layout's first requests after a change wait behind the backlog of the one before, an
        # overload's most of all: until a whole window has passed since it settled, the current
        # layout is judged by what it did before the change, not by them.
        fresh = self.settled_at is None or now - self.settled_at < self.config.window
        if arriving and (recalled := self.recall(layout, arriving, now, self.last_change if fresh else math.inf)):
            self.verdicts["recalled"] += 1
            return *recalled, True
        due = forecast_from and self.forecast_due(now)
        if arriving and due and (forecast := self.forecast_change(layout, arriving, now, *forecast_from)):
            self.verdicts["forecast"] += 1
            return *forecast, True
        if not tick or fresh:
            return None  # between ticks, or not yet a whole window since the layout settled
        started = list(started)
        judged = self.of_arriving_kind(window + started, arriving)
        if len(judged) < self.config.min_requests:
            return None
        seen = attainment(judged, self.config.slo_ttft, self.config.slo_tpot, self.config.target)
        better = self.disaggregated_better(layout, arriving, now, forecast_from)
        proposal = self.consider(layout, seen, Load.of(judged, self.cluster_slo), now, better)
        self._judged = ([], [])
        if proposal:
            in_flight = {id(r) for r in started}  # never remembered: they have not finished
            self._judged = (judged, [r for r in judged if id(r) in in_flight or r.finished > self._recorded_until])
        return (*proposal, False) if proposal else None

    def forecast_due(self, now: float) -> bool:
        """Whether to forecast: on, and the arriving mix is of one kind of request, not the kind last
        forecast for: the first arrivals, or a workload that changed. While it changes, the last
        few arrivals blend two kinds, like neither: a mix is of one kind while each of its requests
        is within ``LOAD_SIMILARITY`` squared of it (the lengths of one kind spread about its
        typical request by less)."""
        arriving = self.arriving(now) if self.config.forecast else None
        if arriving is None or (self._forecast_mix and arriving.similar_mix(self._forecast_mix)):
            return False
        mix = self.arriving_mix(now)
        return all(Load.of([a], self.cluster_slo).similar_mix(arriving, LOAD_SIMILARITY**2) for a in mix)

    def forecast_change(
        self, layout: dict[str, Role], arriving: Load, now: float, cost: StepCost, chunking: ChunkedPrefill
    ) -> tuple[dict[str, Role], str] | None:
        """The other of colocated and disaggregated (with why) when the forecast for the requests
        arriving says the current layout misses their SLOs (near them: ``NEAR_SLO``) and the other
        does better, unless memory says otherwise: the current layout met this load or a heavier one,
        or the other did no better than it under a similar load. Once for each kind of request that
        arrives: then windows judge the layout, and one that shows the forecast wrong wins."""
        self._forecast_mix = arriving
        names = list(layout)
        colocated = _all_colocated(layout)
        if len(names) < 2 or not (colocated or _layout_key(layout) == _layout_key(_disaggregated(names))):
            return None  # one instance, or a layout of other proportions: windows judge
        demand = self.demand(now, arriving)
        here = forecast(colocated, len(names), demand, cost, chunking)
        there = forecast(not colocated, len(names), demand, cost, chunking)
        if here.share < NEAR_SLO or there >= here:
            return None
        other = _disaggregated(names) if colocated else {n: Role.COLOCATED for n in names}
        held = self.remembered(_layout_key(layout), arriving, now, rates="heavier")
        current = self.remembered(_layout_key(layout), arriving, now)
        known = self.remembered(_layout_key(other), arriving, now)
        if (held and held.value >= self.config.target) or (known and known.value <= (current.value if current else 0)):
            self.verdicts["forecast overruled by memory"] += 1
            return None
        why = (
            f"arriving requests ({demand.prompt_len:.0f} prompt tokens, SLOs {demand.slo_ttft:.3g} s and "
            f"{demand.slo_tpot * 1000:.3g} ms, up to {demand.rate:.2f} req/s) forecast {here} in this layout and "
            f"{there} {'disaggregated' if colocated else 'colocated'}"
        )
        return other, why

    def disaggregated_better(
        self,
        layout: dict[str, Role],
        arriving: Load | None,
        now: float,
        forecast_from: tuple[StepCost, ChunkedPrefill] | None,
    ) -> bool | None:
        """Whether the forecast for the arriving load ranks the disaggregated layout above all
        colocated; None without a forecast (no step times, no arrivals) or from other layouts."""
        if not (_all_colocated(layout) and arriving and forecast_from):
            return None
        demand, num = self.demand(now, arriving), len(layout)
        return forecast(False, num, demand, *forecast_from) < forecast(True, num, demand, *forecast_from)

    def demand(self, now: float, arriving: Load) -> Demand:
        """What the arriving mix asks, each request by its own SLOs or the cluster's, at the highest
        rate its arrivals are consistent with (``Load.highest_rate``): after a change of workload
        the rate comes from a few arrivals (four say it to within 80%), and a layout is chosen for
        the load that may be coming, not only the most likely one."""
        mix, cluster = self.arriving_mix(now), self.cluster_slo
        return Demand(
            rate=arriving.highest_rate,
            prompt_len=fmean(a.prompt_len for a in mix),
            output_len=fmean(a.max_tokens for a in mix),
            slo_ttft=fmean(a.slo.ttft or cluster.ttft for a in mix),
            slo_tpot=fmean(a.slo.tpot or cluster.tpot for a in mix),
        )

    async def forecast_inputs(self, live: list[InstanceState]) -> tuple[StepCost, ChunkedPrefill] | None:
        """The instances' step cost (the mean of the lines they know, with a fixed cost) and how a
        colocated one forms its steps; None while none knows one, or when colocated instances run
        whole prefills (prefill-first colocation is not forecast)."""
        config = live[0].config if live else None
        if config is None or not config.scheduler.enable_chunked_prefill:
            return None
        lines = await asyncio.gather(*(s.handle.step_line.remote() for s in live), return_exceptions=True)
        # A line with no fixed cost had its intercept clamped: its steps (a prefill instance's whole
        # prompts) were too alike in size to say what a small step costs, which decoding is made of.
        lines = [line for line in lines if isinstance(line, StepCost) and line.fixed > 0]
        if not lines:
            return None
        cost = StepCost(*map(fmean, zip(*lines)))
        scheduler = config.scheduler
        chunking = ChunkedPrefill(
            scheduler.max_num_batched_tokens, config.cache.block_size, scheduler.tpot_aware_chunking
        )
        return cost, chunking

    def of_arriving_kind(self, window: list[FinishedRequest], arriving: Load | None) -> list[FinishedRequest]:
        """The requests of ``window`` that a layout is judged by now: those of the kind arriving, when
        the window also holds others (a workload that changed: the kind that came before, met or
        not, says nothing of how this layout serves what comes now, and a few of it among the new
        kind's misses hide them), else all (one kind, or a blend of kinds arriving together)."""
        if arriving is None:
            return window
        groups = kinds(window, self.cluster_slo)
        alike = [group for group in groups if Load.of(group, self.cluster_slo).similar_mix(arriving)]
        return alike[0] if len(groups) > 1 and alike else window

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

    def mix_moved(self, now: float) -> bool:
        """Whether the arriving mix has moved since the last look (a steady load has been looked at)."""
        arriving = self.arriving(now)
        moved = arriving is not None and not (self._mix_looked_at and arriving.similar(self._mix_looked_at))
        self._mix_looked_at = arriving or self._mix_looked_at
        return moved

    async def decide(self, tick: bool = True) -> None:
        """Record what finished and change roles if a change is due; ``tick``: False on an arrival
        between ticks, when only a change from memory is, and only if the arriving mix moved: a
        steady load's arrivals return at once, with no settling or recording on their path."""
        config, now = self.config, time.time()
        if not self.mix_moved(now) and not tick:
            return
        orchestrator = self.orchestrator
        live = sorted((s for s in orchestrator.instances if s.failure is None), key=lambda s: -s.load_tokens)
        layout = {s.name: s.role for s in live}
        in_flight = orchestrator.in_flight()
        if self.settled_at is None:
            self.settle(in_flight, now)
        window = self.window(now)
        self.record(layout, window, now)
        if now - self.last_change < config.min_dwell:
            return
        # Step times for a forecast that is due, and on a tick for ranking a colocated layout's way out.
        ranking = tick and config.forecast and _all_colocated(layout)
        forecast_from = await self.forecast_inputs(live) if ranking or self.forecast_due(now) else None
        proposal = self.propose_now(layout, window, now, tick, self.known_in_flight(in_flight, now), forecast_from)
        if not tick and proposal is None:
            return  # a window's proposal needs its ticks in a row: an arrival between them is not one
        if proposal is None or proposal[0] != self._proposal:
            self._proposal, self._repeats = (proposal[0] if proposal else None), 1
        else:
            self._repeats += 1
        if proposal is None or (self._repeats < config.patience and not proposal[2]):
            return
        roles, reason, from_memory = proposal
        self._proposal, self._repeats = None, 0
        if not from_memory:
            self.record_judged(layout, now)
        await orchestrator.roles.set_roles(roles, reason)  # which remembers what the layout served
