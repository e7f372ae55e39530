"""Colocation as the planner's alternative to disaggregation: instances that run both phases with
chunked prefill (the deployment vLLM and Sarathi-Serve would serve), simulated on the same latency
models, workload and SLOs as the prefill and decode instances.

An instance of each candidate TP,PP is simulated alone (``ColocatedInstanceSpec`` with the
engine's scheduler in ``CHUNKED`` mode); its goodput is the highest rate at which the target share
of requests meets both SLOs, and the best goodput per GPU is what the planner holds against the
best disaggregated pair. Pipeline stages are not overlapped: a PP>1 colocated instance is timed
as its whole model, which can only understate it.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from distserve.core.latency import attainment
from placement.engine_sim import simulate_colocated
from placement.hardware import ClusterSpec
from placement.latency import Parallelism
from placement.search import PhaseProblem, capped_goodput, sustained_rate
from placement.sim_specs import ColocatedInstanceSpec, SimRequest

BLOCK_SIZE = 16  # the engine's default KV block
DEFAULT_CHUNK_TOKENS = 512  # tokens per step with chunked prefill: decode tokens first, then prompt chunks


@dataclass(frozen=True)
class ColocatedGoodput:
    parallelism: Parallelism
    goodput: float  # of one instance

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.parallelism.gpus


@dataclass(frozen=True)
class ColocatedDeployment:
    parallelism: Parallelism
    instances: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @property
    def gpus(self) -> int:
        return self.instances * self.parallelism.gpus

    def describe(self) -> str:
        return (f"{self.instances} colocated x TP,PP={self.parallelism} with chunked prefill of {self.chunk_tokens} "
                f"tokens ({self.gpus} GPUs)")  # fmt: skip

    def fits(self, cluster: ClusterSpec) -> bool:
        """Every stage's TP ranks on one node (tensor parallelism needs NVLink)."""
        tp, pp = self.parallelism.tp, self.parallelism.pp
        return tp <= cluster.gpus_per_node and self.instances * pp <= cluster.num_nodes * (cluster.gpus_per_node // tp)


def colocated_spec(problem: PhaseProblem, par: Parallelism, chunk_tokens: int, count: int = 1) -> ColocatedInstanceSpec:
    models = problem.models
    prefill, decode = models.prefill_spec(par), models.decode_spec(par)
    num_blocks = models.kv_capacity_tokens(par) // BLOCK_SIZE
    return ColocatedInstanceSpec(count, prefill.batch_time, decode.step_time, chunk_tokens, models.max_batch_size,
                                 BLOCK_SIZE, num_blocks, chunked_prefill=True,
                                 step_times=decode.step_times)  # fmt: skip


def colocated_attainment(problem: PhaseProblem, par: Parallelism, chunk_tokens: int, rate: float,
                         count: int = 1) -> float:  # fmt: skip
    """Share of requests meeting both SLOs with ``count`` instances of ``par`` at ``rate``."""
    n = problem.probe_size(rate)
    arrivals = problem.unit_arrivals[:n]
    reqs = [SimRequest(t / rate, r.prompt_len, r.output_len) for t, r in zip(arrivals, problem.requests)]
    results = simulate_colocated(reqs, colocated_spec(problem, par, chunk_tokens, count))
    objective = problem.objective
    return attainment(((r.ttft, r.tpot) for r in results), objective.ttft, objective.tpot).both


def colocated_capacity(problem: PhaseProblem, par: Parallelism, chunk_tokens: int) -> float:
    """Requests/s one instance sustains when never idle (as ``search.capacity``)."""
    reqs = [SimRequest(0.0, r.prompt_len, r.output_len) for r in problem.requests[: problem.min_requests]]
    return sustained_rate([r.finish for r in simulate_colocated(reqs, colocated_spec(problem, par, chunk_tokens))])


def colocated_goodput(problem: PhaseProblem, par: Parallelism, chunk_tokens: int,
                      cap: float | None = None) -> ColocatedGoodput:  # fmt: skip
    """One instance's goodput, at most ``cap`` (its ``colocated_capacity``, found when not given)."""
    cap = colocated_capacity(problem, par, chunk_tokens) if cap is None else cap
    goodput = capped_goodput(lambda rate: colocated_attainment(problem, par, chunk_tokens, rate),
                             problem.objective.target, cap, f"a colocated TP,PP={par} instance")  # fmt: skip
    return ColocatedGoodput(par, goodput)


def _capacity_task(task: tuple[PhaseProblem, Parallelism, int]) -> float:
    return colocated_capacity(*task)


def _goodput_task(task: tuple[PhaseProblem, Parallelism, int, float]) -> ColocatedGoodput:
    return colocated_goodput(*task)


def search_colocated(problem: PhaseProblem, chunk_tokens: int, processes: int | None = None,
                     keep: int = 5) -> list[ColocatedGoodput]:  # fmt: skip
    """The candidate TP,PPs as colocated instances that meet the SLOs at some rate, best goodput per
    GPU first, over ``processes`` worker processes (default: one per CPU). The ``keep`` best are
    exact; the list may leave out others: an instance's goodput is at most its capacity, so one
    whose capacity per GPU is under the ``keep``-th best goodput per GPU found so far is not
    searched. Candidates are searched in waves of ``processes``, highest capacity per GPU first."""
    longest = max(r.prompt_len + r.output_len for r in problem.requests)
    pars = problem.models.candidates(min_kv_tokens=longest)
    processes = processes or os.cpu_count() or 1
    pool = ProcessPoolExecutor(min(processes, len(pars))) if processes > 1 and len(pars) > 1 else None
    run = map if pool is None else pool.map
    try:
        caps = dict(zip(pars, run(_capacity_task, [(problem, par, chunk_tokens) for par in pars])))
        pending = sorted(pars, key=lambda par: (-caps[par] / par.gpus, par.gpus))
        found: list[ColocatedGoodput] = []
        while pending:
            best = sorted((g.per_gpu for g in found), reverse=True)
            bar = best[keep - 1] if len(best) >= keep else 0.0
            pending = [par for par in pending if caps[par] / par.gpus >= bar]
            wave, pending = pending[:processes], pending[processes:]
            found += run(_goodput_task, [(problem, par, chunk_tokens, caps[par]) for par in wave])
    finally:
        if pool is not None:
            pool.shutdown()
    return sorted((g for g in found if g.goodput > 0), key=lambda g: (-g.per_gpu, g.parallelism.gpus))


def fill_colocated(best: ColocatedGoodput, cluster: ClusterSpec, chunk_tokens: int) -> ColocatedDeployment | None:
    """As many instances of ``best`` as the cluster holds."""
    count = 0
    while ColocatedDeployment(best.parallelism, count + 1).fits(cluster):
        count += 1
    return ColocatedDeployment(best.parallelism, count, chunk_tokens) if count else None


def colocated_for_rate(
    problem: PhaseProblem, best: ColocatedGoodput, chunk_tokens: int, rate: float
) -> tuple[ColocatedDeployment, float]:
    """The fewest instances of ``best`` predicted to meet the target at ``rate`` (from rate / goodput
    up), or the most the cluster holds; with the predicted attainment."""
    cluster = problem.models.cluster
    count = max(1, math.ceil(rate / best.goodput))
    while True:
        deployment = ColocatedDeployment(best.parallelism, count, chunk_tokens)
        attained = colocated_attainment(problem, best.parallelism, chunk_tokens, rate, count)
        grown = ColocatedDeployment(best.parallelism, count + 1)
        if attained >= problem.objective.target or not grown.fits(cluster):
            return deployment, attained
        count += 1
