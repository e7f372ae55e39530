"""Roles that follow the load: a controller in the orchestrator that moves instances between
colocated and disaggregated (prefill + decode) layouts from the latency SLOs' live attainment.

Every ``interval`` seconds it looks at the requests that finished in the last ``window`` seconds
and arrived after the last role change had taken effect, each judged by its own SLOs (a request
may carry them) or the cluster's. An SLO counts as missed when its attainment is under the target
by more than the window's sampling noise. TTFT missed while TPOT holds means too little prefill:
one decode instance fewer, or all colocated when one is left. TPOT missed while
TTFT holds means prefill interferes with decoding, or too little decode: from colocated to half
prefill, half decode, else one decode instance more. Both met: no change. Both missed (an
overload, or the wrong layout for the load): the other of colocated and disaggregated is tried.

The controller remembers how each layout did (the share of requests meeting both SLOs) under the
load it saw: the ratio of prompt to output tokens and the request rate. A change to a layout that
did no better under a similar load within ``memory`` seconds is not made, so a layout that is
worse for this load is left after one try, and an overload in which both miss does not flap.
Against flapping besides: a proposal must come ``patience`` times in a row, and a change waits
``min_dwell`` seconds after the previous one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distserve.core.role import Role

if TYPE_CHECKING:
    from distserve.cluster.orchestrator import Orchestrator

logger = logging.getLogger(__name__)

ROLE_CONTROL_MODES = ("fixed", "adaptive")
LOAD_SIMILARITY = 1.5  # loads whose token ratios and rates are within this factor count as the same


@dataclass
class RoleControlConfig:
    mode: str = "fixed"  # "fixed": roles change only when an operator sets them; "adaptive": the controller too
    slo_ttft: float | None = None  # seconds; adaptive needs both SLOs
    slo_tpot: float | None = None
    target: float = 0.9  # the share of requests each SLO must hold for
    interval: float = 2.0  # seconds between decisions
    window: float = 10.0  # seconds of finished requests a decision looks at
    min_requests: int = 8  # fewer finished requests in the window: no decision
    patience: int = 2  # decisions in a row that must propose the same layout
    min_dwell: float = 10.0  # seconds after a change before the next
    memory: float = 120.0  # seconds a layout's measured attainment is trusted for a similar load

    def __post_init__(self) -> None:
        if self.mode not in ROLE_CONTROL_MODES:
            raise ValueError(f"role_control.mode must be one of {', '.join(ROLE_CONTROL_MODES)}, got '{self.mode}'")
        if self.mode == "adaptive" and not (self.slo_ttft and self.slo_tpot):
            raise ValueError("adaptive role control needs both SLOs: role_control.slo_ttft and slo_tpot (seconds)")
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"role_control.{name} must be > 0 seconds, got {value}")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"role_control.target must be in (0, 1], got {self.target}")
        for name in ("interval", "window"):
            if not getattr(self, name) > 0:
                raise ValueError(f"role_control.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.min_requests < 1 or self.patience < 1 or self.min_dwell < 0:
            raise ValueError("role_control.min_requests and patience must be >= 1 and min_dwell >= 0")


@dataclass(frozen=True)
class RequestSLO:
    """A request's own latency objectives, in seconds; None: the cluster's."""

    ttft: float | None = None
    tpot: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"slo_{name} must be > 0 seconds, got {value}")


@dataclass
class FinishedRequest:
    arrival: float  # wall-clock times
    finished: float
    ttft: float
    tpot: float | None  # None: a single token
    prompt_len: int
    output_len: int
    slo: RequestSLO = RequestSLO()


@dataclass
class Attainment:
    ttft: float  # share of requests within the TTFT SLO
    tpot: float  # of requests with more than one token, within the TPOT SLO
    both: float  # share within both
    num_requests: int


def attainment(requests: list[FinishedRequest], slo_ttft: float, slo_tpot: float) -> Attainment:
    """Each request judged by its own SLOs, else by ``slo_ttft`` and ``slo_tpot``."""
    ttft_met = [r.ttft <= (r.slo.ttft or slo_ttft) for r in requests]
    tpot_met = [r.tpot is None or r.tpot <= (r.slo.tpot or slo_tpot) for r in requests]
    decoded = sum(r.tpot is not None for r in requests)
    tpot = sum(m for m, r in zip(tpot_met, requests) if r.tpot is not None) / decoded if decoded else 1.0
    both = sum(a and b for a, b in zip(ttft_met, tpot_met)) / len(requests)
    return Attainment(sum(ttft_met) / len(requests), tpot, both, len(requests))


@dataclass(frozen=True)
class Load:
    """What a window of requests asked of the cluster."""

    tokens_ratio: float  # prompt tokens per output token: how prefill-heavy
    rate: float  # requests per second

    @classmethod
    def of(cls, requests: list[FinishedRequest]) -> Load:
        span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
        ratio = sum(r.prompt_len for r in requests) / max(1, sum(r.output_len for r in requests))
        return cls(ratio, (len(requests) - 1) / span if span > 0 else math.inf)

    def similar(self, other: Load, factor: float = LOAD_SIMILARITY) -> bool:
        return all(
            max(a, b) <= factor * min(a, b)
            for a, b in ((self.tokens_ratio, other.tokens_ratio), (self.rate, other.rate))
        )


@dataclass(frozen=True)
class Measurement:
    both: float  # share of requests meeting both SLOs
    load: Load
    when: float


def miss_margin(target: float, num_requests: int) -> float:
    """How far under the target a share of ``num_requests`` must be to count as missed: one-sided
    95% for a binomial share, so that a window's noise alone rarely moves an instance."""
    return 1.645 * math.sqrt(target * (1 - target) / num_requests)


