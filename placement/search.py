"""Search of parallel configurations, DistServe's two algorithms (OSDI'24, Algorithms 1 and 2).

Both start from the goodput of one instance of each phase at each candidate TP,PP, found by binary
search over simulations of that phase alone: prefill against the TTFT SLO (requests end at their
first token), decode against the TPOT SLO (requests reach it as they arrive). Arrival times are one
unit-rate draw scaled to each probed rate, so every configuration sees the same requests in the same
order and differences between them are not sampling noise.

* High node-affinity (the network across nodes is fast enough for KV): the phases are placed
  independently, so the best prefill and the best decode configuration are each the one with the
  most goodput per GPU, and a deployment for rate R has ceil(R / goodput) instances of each.
  Configurations are ranked by the goodput per GPU of the pair with instance counts in exact ratio,
  1 / (prefill GPUs / prefill goodput + decode GPUs / decode goodput).
* Low node-affinity (KV must move over NVLink): a unit is one prefill and one decode instance with
  the same PP, stage i of both on the same node, so each node hosts segments of TP_prefill +
  TP_decode GPUs. A unit's goodput is the smaller of its two instances' and it takes
  PP x (TP_prefill + TP_decode) GPUs.

An instance's goodput is capped at its capacity (``capacity``: its completion rate when never
idle), which also bounds it: configurations are simulated in waves across processes, highest
capacity per GPU first, and one whose capacity cannot lift any pair above the best found so far is
never simulated (see ``_may_improve``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cached_property

from distserve.core.latency import attainment
from placement.deployment import Deployment
from placement.goodput import search_goodput
from placement.hardware import ClusterSpec
from placement.latency import InstanceModels, Parallelism
from placement.simulator import DecodeInstanceSpec, PrefillInstanceSpec, SimRequest, simulate
from placement.workload import RequestSpec

# Goodput is searched down from the capacity by halving; under capacity / 2**MAX_HALVINGS it counts as 0.
MAX_HALVINGS = 6
GOODPUT_TOLERANCE = 0.03
# A probe's requests arrive over at least this many times a mean request's time within its SLOs.
MIN_SPANS = 2


@dataclass(frozen=True)
class Objective:
    """Latency SLOs (seconds) and the share of requests that must meet them."""

    ttft: float
    tpot: float
    target: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft > 0 and self.tpot > 0):
            raise ValueError(f"SLOs must be positive, got ttft={self.ttft}, tpot={self.tpot}")
        if not 0 < self.target <= 1:
            raise ValueError(f"the attainment target must be in (0, 1], got {self.target}")


@dataclass(frozen=True)
class PhaseGoodput:
    phase: str
    parallelism: Parallelism
    goodput: float  # requests/s of one instance within its phase's SLO at the target

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.parallelism.gpus


@dataclass(frozen=True)
class Candidate:
    """A pair of instance configurations and the goodput per GPU of deploying them."""

    affinity: str  # "high" or "low"
    prefill: PhaseGoodput
    decode: PhaseGoodput

    @property
    def per_gpu(self) -> float:
        p, d = self.prefill, self.decode
        if p.goodput == 0 or d.goodput == 0:
            return 0.0
        if self.affinity == "high":
            return 1 / (p.parallelism.gpus / p.goodput + d.parallelism.gpus / d.goodput)
        return min(p.goodput, d.goodput) / (p.parallelism.gpus + d.parallelism.gpus)


@dataclass
class SearchResult:
    high: list[Candidate]  # best first
    low: list[Candidate]
    phase_goodputs: dict[tuple[str, Parallelism], PhaseGoodput]
    simulated: int  # configurations simulated
    pruned: int  # configurations skipped by the capacity bound


# --- one phase, one configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseProblem:
    """Everything a worker process needs to find one configuration's goodput.

    ``requests`` is a pool in arrival order and ``unit_arrivals`` their arrival times at 1 request/s;
    a probe at rate R simulates a prefix of them, arrivals divided by R (``probe_size``)."""

    models: InstanceModels
    requests: tuple[RequestSpec, ...]
    unit_arrivals: tuple[float, ...]
    objective: Objective
    min_requests: int = 1000

    def __post_init__(self) -> None:
        if len(self.requests) != len(self.unit_arrivals) or not self.requests:
            raise ValueError("need one arrival time per request, and at least one request")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be at least 1, got {self.min_requests}")

    @cached_property
    def mean_output(self) -> float:
        return sum(r.output_len for r in self.requests) / len(self.requests)

    def probe_size(self, rate: float) -> int:
        """At least ``min_requests``, and enough to arrive over MIN_SPANS times the time a mean
        request may take within its SLOs: fewer would let an overloaded instance pass by draining a
        short burst, since a request only misses once the queue ahead of it outgrows its slack."""
        span = self.objective.ttft + self.objective.tpot * max(0.0, self.mean_output - 1)
        return min(len(self.requests), max(self.min_requests, math.ceil(rate * MIN_SPANS * span)))


def _instant_prefill() -> PrefillInstanceSpec:
    return PrefillInstanceSpec(1, lambda lengths: 0.0, None, 1 << 62, 1 << 62)


def _unused_decode() -> DecodeInstanceSpec:
    return DecodeInstanceSpec(1, lambda batch, context: 0.0, None, 1, 1 << 62)


def _no_transfer(tokens: int) -> float:
    return 0.0


def phase_attainment(problem: PhaseProblem, phase: str, par: Parallelism, rate: float) -> float:
    """Share of requests meeting the phase's SLO with one instance of ``par`` at ``rate``."""
    models, objective = problem.models, problem.objective
    n = problem.probe_size(rate)
    arrivals = [t / rate for t in problem.unit_arrivals[:n]]
    if phase == "prefill":
        reqs = [SimRequest(t, r.prompt_len, 1) for t, r in zip(arrivals, problem.requests)]
        results = simulate(reqs, models.prefill_spec(par), _unused_decode(), _no_transfer)
        return attainment(((r.ttft, r.tpot) for r in results), objective.ttft, objective.tpot).ttft
    reqs = [SimRequest(t, r.prompt_len, r.output_len) for t, r in zip(arrivals, problem.requests)]
    results = simulate(reqs, _instant_prefill(), models.decode_spec(par), _no_transfer)
    return attainment(((r.ttft, r.tpot) for r in results), objective.ttft, objective.tpot).tpot


