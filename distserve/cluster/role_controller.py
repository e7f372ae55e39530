"""Roles that follow the load: a controller in the orchestrator that moves instances between
colocated and disaggregated (prefill + decode) layouts from the latency SLOs' live attainment.

Every ``interval`` seconds it looks at the requests that finished in the last ``window`` seconds
and arrived after the last role change had taken effect, each judged by its own SLOs (a request
may carry them) or the cluster's. TTFT missed while TPOT holds means too
little prefill: one decode instance fewer, or all colocated when one is left. TPOT missed while
TTFT holds means prefill interferes with decoding, or too little decode: from colocated to half
prefill, half decode, else one decode instance more. Both met or both missed: no change, since
moving capacity from one phase to the other cannot fix both. Against flapping: a proposal must
come ``patience`` times in a row, and a change waits ``min_dwell`` seconds after the previous one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distserve.core.role import Role

if TYPE_CHECKING:
    from distserve.cluster.orchestrator import Orchestrator

logger = logging.getLogger(__name__)

ROLE_CONTROL_MODES = ("fixed", "adaptive")


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
    slo: RequestSLO = RequestSLO()


@dataclass
class Attainment:
    ttft: float  # share of requests within the TTFT SLO
    tpot: float  # of requests with more than one token, within the TPOT SLO
    num_requests: int


def attainment(requests: list[FinishedRequest], slo_ttft: float, slo_tpot: float) -> Attainment:
    """Each request judged by its own SLOs, else by ``slo_ttft`` and ``slo_tpot``."""
    ttft = sum(r.ttft <= (r.slo.ttft or slo_ttft) for r in requests) / len(requests)
    decoded = [r for r in requests if r.tpot is not None]
    tpot = sum(r.tpot <= (r.slo.tpot or slo_tpot) for r in decoded) / len(decoded) if decoded else 1.0
    return Attainment(ttft, tpot, len(requests))


def propose(layout: dict[str, Role], seen: Attainment, target: float) -> tuple[dict[str, Role], str] | None:
    """The roles to move to (with why), or None to stay. ``layout``: each healthy instance's role,
    most loaded first (the instances that become decode keep the requests they decode)."""
    names = list(layout)
    decode = [n for n in names if layout[n] is Role.DECODE]
    missing_ttft, missing_tpot = seen.ttft < target, seen.tpot < target
    if missing_ttft == missing_tpot:
        return None
    why = f"TTFT attainment {seen.ttft:.0%}, TPOT {seen.tpot:.0%} over {seen.num_requests} requests"
    if missing_ttft and len(decode) == 1:
        return {n: Role.COLOCATED for n in names}, f"{why}: too little prefill, colocating"
    if missing_ttft and decode:
        return {**layout, decode[-1]: Role.PREFILL}, f"{why}: too little prefill, one decode instance fewer"
    if missing_tpot and not decode and len(names) > 1:
        num_decode = len(names) // 2
        roles = {n: Role.DECODE if i < num_decode else Role.PREFILL for i, n in enumerate(names)}
        return roles, f"{why}: prefill interferes with decoding, disaggregating"
    prefill = [n for n in names if layout[n] is Role.PREFILL]
    if missing_tpot and len(prefill) > 1:
        return {**layout, prefill[-1]: Role.DECODE}, f"{why}: too little decode, one decode instance more"
    return None


class RoleController:
    def __init__(self, orchestrator: Orchestrator, config: RoleControlConfig) -> None:
        self.orchestrator = orchestrator
        self.config = config
        self.finished: deque[FinishedRequest] = deque(maxlen=100_000)
        self.last_change = time.time()  # counts from start-up: the first window fills first
        self._proposal: dict[str, Role] | None = None
        self._repeats = 0

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
        seen = attainment(window, config.slo_ttft, config.slo_tpot)
        orchestrator = self.orchestrator
        live = sorted((s for s in orchestrator.instances if s.failure is None), key=lambda s: -s.load_tokens)
        proposal = propose({s.name: s.role for s in live}, seen, config.target)
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
