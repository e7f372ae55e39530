"""A layout for a kind of request memory says nothing of (the first of a workload, or one not seen
within ``memory``), which would otherwise wait a window for its misses. On the arrivals that bring
it, the controller asks a forecast (``layout_forecast``) how colocated and disaggregated would
serve it, from the step times the instances measure and the SLOs the requests carry, and moves to
the other of the two when the forecast says the current one misses (or nearly) and the other does
better, once for each kind that arrives, unless memory says otherwise (the current layout met this
load or a heavier one, or the other did no better under a similar load). Windows then judge as
before; the forecast also ranks a colocated layout's way out for them (``disaggregated_better``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from statistics import fmean

from distserve.cluster.layout_forecast import ChunkedPrefill, Demand, forecast
from distserve.cluster.role_control.cluster_view import InstanceView
from distserve.cluster.role_control.config import RoleControlConfig
from distserve.cluster.role_control.layouts import all_colocated, disaggregated, layout_key
from distserve.cluster.role_control.load import LOAD_SIMILARITY, Load
from distserve.cluster.role_control.memory import LayoutMemory
from distserve.cluster.role_control.policy import NEAR_SLO
from distserve.core.role import Role
from distserve.scheduling.step_time import StepCost


class Forecasting(LayoutMemory):
    def __init__(self, config: RoleControlConfig) -> None:
        super().__init__(config)
        self._forecast_mix: Load | None = None  # the arriving mix at the last forecast

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
        colocated = all_colocated(layout)
        if len(names) < 2 or not (colocated or layout_key(layout) == layout_key(disaggregated(names))):
            return None  # one instance, or a layout of other proportions: windows judge
        demand = self.demand(now, arriving)
        here = forecast(colocated, len(names), demand, cost, chunking)
        there = forecast(not colocated, len(names), demand, cost, chunking)
        if here.share < NEAR_SLO or there >= here:
            return None
        other = disaggregated(names) if colocated else {n: Role.COLOCATED for n in names}
        held = self.remembered(layout_key(layout), arriving, now, rates="heavier")
        current = self.remembered(layout_key(layout), arriving, now)
        known = self.remembered(layout_key(other), arriving, now)
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
        if not (all_colocated(layout) and arriving and forecast_from):
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

    async def forecast_inputs(self, live: Sequence[InstanceView]) -> tuple[StepCost, ChunkedPrefill] | None:
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