def capacity(problem: PhaseProblem, phase: str, par: Parallelism) -> float:
    """Requests/s one instance sustains when never idle: all of ``min_requests`` arrive at once and
    the rate is read between the 10th and 90th percentile completions, clear of ramp-up and drain.
    Goodput is capped at it: an instance can only meet its SLOs over a finite run above it because
    the queue has not yet grown past the requests' slack, which a sustained load would."""
    reqs = [RequestSpec(r.prompt_len, r.output_len) for r in problem.requests[: problem.min_requests]]
    if phase == "prefill":
        sims = [SimRequest(0.0, r.prompt_len, 1) for r in reqs]
        results = simulate(sims, problem.models.prefill_spec(par), _unused_decode(), _no_transfer)
    else:
        sims = [SimRequest(0.0, r.prompt_len, r.output_len) for r in reqs]
        results = simulate(sims, _instant_prefill(), problem.models.decode_spec(par), _no_transfer)
    return sustained_rate([r.finish for r in results])


def sustained_rate(finishes: list[float]) -> float:
    """Completions per second of a burst, between its 10th and 90th percentile completions."""
    finishes = sorted(finishes)
    first, last = len(finishes) // 10, len(finishes) * 9 // 10
    span = finishes[last] - finishes[first]
    return (last - first) / span if span > 0 else math.inf


def capped_goodput(attainment: Callable[[float], float], target: float, cap: float, what: str) -> float:
    """The highest rate up to ``cap`` (a capacity) whose ``attainment`` meets ``target``; ``what``
    names the instance in the error for a capacity without bound."""
    if not math.isfinite(cap):
        raise ValueError(f"{what} takes no time: the latency model is degenerate")
    goodput, _ = search_goodput(
        attainment, target, estimate=cap, tolerance=GOODPUT_TOLERANCE, max_doublings=0, max_halvings=MAX_HALVINGS
    )
    return goodput


