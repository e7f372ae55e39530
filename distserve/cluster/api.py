"""The Python API of a serving cluster: ``AsyncCluster`` (asyncio) and ``Cluster`` (blocking).

from distserve import Cluster, SamplingParams
with Cluster(model="tiny-llama", prefill={"instances": 1}, decode={"instances": 2}) as cluster:
    outputs = cluster.generate(["Hello", "The cache"], SamplingParams(max_tokens=16))

async with AsyncCluster(model="tiny-llama") as cluster:
    async for output in cluster.generate("Hello", SamplingParams(max_tokens=16)):
        print(output.text)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

from distserve.cluster.background_loop import BackgroundLoop
from distserve.cluster.config import CLUSTER_KEYS, ROLES, ClusterConfig
from distserve.cluster.instance import InstanceInfo
from distserve.cluster.orchestrator import Orchestrator
from distserve.cluster.role_changes import RoleChangeRecord
from distserve.core.config import EngineConfig
from distserve.core.outputs import RequestOutput
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.core.slo import RequestSLO
from distserve.engine.ray_runtime import ensure_ray_async
from distserve.kv_tier.store import TierInfo


def make_cluster_config(config: ClusterConfig | None = None, **options: Any) -> ClusterConfig:
    """A config, or one from keyword options: flat engine options plus ``prefill=``, ``decode=``
    or ``colocated=`` dicts of pool options (``instances`` and per-pool engine overrides)."""
    if config is not None:
        if options:
            raise ValueError("pass either config or keyword options, not both")
        return config
    pools = {key: options.pop(key) for key in (*ROLES, *CLUSTER_KEYS) if key in options}
    return ClusterConfig.from_pools(EngineConfig.from_flat(**options), pools)


class _Start:
    """``AsyncCluster.start``: on the class, ``await AsyncCluster.start(config or options)`` makes a
    cluster and starts it; on a cluster, ``await cluster.start()`` starts that one (were it only a
    classmethod, that call would quietly start a second cluster of default options)."""

    def __get__(self, cluster: AsyncCluster | None, cls: type[AsyncCluster]) -> Callable[..., Awaitable[AsyncCluster]]:
        if cluster is not None:
            return cluster._start

        async def make_and_start(config: ClusterConfig | None = None, **options: Any) -> AsyncCluster:
            return await cls(config, **options)._start()

        return make_and_start


class AsyncCluster:
    """A cluster on the running event loop: made from a ``ClusterConfig`` or the keyword options of
    ``make_cluster_config``, and serving between ``start()`` and ``shutdown()``, or inside
    ``async with``. The instances run on the current Ray cluster (a local one is started if none runs)."""

    start = _Start()

    def __init__(self, config: ClusterConfig | None = None, **options: Any) -> None:
        self.config = make_cluster_config(config, **options)
        self.orchestrator = Orchestrator(self.config)
        self.state = "new"  # then "running", then "shut down"

    @classmethod
    async def join(cls, config: ClusterConfig, directory: Any, server_id: str) -> AsyncCluster:
        """The cluster of ``config`` that another API server manages, served as server ``server_id``:
        started, its instances the ones ``directory`` lists; shutting it down leaves them serving."""
        cluster = cls(config)
        cluster.orchestrator = Orchestrator(cluster.config, server_id, directory)
        return await cluster._start()

    async def _start(self) -> AsyncCluster:
        if self.state != "new":
            raise RuntimeError(f"this AsyncCluster is {self.state}: a cluster starts once")
        await ensure_ray_async()
        try:
            await self.orchestrator.start()
        except BaseException:  # failed or cancelled: stop what did start
            self.state = "shut down"
            await self.orchestrator.shutdown()
            raise
        self.state = "running"
        return self

    def _check_running(self) -> None:
        if self.state == "new":
            raise RuntimeError(
                "this AsyncCluster is not started: use 'async with AsyncCluster(...) as cluster' or "
                "'await cluster.start()' first"
            )
        if self.state == "shut down":
            raise RuntimeError("this AsyncCluster is shut down: make a new one")

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        slo: RequestSLO | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving the iteration early cancels it. ``slo``: its
        own latency objectives, which adaptive role control judges it by. No ``params``: the model's
        sampling defaults (``generation_config``); params given are taken as they are, every field."""
        self._check_running()
        params = params or self.orchestrator.input_processor.default_params()
        return self.orchestrator.generate(prompt, params, request_id, priority, slo)

    async def info(self) -> list[InstanceInfo]:
        self._check_running()
        return await self.orchestrator.info()

    async def tier_info(self) -> list[TierInfo]:
        """Each node's prefix tier store (``cache.kv_tier_space``); none without a tier."""
        self._check_running()
        return await self.orchestrator.tier_info()

    async def set_roles(self, roles: dict[str, Role | str], role_control: str | None = None) -> list[RoleChangeRecord]:
        """Give instances (by name, as ``info()`` lists them) new roles while serving; returns once
        they serve them, a record per instance whose role changed. ``role_control``: "fixed" takes
        roles back from the controller, "adaptive" hands them to it. Raises RequestError, changing
        nothing, for an unknown instance, a layout that could not serve, or adaptive control
        without SLOs."""
        self._check_running()
        return await self.orchestrator.set_roles(roles, role_control)

    @property
    def role_changes(self) -> list[RoleChangeRecord]:
        """Every role change so far, by an operator or the controller, oldest first."""
        return list(self.orchestrator.roles.history)

    @property
    def role_verdicts(self) -> dict[str, int]:
        """How many of the role controller's judgements proposed a change or kept the layout, by why."""
        return dict(self.orchestrator.controller.verdicts)

    async def shutdown(self) -> None:
        """Stop every instance; nothing to do for a cluster not running."""
        if self.state == "running":
            self.state = "shut down"
            await self.orchestrator.shutdown()

    async def __aenter__(self) -> AsyncCluster:
        return await self._start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


