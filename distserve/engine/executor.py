"""Executors run a batch on an instance's workers: in this process for one rank, or on Ray actors,
one per rank, kept together by a placement group.

A worker that dies or raises fails the whole instance at once: the other ranks may be waiting in
a collective for it, so they are killed rather than left to hang, and the caller gets an
``InstanceFailure`` naming the rank.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Protocol

from distserve.core.config import EngineConfig
from distserve.core.errors import InstanceFailure
from distserve.kv_transfer.plan import KVEndpoint
from distserve.kv_transfer.puller import RANK_PULLS
from distserve.model_executor.model_runner import BatchInput
from distserve.model_executor.worker import ModelOutput, Worker

if TYPE_CHECKING:
    from distserve.kv_transfer.plan import KVCacheShape
    from distserve.kv_transfer.shared_memory import SharedFile

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 30.0
# After one worker's call fails, how long the others' get to end: a killed worker's peers fail in
# their collectives at once, often before Ray reports the death that is the cause.
FAILURE_SETTLE_S = 2.0
WORKER_CONCURRENCY = RANK_PULLS + 3  # a step, the KV pulls a rank may hold, a send and a health ping beside them


class Executor(Protocol):
    num_blocks: int
    num_swap_blocks: int  # host blocks of ``cache.swap_space`` (on every rank)

    def execute_model(self, batch: BatchInput) -> ModelOutput: ...

    def check_health(self) -> None: ...

    def worker_processes(self) -> list[tuple[str, int]]:
        """(Ray node id, pid) of each rank's process apart from the caller's; none when the rank runs here."""

    def kv_endpoints(self, instance: Any) -> list[KVEndpoint]: ...

    def attach_tier(self, geometry: KVCacheShape, shared: SharedFile) -> None:
        """Every rank maps the node's prefix tier pool; raises where one cannot (the instance goes on)."""

    def call_kv(self, method: str, *args) -> list:
        """``KVTransfer.<method>`` on every rank; their answers in rank order."""

    def call_kv_on(self, calls: list[tuple[int, str, tuple]]) -> list:
        """``KVTransfer.<method>(*args)`` on each call's rank, all at once; their answers in order.
        A call that fails raises, and the instance goes on: a transfer's peer may be what failed."""

    def shutdown(self) -> None: ...


def cluster_device(config: EngineConfig) -> str:
    """The device workers will use: 'auto' means CUDA when the Ray cluster has GPUs."""
    import ray

    if config.model.device != "auto":
        return config.model.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def make_executor(config: EngineConfig, max_useful_tokens: int, name: str = "engine") -> Executor:
    if config.parallel.world_size == 1:
        return UniprocExecutor(config, max_useful_tokens)
    return RayExecutor(config, max_useful_tokens, name)


class UniprocExecutor:
    """A single rank in the calling process: no Ray, no process group."""

    def __init__(self, config: EngineConfig, max_useful_tokens: int) -> None:
        self.worker = Worker(config)
        self.worker.init_model()
        self.num_blocks = self.worker.determine_num_blocks(max_useful_tokens)
        self.num_swap_blocks = self.worker.num_swap_blocks()
        self.worker.init_kv_cache(self.num_blocks)

    def execute_model(self, batch: BatchInput) -> ModelOutput:
        return self.worker.execute_model(batch)

    def check_health(self) -> None:
        pass

    def worker_processes(self) -> list[tuple[str, int]]:
        return []

    def kv_endpoints(self, instance: Any) -> list[KVEndpoint]:
        """The only rank runs in the instance actor, which forwards ``kv`` calls to it."""
        return [KVEndpoint(instance, self.worker.kv_layout)]

    def call_kv(self, method: str, *args) -> list:
        return [self.worker.kv(method, *args)]

    def attach_tier(self, geometry: KVCacheShape, shared: SharedFile) -> None:
        self.worker.attach_tier(geometry, shared)

    def call_kv_on(self, calls: list[tuple[int, str, tuple]]) -> list:
        return [self.worker.kv(method, *args) for _, method, args in calls]

    def shutdown(self) -> None:
        pass