def phase_goodput(problem: PhaseProblem, phase: str, par: Parallelism, cap: float | None = None) -> PhaseGoodput:
    """One instance's goodput, at most ``cap`` (its ``capacity``, computed when not given)."""
    cap = capacity(problem, phase, par) if cap is None else cap
    goodput = capped_goodput(lambda rate: phase_attainment(problem, phase, par, rate), problem.objective.target,
                             cap, f"{phase} at TP,PP={par}")  # fmt: skip
    return PhaseGoodput(phase, par, goodput)


_worker_problem: PhaseProblem | None = None


def _init_worker(problem: PhaseProblem) -> None:
    global _worker_problem
    _worker_problem = problem


def _worker_capacity(task: tuple[str, Parallelism]) -> float:
    assert _worker_problem is not None
    return capacity(_worker_problem, *task)


def _worker_goodput(task: tuple[str, Parallelism, float]) -> PhaseGoodput:
    assert _worker_problem is not None
    return phase_goodput(_worker_problem, *task)


# --- the two algorithms -------------------------------------------------------------------------------------


def _fits(candidate: Candidate, cluster: ClusterSpec) -> bool:
    """Whether one prefill and one decode instance of ``candidate`` fit on the cluster's nodes."""
    p, d = candidate.prefill.parallelism, candidate.decode.parallelism
    return Deployment(candidate.affinity, p, 1, d, 1).fits(cluster)


def _best_first(pairs: Iterable[Candidate], cluster: ClusterSpec) -> list[Candidate]:
    fitting = [c for c in pairs if c.per_gpu > 0 and _fits(c, cluster)]
    return sorted(fitting, key=lambda c: (-c.per_gpu, c.prefill.parallelism.gpus + c.decode.parallelism.gpus))


def high_affinity(goodputs: Iterable[PhaseGoodput], cluster: ClusterSpec) -> list[Candidate]:
    """Every (prefill, decode) pair that fits the cluster and meets the SLOs at some rate, best goodput
    per GPU first."""
    goodputs = list(goodputs)
    prefills = [g for g in goodputs if g.phase == "prefill"]
    decodes = [g for g in goodputs if g.phase == "decode"]
    return _best_first((Candidate("high", p, d) for p in prefills for d in decodes), cluster)


def low_affinity_pairs(candidates: Sequence[Parallelism], gpus_per_node: int) -> list[tuple[Parallelism, Parallelism]]:
    """(prefill, decode) pairs of equal PP whose stage segments fit on one node together."""
    return [(p, d) for p in candidates for d in candidates if p.pp == d.pp and p.tp + d.tp <= gpus_per_node]


def low_affinity(goodputs: Iterable[PhaseGoodput], cluster: ClusterSpec) -> list[Candidate]:
    """Every unit (equal-PP pair sharing nodes) that fits the cluster and meets the SLOs at some rate,
    best goodput per GPU first."""
    by_key = {(g.phase, g.parallelism): g for g in goodputs}
    pars = sorted({par for _, par in by_key})
    units = (
        Candidate("low", by_key["prefill", p], by_key["decode", d])
        for p, d in low_affinity_pairs(pars, cluster.gpus_per_node)
        if ("prefill", p) in by_key and ("decode", d) in by_key
    )
    return _best_first(units, cluster)


