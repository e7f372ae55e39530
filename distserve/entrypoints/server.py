"""A serving process's servers: the gRPC and the OpenAI-compatible HTTP server in front of one
cluster, started together and drained together. With ``cluster.api_servers`` > 1 the first
process's also starts the others (``api_servers``) on its ports, and drains them with its own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

import ray

from distserve.cluster.api import AsyncCluster
from distserve.cluster.background_loop import BackgroundLoop
from distserve.cluster.config import ClusterConfig
from distserve.cluster.directory import STATUS_REPORT_S
from distserve.cluster.instance import InstanceInfo
from distserve.entrypoints.api_servers import ApiServerGroup
from distserve.entrypoints.frontend import Frontend
from distserve.entrypoints.grpc_server import GrpcServer
from distserve.entrypoints.openai_server import start_http_server
from distserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger(__name__)


class Server:
    def __init__(self, cluster: AsyncCluster, config: ServerConfig) -> None:
        self.cluster = cluster
        self.config = config
        self.frontend = Frontend(cluster, config)
        self.grpc: GrpcServer | None = None
        self._http_runner = None
        self.http_port: int | None = None
        self.shared_ports = cluster.config.api_servers > 1
        self.others: ApiServerGroup | None = None  # the first server's: the cluster's other API servers
        self._reporting: asyncio.Task | None = None

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.grpc.port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://{self.config.host}:{self.http_port}"

    async def start(self) -> None:
        self.grpc = GrpcServer(self.frontend, self.config, self.shared_ports)
        await self.grpc.start()
        self._http_runner, self.http_port = await start_http_server(self.frontend, self.config, self.shared_ports)
        orchestrator = self.cluster.orchestrator
        if self.shared_ports and orchestrator.manages:
            bound = dataclasses.replace(self.config, grpc_port=self.grpc.port, http_port=self.http_port)
            self.others = ApiServerGroup(self.cluster.config, bound, orchestrator.directory, type(self))
            await self.others.start()
        if self.shared_ports:  # listed by every server from its start on
            directory = orchestrator.directory
            await directory.report.remote(self.frontend.server_index, self.frontend.server_status())
            self._reporting = asyncio.create_task(self._report_status(directory))
        logger.info("serving %s: gRPC on %s, HTTP on %s (API server %s)", self.frontend.model_name,
                    self.grpc_address, self.http_url, orchestrator.server_id or 0)  # fmt: skip

    async def _report_status(self, directory: Any) -> None:
        """Tell the cluster's directory how this server is, so that every server lists them all."""
        while True:
            await asyncio.sleep(STATUS_REPORT_S)
            with contextlib.suppress(ray.exceptions.RayActorError):
                await directory.report.remote(self.frontend.server_index, self.frontend.server_status())

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Refuse new requests, let those in flight finish for up to ``drain_timeout`` seconds, then
        cancel the rest (which frees their KV blocks) and close both servers."""
        if self.grpc is not None:
            await self.grpc.set_not_serving()
        if self._reporting is not None:
            self._reporting.cancel()
        if self.others is not None:
            await self.others.stop(drain_timeout)
        if not await self.frontend.drain(drain_timeout):
            logger.warning(
                "%d requests still in flight after %.1f s: cancelling them", self.frontend.num_pending, drain_timeout
            )
        if self.grpc is not None:
            await self.grpc.stop(grace=None)
        if self._http_runner is not None:
            await self._http_runner.cleanup()


class BackgroundServer:
    """A cluster and its servers on an event loop of their own, for blocking callers (the demo,
    tests): ``with BackgroundServer(cluster_config, ServerConfig(grpc_port=0)) as s: s.grpc_address``."""

    def __init__(self, cluster_config: ClusterConfig, server_config: ServerConfig) -> None:
        self.loop = BackgroundLoop("distserve-server")
        self.cluster: AsyncCluster | None = None
        try:
            self.cluster = self.loop.run(AsyncCluster.start(cluster_config))
            self.server = Server(self.cluster, server_config)
            self.loop.run(self.server.start())
        except BaseException:
            self.close()
            raise

    @property
    def grpc_address(self) -> str:
        return self.server.grpc_address

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def http_port(self) -> int:
        return self.server.http_port

    @property
    def frontend(self) -> Frontend:
        return self.server.frontend

    def info(self) -> list[InstanceInfo]:
        return self.loop.run(self.cluster.info())

    def close(self, drain_timeout: float = 0.0) -> None:
        if not self.loop.running:
            return
        try:
            if self.cluster is not None:
                self.loop.run(self.server.stop(drain_timeout))
                self.loop.run(self.cluster.shutdown())
        finally:
            self.loop.stop()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
