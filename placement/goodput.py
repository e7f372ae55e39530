"""Goodput: the highest arrival rate whose SLO attainment meets a target, by binary search. The
serving benchmark measures attainment on a real cluster; the planner simulates it."""

from __future__ import annotations

from collections.abc import Callable


def find_goodput(
    measure: Callable[[float], float],
    target: float,
    low: float,
    high: float,
    tolerance: float = 0.05,
    max_iters: int = 12,
) -> tuple[float, list[tuple[float, float]]]:
    """Binary search for the highest rate whose attainment ``measure(rate)`` (the "both" fraction)
    is >= ``target``, assuming attainment does not increase with rate. Returns the goodput and the
    (rate, attainment) probes in the order made. The goodput is 0.0 when even ``low`` misses the
    target, and ``high`` when ``high`` meets it (raise ``high`` and search again). Bisection stops
    once (hi - lo) / hi < ``tolerance`` or after ``max_iters`` probes between the two ends; the
    answer is the highest rate seen to meet the target."""
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    probes: list[tuple[float, float]] = []

    def meets(rate: float) -> bool:
        value = measure(rate)
        probes.append((rate, value))
        return value >= target

    if not meets(low):
        return 0.0, probes
    if meets(high):
        return high, probes
    lo, hi = low, high
    for _ in range(max_iters):
        if (hi - lo) / hi < tolerance:
            break
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def search_goodput(
    measure: Callable[[float], float],
    target: float,
    estimate: float,
    tolerance: float = 0.05,
    max_doublings: int = 8,
    max_halvings: int = 8,
    max_iters: int = 12,
) -> tuple[float, list[tuple[float, float]]]:
    """Goodput without known bounds: from an ``estimate`` of it, double while the target is met (at
    most ``max_doublings`` times; 0 makes the estimate a cap) or halve until it is (at most
    ``max_halvings`` times, then 0.0), then bisect that bracket as ``find_goodput`` does. Probing
    near the answer first matters when a probe's cost grows as the rate falls, as a simulated
    decode instance's does (one step per token at low load)."""
    if not estimate > 0:
        raise ValueError(f"estimate must be > 0, got {estimate}")
    seen: dict[float, float] = {}
    probes: list[tuple[float, float]] = []

    def cached(rate: float) -> float:
        if rate not in seen:
            seen[rate] = measure(rate)
            probes.append((rate, seen[rate]))
        return seen[rate]

    rate = estimate
    if cached(rate) >= target:
        for _ in range(max_doublings):
            if cached(rate * 2) < target:
                break
            rate *= 2
        else:
            return rate, probes
    else:
        for _ in range(max_halvings):
            rate /= 2
            if cached(rate) >= target:
                break
        else:
            return 0.0, probes
    goodput, _ = find_goodput(cached, target, rate, rate * 2, tolerance, max_iters)
    return goodput, probes