def search(
    problem: PhaseProblem,
    affinities: Sequence[str] = ("high", "low"),
    processes: int | None = None,
    progress: Callable[[PhaseGoodput], None] | None = None,
) -> SearchResult:
    """Per-phase goodputs of the candidate configurations (pruned by capacity bound, simulated in
    parallel over ``processes`` worker processes; 1 runs in this process), then both algorithms."""
    models = problem.models
    longest = max(r.prompt_len + r.output_len for r in problem.requests)
    candidates = models.candidates(min_kv_tokens=longest)
    if not candidates:
        raise ValueError(
            f"no TP,PP of this model fits {models.cluster.num_gpus} x {models.cluster.gpu.name} "
            f"with KV room for the longest request ({longest} tokens)"
        )
    if affinities == ("low",):
        in_units = {par for pair in low_affinity_pairs(candidates, models.cluster.gpus_per_node) for par in pair}
        candidates = [par for par in candidates if par in in_units]
    tasks = [(phase, par) for phase in ("prefill", "decode") for par in candidates]
    processes = processes or os.cpu_count() or 1
    results: dict[tuple[str, Parallelism], PhaseGoodput] = {}
    pruned = 0
    pool = ProcessPoolExecutor(processes, initializer=_init_worker, initargs=(problem,)) if processes > 1 else None
    run = map if pool is None else pool.map
    if pool is None:
        _init_worker(problem)
    try:
        caps = dict(zip(tasks, run(_worker_capacity, tasks)))
        bounds = {task: caps[task] / task[1].gpus for task in tasks}
        pending = sorted(tasks, key=lambda task: -bounds[task])
        while pending:
            upper = {task: results[task].per_gpu if task in results else bounds[task] for task in tasks}
            ranked = {"high": high_affinity, "low": low_affinity}
            best = {a: max([0.0] + [c.per_gpu for c in ranked[a](results.values(), models.cluster)[:1]])
                    for a in affinities}  # fmt: skip
            keep = [task for task in pending if _may_improve(task, upper, best, models.cluster.gpus_per_node)]
            pruned += len(pending) - len(keep)
            wave, pending = _next_wave(keep, results, processes)
            for g in run(_worker_goodput, [(*task, caps[task]) for task in wave]):
                results[g.phase, g.parallelism] = g
                if progress is not None:
                    progress(g)
    finally:
        if pool is not None:
            pool.shutdown()
    return SearchResult(
        high=high_affinity(results.values(), models.cluster) if "high" in affinities else [],
        low=low_affinity(results.values(), models.cluster) if "low" in affinities else [],
        phase_goodputs=results,
        simulated=len(results),
        pruned=pruned,
    )


def _may_improve(
    task: tuple[str, Parallelism],
    upper: dict[tuple[str, Parallelism], float],
    best: dict[str, float],
    gpus_per_node: int,
) -> bool:
    """Whether simulating ``task`` could beat ``best``, the best pair per GPU of each affinity so far.
    Per GPU, no pair beats 1 / (1/a + 1/b) for instance goodputs a and b per GPU (a low node-affinity
    unit does no better than the same pair placed freely), where ``upper`` holds each configuration's
    goodput per GPU when simulated and its capacity per GPU otherwise."""
    phase, par = task
    for affinity, best_per_gpu in best.items():
        partners = [
            v for (p, other), v in upper.items()
            if p != phase and (affinity == "high" or (other.pp == par.pp and other.tp <= gpus_per_node - par.tp))
        ]  # fmt: skip
        if partners and _pair_bound(upper[task], max(partners)) > best_per_gpu:
            return True
    return False


def _pair_bound(a: float, b: float) -> float:
    return 0.0 if a <= 0 or b <= 0 else 1 / (1 / a + 1 / b)


def _next_wave(
    tasks: list[tuple[str, Parallelism]], done: dict, processes: int
) -> tuple[list[tuple[str, Parallelism]], list[tuple[str, Parallelism]]]:
    """The next tasks to run together: until both phases have a result, the best-bounded task of each
    (so a pair, and with it a pruning bound, exists after one wave); then ``processes`` at a time."""
    phases_done = {phase for phase, _ in done}
    if phases_done != {"prefill", "decode"}:
        firsts = []
        for phase in ("prefill", "decode"):
            if phase not in phases_done:
                firsts += [t for t in tasks if t[0] == phase][: max(1, processes // 2)]
        rest = [t for t in tasks if t not in firsts]
        return firsts, rest
    return tasks[:processes], tasks[processes:]
