"""What each layout served, remembered: how many of its requests met both SLOs under the load they
came in (``Load``); a layout left before it settled (a load at its capacity keeps a queue) by the
requests that arrived since the change to it.

A change to a layout whose requests did no better under a similar load within ``memory`` seconds
than the current layout's (in the window, or as remembered) is not made, so a layout that is worse
for this load is left after one try and not tried again for a window's dip, and an overload in
which both miss does not flap. Nor does a window's miss move it from a layout whose requests met
the target under a similar load at this rate or above as remembered: under bursty arrivals misses
come in runs, and one window of them is a dip; what a lower rate met says nothing of a rising one.

When the current layout's requests fell short of the target under a load like the one arriving
(or, none recorded at a rate like it, under a lighter one) and another layout's did clearly better
under one at this rate or above (or the current layout served none like it, and another surely met
the target), the controller moves there at once (``recall``).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Literal

from distserve.cluster.role_control.attainment import Attainment, Share, attainment
from distserve.cluster.role_control.config import RoleControlConfig
from distserve.cluster.role_control.layouts import layout_key, roles_for
from distserve.cluster.role_control.load import MIX_ARRIVALS, Load, kinds
from distserve.cluster.role_control.observations import Observations
from distserve.cluster.role_control.policy import propose
from distserve.cluster.role_control.request_records import FinishedRequest
from distserve.core.role import Role


@dataclass(frozen=True)
class Outcome:
    """Requests that finished under one layout and load: how many met both of their SLOs."""

    layout: tuple[Role, ...]
    load: Load
    met: int
    num_requests: int
    when: float


class LayoutMemory(Observations):
    def __init__(self, config: RoleControlConfig) -> None:
        super().__init__(config)
        self.outcomes: deque[Outcome] = deque()
        # What the last window proposal judged, and those of them not remembered yet.
        self._judged: tuple[list[FinishedRequest], list[FinishedRequest]] = ([], [])
        # Each judgement that proposed a change or kept the layout, by why: what an operator reads
        # to tell a controller held by its memory from one that saw nothing to change.
        self.verdicts: Counter[str] = Counter()

    def remember(self, layout: dict[str, Role], load: Load, met: int, num_requests: int, now: float) -> None:
        self.outcomes.append(Outcome(layout_key(layout), load, met, num_requests, now))

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
        held = self.remembered(layout_key(layout), load, now, rates="heavier")
        if held and held.value >= self.config.target:
            self.verdicts["held by memory"] += 1
            return None
        current = self.remembered(layout_key(layout), load, now)
        known = self.remembered(layout_key(proposal[0]), load, now)
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
        current = self.remembered(layout_key(layout), arriving, now, before=before)
        if current is None:  # none at a similar rate (a short window's rate is noisy): a shortfall at a lower one
            lower = self.remembered(layout_key(layout), arriving, now, rates="lighter", before=before)
            current = lower if lower and lower.value < self.config.target else None
        if current is not None and current.value >= self.config.target:
            return None
        others = {o.layout for o in self.outcomes if o.layout != layout_key(layout) and len(o.layout) == len(layout)}
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
        return roles_for(key, list(layout)), why

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
