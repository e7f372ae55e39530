"""Sizing and checking a deployment with the whole-system simulation.

The search ranks configurations by one instance of each phase; a deployment is checked here with
every instance, the KV transfer between them and both SLOs at once, since a request must meet both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from distserve.core.latency import attainment
from placement.deployment import Deployment
from placement.goodput import search_goodput
from placement.latency import Parallelism
from placement.search import Candidate, PhaseProblem, capacity
from placement.simulator import SimRequest, SimResult, simulate


def deployment_for_rate(candidate: Candidate, rate: float) -> Deployment:
    """The fewest instances of ``candidate`` whose summed single-instance goodput reaches ``rate``."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    p, d = candidate.prefill, candidate.decode
    if p.goodput <= 0 or d.goodput <= 0:
        raise ValueError(f"TP,PP {p.parallelism} / {d.parallelism} meets the SLOs at no rate")
    if candidate.affinity == "low":
        units = math.ceil(rate / min(p.goodput, d.goodput))
        return Deployment("low", p.parallelism, units, d.parallelism, units)
    return Deployment("high", p.parallelism, math.ceil(rate / p.goodput), d.parallelism, math.ceil(rate / d.goodput))


@dataclass(frozen=True)
class Prediction:
    rate: float
    attainment: float  # both SLOs
    ttft_attainment: float
    tpot_attainment: float
    results: tuple[SimResult, ...]


def simulate_deployment(problem: PhaseProblem, deployment: Deployment, rate: float) -> Prediction:
    """Every instance of ``deployment`` serving ``problem``'s workload at ``rate``."""
    models, objective = problem.models, problem.objective
    n = problem.probe_size(rate)
    reqs = [
        SimRequest(t / rate, r.prompt_len, r.output_len)
        for t, r in zip(problem.unit_arrivals[:n], problem.requests[:n])
    ]
    results = simulate(
        reqs,
        models.prefill_spec(deployment.prefill, deployment.prefill_instances),
        models.decode_spec(deployment.decode, deployment.decode_instances),
        models.transfer_time(same_node=deployment.affinity == "low"),
    )
    met = attainment(((r.ttft, r.tpot) for r in results), objective.ttft, objective.tpot)
    return Prediction(
        rate,
        met.both,
        met.ttft,
        met.tpot,
        tuple(results),
    )


def deployment_capacity(problem: PhaseProblem, deployment: Deployment) -> float:
    """Requests/s the deployment sustains: its instances' capacities summed, the smaller phase."""
    return min(
        deployment.prefill_instances * capacity(problem, "prefill", deployment.prefill),
        deployment.decode_instances * capacity(problem, "decode", deployment.decode),
    )


def deployment_goodput(
    problem: PhaseProblem, deployment: Deployment, capacity: float, tolerance: float = 0.03
) -> float:
    """Highest rate at which the whole deployment meets the target, at most its ``capacity``
    (``deployment_capacity``)."""
    goodput, _ = search_goodput(
        lambda rate: simulate_deployment(problem, deployment, rate).attainment,
        problem.objective.target,
        estimate=capacity,
        tolerance=tolerance,
        max_doublings=0,
        max_halvings=8,
    )
    return goodput


def fit_to_rate(
    problem: PhaseProblem,
    deployment: Deployment,
    rate: float,
    fits: Callable[[Deployment], bool],
    max_steps: int = 16,
) -> tuple[Deployment, Prediction]:
    """Add instances (to the phase missing its SLO more often; a whole unit for low affinity) until
    the whole deployment meets the target at ``rate``, or the next one would not ``fit``."""
    prediction = simulate_deployment(problem, deployment, rate)
    for _ in range(max_steps):
        if prediction.attainment >= problem.objective.target:
            break
        grown = deployment.grown("prefill" if prediction.ttft_attainment <= prediction.tpot_attainment else "decode")
        if not fits(grown):
            break
        deployment, prediction = grown, simulate_deployment(problem, grown, rate)
    return deployment, prediction


def attainment_curve(
    attainment: Callable[[float], float], target: float, knee: float, marked: Iterable[float] = (), max_steps: int = 6
) -> list[tuple[float, float]]:
    """(rate, predicted ``attainment(rate)``) at rates that span the knee: fractions of ``knee`` (the
    deployment's goodput, where attainment crosses ``target``) from a quarter up, then 1.5 times
    higher at each of at most ``max_steps`` steps until attainment is under half the target;
    ``marked`` rates besides."""
    if not knee > 0:
        raise ValueError(f"knee must be > 0, got {knee}")
    rates = {knee * f for f in (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)} | set(marked)
    points = {rate: attainment(rate) for rate in rates}
    rate = max(points)
    for _ in range(max_steps):
        if points[rate] < target / 2:
            break
        rate *= 1.5
        points[rate] = attainment(rate)
    return sorted(points.items())


def deployment_attainment(problem: PhaseProblem, deployment: Deployment) -> Callable[[float], float]:
    """The deployment's predicted attainment as a function of the rate."""
    return lambda rate: simulate_deployment(problem, deployment, rate).attainment


def unloaded_latency(problem: PhaseProblem, phase: str, par: Parallelism) -> float:
    """The least a phase's latency can be at ``par``: the target quantile over the workload of a request
    served alone, its prefill (TTFT) or a decode step of one sequence halfway through its reply (TPOT)."""
    requests = problem.requests[: problem.min_requests]
    if phase == "prefill":
        batch_time = problem.models.prefill_spec(par).batch_time
        times = [batch_time([r.prompt_len]) for r in requests]
    else:
        step_time = problem.models.decode_spec(par).step_time
        times = [step_time(1, r.prompt_len + r.output_len // 2) for r in requests]
    return float(np.quantile(times, problem.objective.target))
