"""What one window's attainment calls for, before memory weighs in (``LayoutMemory.consider``).

TTFT missed while TPOT holds means too little prefill: one decode instance fewer, or all colocated
when one is left, if decode steps have room for prompt chunks beside them (the TPOT quantile well
within its SLO; then TTFT near its SLO is enough, before a window misses); without that room
colocating would trade TTFT misses for TPOT ones. Colocated already and without that room, prompts
wait behind decoding in mixed steps, and half the instances prefill alone (unless the forecast,
``layout_forecast``, ranks colocation above for the load arriving: steps cut to the TPOT SLO run
near it by design). TPOT missed while TTFT holds means prefill interferes with decoding, or too
little decode: from colocated to half prefill, half decode, else one decode instance more. Both
met: no change. Both missed (an overload, or the wrong layout for the load): the other of
colocated and disaggregated is tried.
"""

from __future__ import annotations

from distserve.cluster.role_control.attainment import Attainment, miss_margin
from distserve.cluster.role_control.layouts import all_colocated, disaggregated
from distserve.core.role import Role

# A prompt chunk lengthens the decode step it joins: decoding has room for prompts beside it while
# the target share of requests' TPOT is within this fraction of the SLO. Prefill short of capacity
# (TTFT missed or near its SLO) is then met by colocating; without that room colocation trades TTFT
# misses for TPOT ones, and prompts in mixed steps are better served apart.
DECODE_ROOM = 0.6
NEAR_SLO = 0.9  # a quantile this close to its SLO is pressure on it, before a window misses


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
        return disaggregated(names), f"{why}: both missed, trying disaggregated"
    if short_of_prefill and len(decode) == 1 and decode_has_room:
        return {n: Role.COLOCATED for n in names}, f"{why}: too little prefill, colocating"
    if missing_ttft and len(decode) > 1:
        return {**layout, decode[-1]: Role.PREFILL}, f"{why}: too little prefill, one decode instance fewer"
    colocated = all_colocated(layout)
    # Whether half the instances prefilling alone beats all of them prefilling beside decoding turns
    # on decoding's share of the steps, which a TPOT near its SLO only hints at: steps cut to fit
    # the TPOT SLO (tpot_aware_chunking) run near it by design. A forecast, where there is one, says.
    if missing_ttft and not missing_tpot and colocated and not decode_has_room and disaggregated_better is not False:
        return disaggregated(names), f"{why}: prompts wait behind decoding, disaggregating"
    if missing_tpot and not decode and len(names) > 1:
        return disaggregated(names), f"{why}: prefill interferes with decoding, disaggregating"
    prefill = [n for n in names if layout[n] is Role.PREFILL]
    if missing_tpot and len(prefill) > 1:
        return {**layout, prefill[-1]: Role.DECODE}, f"{why}: too little decode, one decode instance more"
    return None
