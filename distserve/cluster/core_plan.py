"""Which CPU cores a cluster's instances run on, and which are left to its serving processes.

``cpu_cores: auto`` (the default) gives every CPU worker cores of its own when the machine has
enough: ``cpu_threads`` cores each where the pool sets it, else an equal share of the cores left.
The instances take the highest cores; what they leave (the lowest) goes to the serving processes
(``distserve launch`` binds itself, its servers, its orchestrator and the Ray processes it starts
there), as vLLM's CPU backend keeps one core for its API server. When the workers take every core,
the serving processes share them all; when they would need more cores than there are, nothing is
bound. A pool with a core list or ``none`` keeps it, and its cores are not given to another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distserve.cluster.config import ClusterConfig
from distserve.core.cpu_cores import UNBOUND, format_cores, parse_cores
from distserve.core.role import Role


@dataclass
class CorePlan:
    config: ClusterConfig  # every pool's cpu_cores resolved: a core list or "none"
    serving: list[int] | None  # the serving processes' cores; None: they share every core
    oversubscribed: bool = False  # the workers would need more cores than there are: none bound

    def describe(self) -> list[str]:
        """One line per instance and one for the serving processes, for the start-up log."""
        lines = self.instance_lines()
        if self.oversubscribed:
            lines.append("the workers' threads outnumber the cores: none bound")
        serving = "every core" if self.serving is None else f"cores {format_cores(self.serving)}"
        lines.append(f"serving processes: {serving}")
        return lines

    def instance_lines(self) -> list[str]:
        """Where each instance's workers run."""
        lines = []
        for name, engine in self.config.instance_configs():
            parallel = engine.parallel
            threads = parallel.worker_threads()
            where = "unbound" if parallel.cpu_cores in UNBOUND else f"cores {parallel.cpu_cores}"
            lines.append(f"{name}: {where}" + (f", {threads} torch thread(s) per worker" if threads else ""))
        return lines


def plan_cores(config: ClusterConfig, available: list[int], cpu: bool = True) -> CorePlan:
    """Resolve every ``auto`` pool of ``config`` to cores out of ``available`` (or to ``none`` when
    the instances do not run on the CPU, ``cpu`` False)."""
    parallel = {pool.role: config.engine_config(pool).parallel for pool in config.pools}
    auto = [pool for pool in config.pools if parallel[pool.role].cpu_cores == "auto"]
    if not auto:
        return CorePlan(config, None)
    unbound = _with_cores(config, {pool.role: "none" for pool in auto})
    if not cpu:
        return CorePlan(unbound, None)
    taken = {
        core
        for pool in config.pools
        if pool not in auto and parallel[pool.role].cpu_cores not in UNBOUND
        for core in parse_cores(parallel[pool.role].cpu_cores)
    }
    free = [core for core in available if core not in taken]
    # (pool, workers, threads per worker or None for an equal share)
    demands = [
        (pool, pool.instances * parallel[pool.role].world_size, parallel[pool.role].cpu_threads) for pool in auto
    ]
    fixed = sum(workers * threads for _, workers, threads in demands if threads)
    shared_workers = sum(workers for _, workers, threads in demands if not threads)
    share = (len(free) - fixed) // shared_workers if shared_workers else 0
    need = fixed + share * shared_workers
    if need > len(free) or (shared_workers and share < 1):
        return CorePlan(unbound, None, oversubscribed=True)
    assigned, next_core = {}, len(free) - need
    for pool, workers, threads in demands:
        count = workers * (threads or share)
        assigned[pool.role] = format_cores(free[next_core : next_core + count])
        next_core += count
    serving = free[: len(free) - need] or None
    return CorePlan(_with_cores(config, assigned), serving)


def _with_cores(config: ClusterConfig, cores: dict[Role, str]) -> ClusterConfig:
    pools = [
        dataclasses.replace(pool, options={**pool.options, "cpu_cores": cores[pool.role]})
        if pool.role in cores
        else pool
        for pool in config.pools
    ]
    return dataclasses.replace(config, pools=pools)