class Cluster:
    """A blocking wrapper: the cluster's event loop runs on a thread of its own."""

    def __init__(self, config: ClusterConfig | None = None, **options: Any) -> None:
        self._loop = BackgroundLoop("distserve-cluster")
        self._run = self._loop.run
        try:
            self._async = self._run(AsyncCluster.start(config, **options))
        except BaseException:
            self._loop.stop()
            raise

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts concurrently to completion; final outputs in prompt order, a request of
        ``n`` samples' n in a row (by ``RequestOutput.index``). No ``params``: the model's sampling
        defaults."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")

        async def final(prompt, p) -> list[RequestOutput]:
            last: dict[int, RequestOutput] = {}
            async for output in self._async.generate(prompt, p):
                last[output.index] = output
            return [last[i] for i in sorted(last)]

        async def run_all() -> list[RequestOutput]:
            finals = await asyncio.gather(*(final(prompt, p) for prompt, p in zip(prompts, params)))
            return [output for outputs in finals for output in outputs]

        return self._run(run_all())

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One request's outputs as they come."""
        iterator = self._async.generate(prompt, params)
        try:
            while True:
                try:
                    yield self._run(iterator.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(iterator.aclose())

    def info(self) -> list[InstanceInfo]:
        return self._run(self._async.info())

    def tier_info(self) -> list[TierInfo]:
        return self._run(self._async.tier_info())

    def set_roles(self, roles: dict[str, Role | str], role_control: str | None = None) -> list[RoleChangeRecord]:
        return self._run(self._async.set_roles(roles, role_control))

    @property
    def role_changes(self) -> list[RoleChangeRecord]:
        return self._async.role_changes

    @property
    def role_verdicts(self) -> dict[str, int]:
        return self._async.role_verdicts

    def shutdown(self) -> None:
        if self._loop.running:
            try:
                self._run(self._async.shutdown())
            finally:
                self._loop.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