def propose(layout: dict[str, Role], seen: Attainment, target: float) -> tuple[dict[str, Role], str] | None:
    """The roles to move to (with why), or None to stay. ``layout``: each healthy instance's role,
    most loaded first (the instances that become decode keep the requests they decode)."""
    names = list(layout)
    decode = [n for n in names if layout[n] is Role.DECODE]
    clear = target - miss_margin(target, seen.num_requests)
    missing_ttft, missing_tpot = seen.ttft < clear, seen.tpot < clear
    if not missing_ttft and not missing_tpot:
        return None
    why = f"TTFT attainment {seen.ttft:.0%}, TPOT {seen.tpot:.0%} over {seen.num_requests} requests"
    if missing_ttft and missing_tpot:  # the other layout may do better: try it
        if decode:
            return {n: Role.COLOCATED for n in names}, f"{why}: both missed, trying colocated"
        return _disaggregated(names), f"{why}: both missed, trying disaggregated"
    if missing_ttft and len(decode) == 1:
        return {n: Role.COLOCATED for n in names}, f"{why}: too little prefill, colocating"
    if missing_ttft and decode:
        return {**layout, decode[-1]: Role.PREFILL}, f"{why}: too little prefill, one decode instance fewer"
    if missing_tpot and not decode and len(names) > 1:
        return _disaggregated(names), f"{why}: prefill interferes with decoding, disaggregating"
    prefill = [n for n in names if layout[n] is Role.PREFILL]
    if missing_tpot and len(prefill) > 1:
        return {**layout, prefill[-1]: Role.DECODE}, f"{why}: too little decode, one decode instance more"
    return None


def _disaggregated(names: list[str]) -> dict[str, Role]:
    """Half decode (the first, busiest, keep decoding what they hold), half prefill."""
    num_decode = len(names) // 2
    return {n: Role.DECODE if i < num_decode else Role.PREFILL for i, n in enumerate(names)}


def _layout_key(roles: dict[str, Role]) -> tuple[Role, ...]:
    return tuple(sorted(roles.values()))


class RoleController:
    def __init__(self, orchestrator: Orchestrator, config: RoleControlConfig) -> None:
        self.orchestrator = orchestrator
        self.config = config
        self.finished: deque[FinishedRequest] = deque(maxlen=100_000)
        self.last_change = time.time()  # counts from start-up: the first window fills first
        self._proposal: dict[str, Role] | None = None
        self._repeats = 0
        self.measured: dict[tuple[Role, ...], Measurement] = {}  # the latest of each layout

    def consider(
        self, layout: dict[str, Role], seen: Attainment, load: Load, now: float
    ) -> tuple[dict[str, Role], str] | None:
        """Record how ``layout`` did under ``load``; the roles to move to (with why), or None: none
        is proposed, or the proposed layout did no better under a similar load lately."""
        self.measured[_layout_key(layout)] = Measurement(seen.both, load, now)
        proposal = propose(layout, seen, self.config.target)
        if proposal is None:
            return None
        known = self.measured.get(_layout_key(proposal[0]))
        if known and now - known.when < self.config.memory and known.load.similar(load) and known.both <= seen.both:
            return None
        return proposal

    def observe(self, request: FinishedRequest) -> None:
        self.finished.append(request)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.decide()
            except Exception:  # a bug here must not stop serving
                logger.exception("role controller")

    async def decide(self) -> None:
        config, now = self.config, time.time()
        if now - self.last_change < config.min_dwell:
            return
        since = max(now - config.window, self.last_change)
        window = [r for r in self.finished if r.finished >= since and r.arrival >= self.last_change]
        if len(window) < config.min_requests:
            return
        seen, load = attainment(window, config.slo_ttft, config.slo_tpot), Load.of(window)
        orchestrator = self.orchestrator
        live = sorted((s for s in orchestrator.instances if s.failure is None), key=lambda s: -s.load_tokens)
        proposal = self.consider({s.name: s.role for s in live}, seen, load, now)
        if proposal is None or proposal[0] != self._proposal:
            self._proposal, self._repeats = (proposal[0] if proposal else None), 1
        else:
            self._repeats += 1
        if proposal is None or self._repeats < config.patience:
            return
        roles, reason = proposal
        self._proposal, self._repeats = None, 0
        records = await orchestrator.roles.set_roles(roles, reason)
        if records:
            self.last_change = time.time()