class RayExecutor:
    """One Ray actor per rank, in a placement group with one bundle per rank."""

    def __init__(self, config: EngineConfig, max_useful_tokens: int, name: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from distserve.engine.node_groups import NODE_ID_LABEL, ray_node_ids
        from distserve.engine.ray_runtime import cuda_actor_options, ensure_ray

        ensure_ray()
        self.name = name
        parallel = config.parallel
        device = cluster_device(config)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))
        gpus = 1 if device == "cuda" else 0
        bundle = {"CPU": parallel.worker_cpus, **({"GPU": gpus} if gpus else {})}
        strategy, selectors = parallel.placement_strategy, None
        if parallel.nodes:  # each stage's ranks on the node the plan names
            ids = ray_node_ids(parallel.nodes)
            selectors = [{NODE_ID_LABEL: ids[parallel.nodes[rank // parallel.tensor_parallel_size]]}
                         for rank in range(parallel.world_size)]  # fmt: skip
            strategy = "PACK" if len(set(parallel.nodes)) > 1 else strategy
        self.placement_group = placement_group(
            [bundle] * parallel.world_size, strategy=strategy, bundle_label_selector=selectors
        )
        self.workers: list[Any] = []
        try:
            ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise InstanceFailure(
                    f"{name}: Ray could not place {parallel.world_size} workers of {bundle} "
                    f"({strategy}) within {PLACEMENT_TIMEOUT_S:.0f} s; "
                    f"the cluster has {ray.available_resources()} available"
                )
            remote_worker = ray.remote(Worker)
            self.workers = [
                remote_worker.options(
                    max_concurrency=WORKER_CONCURRENCY,
                    num_cpus=parallel.worker_cpus,
                    num_gpus=gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, rank),
                    **cuda_actor_options(device),
                ).remote(config, rank)
                for rank in range(parallel.world_size)
            ]
            host, port = self._call([self.workers[0].create_store.remote()])[0]
            self._call_all("init_model", host, port)
            self.num_blocks = min(self._call_all("determine_num_blocks", max_useful_tokens))
            self.num_swap_blocks = min(self._call_all("num_swap_blocks"))
            self._call_all("init_kv_cache", self.num_blocks)
        except BaseException:
            self.shutdown()
            raise
        # The driver rank, TP rank 0 of the last stage, answers with the sampled tokens.
        self.driver_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size

    def _call_all(self, method: str, *args) -> list:
        return self._call([getattr(w, method).remote(*args) for w in self.workers])

    def _call(self, refs: list, timeout: float | None = None) -> list:
        """Results of one call per worker. Ray raises as soon as any worker dies or fails, even while
        the others still wait in a collective for it."""
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self._fail(f"no answer from the workers within {timeout} s")
        except Exception:  # RayActorError (a process died) or RayTaskError (a worker raised)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=FAILURE_SETTLE_S)
            errors = {}
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    errors[refs.index(ref)] = e
            if not errors:
                raise
            # A worker whose process died is the cause; its peers' collectives failed for want of it.
            dead = [rank for rank, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)]
            rank = min(dead or errors)
            self._fail(f"worker rank {rank} failed: {errors[rank]}")

    def _fail(self, reason: str) -> None:
        logger.error("%s: %s", self.name, reason)
        self.shutdown()
        raise InstanceFailure(f"{self.name}: {reason}")

    def execute_model(self, batch: BatchInput) -> ModelOutput:
        if not self.workers:
            raise InstanceFailure(f"{self.name}: the instance has shut down")
        return self._call_all("execute_model", batch)[self.driver_rank]

    def check_health(self) -> None:
        if not self.workers:
            raise InstanceFailure(f"{self.name}: the instance has shut down")
        self._call([w.ping.remote() for w in self.workers], timeout=HEALTH_TIMEOUT_S)

    def worker_processes(self) -> list[tuple[str, int]]:
        return self._call_all("process")

    def call_kv(self, method: str, *args) -> list:
        return self._call_all("kv", method, *args)

    def attach_tier(self, geometry: KVCacheShape, shared: SharedFile) -> None:
        import ray

        ray.get([w.attach_tier.remote(geometry, shared) for w in self.workers])

    def call_kv_on(self, calls: list[tuple[int, str, tuple]]) -> list:
        import ray

        return ray.get([self.workers[rank].kv.remote(method, *args) for rank, method, args in calls])

    def kv_endpoints(self, instance: Any) -> list[KVEndpoint]:
        layouts = self._call_all("kv", "describe")
        return [KVEndpoint(worker, layout) for worker, layout in zip(self.workers, layouts)]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        workers, self.workers = self.workers, []
        for worker in workers:
            ray.kill(worker)
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
