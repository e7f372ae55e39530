"""The API servers past the first (``cluster.api_servers``): each a Ray actor process with its own
orchestrator and gRPC and HTTP listeners on the first server's ports (SO_REUSEPORT: the kernel
spreads connections over them), admitting, routing and streaming its own requests. Instances send
each request's outputs to the server that sent it, so no token passes through another process.

Every server reports its status (``ApiServerStatus``) to the cluster's directory, so any of them
lists them all. The first server manages the cluster and watches the others: one that dies loses only its own
streams (their clients see the connection end; the instances end its requests once its lease
passes, freeing their KV) and is started again, under a new server id, on the same ports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from distserve.cluster.api import AsyncCluster
from distserve.cluster.config import ClusterConfig
from distserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0  # how often the first server checks the others are alive
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ApiServerStatus:
    index: int  # 0: the first, which manages the cluster
    server_id: str  # what instances know its requests by; new at each start
    pid: int
    num_pending_requests: int  # requests in flight through it
    cpu_seconds: float  # its process's user + system CPU time so far
    restarts: int = 0


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@ray.remote(num_cpus=0)
class ApiServer:
    def __init__(
        self,
        index: int,
        cluster_config: ClusterConfig,
        server_config: ServerConfig,
        directory: Any,
        restarts: int,
        server_cls: type,
    ) -> None:
        """``server_cls``: ``entrypoints.server.Server``, the listeners it runs (given, not
        imported: that module starts these)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.index = index
        self.restarts = restarts
        self.server_id = f"api-{index}-{uuid.uuid4().hex[:8]}"
        self.cluster_config = cluster_config
        self.server_config = server_config
        self.directory = directory
        self.server_cls = server_cls
        self.server = None

    async def start(self) -> int:
        """Join the cluster and listen; returns this process's pid."""
        cluster = await AsyncCluster.join(self.cluster_config, self.directory, self.server_id)
        self.server = self.server_cls(cluster, self.server_config)
        self.server.frontend.server_index, self.server.frontend.restarts = self.index, self.restarts
        await self.server.start()
        return os.getpid()

    async def alive(self) -> bool:
        return True

    async def stop(self, drain_timeout: float = 0.0) -> None:
        if self.server is not None:
            await self.server.stop(drain_timeout)
            await self.server.cluster.shutdown()
            self.server = None


class ApiServerGroup:
    """The first server's view of the others: starts them on its bound ports, starts again any
    that dies, and reports their status."""

    def __init__(
        self, cluster_config: ClusterConfig, server_config: ServerConfig, directory: Any, server_cls: type
    ) -> None:
        self.server_cls = server_cls
        self.cluster_config = cluster_config
        self.server_config = server_config  # with the ports the first server bound
        self.directory = directory
        self.actors: dict[int, Any] = {}
        self.restarts: dict[int, int] = {}
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        indices = range(1, self.cluster_config.api_servers)
        await asyncio.gather(*(self._start(i) for i in indices))
        self._watch = asyncio.create_task(self._watch_servers())

    async def _start(self, index: int) -> None:
        actor = ApiServer.options(name=f"{self.cluster_config.name}-api-{index}-{time.monotonic_ns()}").remote(
            index, self.cluster_config, self.server_config, self.directory, self.restarts.get(index, 0), self.server_cls
        )
        pid = await asyncio.wait_for(actor.start.remote(), START_TIMEOUT_S)
        self.actors[index] = actor
        logger.info("API server %d serving (pid %d)", index, pid)

    async def _watch_servers(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for index, actor in list(self.actors.items()):
                try:
                    await asyncio.wait_for(actor.alive.remote(), WATCH_INTERVAL_S * 5)
                except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
                    logger.error("API server %d is gone (%s): starting it again", index, type(e).__name__)
                    self.restarts[index] = self.restarts.get(index, 0) + 1
                    ray.kill(actor)
                    try:
                        await self._start(index)
                    except Exception:
                        logger.exception("API server %d could not start again", index)

    async def stop(self, drain_timeout: float) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(a.stop.remote(drain_timeout) for a in self.actors.values()), return_exceptions=True)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
