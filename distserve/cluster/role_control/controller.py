"""The control loop: when the controller looks, what it proposes, and when a proposal is carried out.

Every ``interval`` seconds it judges the current layout, and on every arrival that moves the
arriving mix, not only every ``interval``: a workload that switches between kinds of requests is
then followed on the few arrivals after each switch, once each kind has been seen (and is still
remembered). A change comes from memory (``LayoutMemory.recall``), else from a forecast when one is
due (``Forecasting``), else, on a tick, from the attainment of the window (``Observations``) weighed
against memory (``policy``, ``LayoutMemory.consider``): only the requests of the kind now arriving
when the window also holds the kind that came before a change of workload, which would hide the new
kind's misses. A layout just moved to is judged there by what it did before the change until a
whole window has passed since it settled (``Settling``): its first requests wait behind the backlog
of the layout before, and until then only memory or a forecast moves it.

Against flapping besides: a proposal from a window's attainment must come ``patience`` times in a
row (one from memory rests on every request remembered, and needs none), and a change waits
``min_dwell`` seconds after the previous one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable

from distserve.cluster.layout_forecast import ChunkedPrefill
from distserve.cluster.role_control.attainment import attainment
from distserve.cluster.role_control.cluster_view import ClusterView
from distserve.cluster.role_control.config import RoleControlConfig
from distserve.cluster.role_control.forecasting import Forecasting
from distserve.cluster.role_control.layouts import all_colocated
from distserve.cluster.role_control.load import Load, kinds
from distserve.cluster.role_control.request_records import FinishedRequest
from distserve.core.role import Role
from distserve.scheduling.step_time import StepCost

logger = logging.getLogger(__name__)


class RoleController(Forecasting):
    def __init__(self, cluster: ClusterView, config: RoleControlConfig) -> None:
        super().__init__(config)
        self.cluster = cluster
        self._proposal: dict[str, Role] | None = None  # the last window proposal, and how many times in a row
        self._repeats = 0
        self.resume(time.time())  # counts from start-up: the first window fills first

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

    async def decide(self, tick: bool = True) -> None:
        """Record what finished and change roles if a change is due; ``tick``: False on an arrival
        between ticks, when only a change from memory is, and only if the arriving mix moved: a
        steady load's arrivals return at once, with no settling or recording on their path."""
        config, now = self.config, time.time()
        if not self.mix_moved(now) and not tick:
            return
        live = sorted((s for s in self.cluster.instances if s.failure is None), key=lambda s: -s.load_tokens)
        layout = {s.name: s.role for s in live}
        in_flight = self.cluster.in_flight()
        if self.settled_at is None:
            self.settle(in_flight, now)
        window = self.window(now)
        self.record(layout, window, now)
        if now - self.last_change < config.min_dwell:
            return
        # Step times for a forecast that is due, and on a tick for ranking a colocated layout's way out.
        ranking = tick and config.forecast and all_colocated(layout)
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
        await self.cluster.change_roles(roles, reason)  # which remembers what the layout served (record_left)

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
