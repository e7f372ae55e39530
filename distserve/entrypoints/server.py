"""A serving process's servers: the gRPC and the OpenAI-compatible HTTP server in front of one
cluster, started together and drained together."""

from __future__ import annotations

import logging

from distserve.cluster.api import AsyncCluster
from distserve.cluster.background_loop import BackgroundLoop
from distserve.cluster.config import ClusterConfig
from distserve.cluster.instance import InstanceInfo
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

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.grpc.port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://{self.config.host}:{self.http_port}"

    async def start(self) -> None:
        self.grpc = GrpcServer(self.frontend, self.config)
        await self.grpc.start()
        self._http_runner, self.http_port = await start_http_server(self.frontend, self.config)
        logger.info("serving %s: gRPC on %s, HTTP on %s", self.frontend.model_name, self.grpc_address, self.http_url)

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Refuse new requests, let those in flight finish for up to ``drain_timeout`` seconds, then
        cancel the rest (which frees their KV blocks) and close both servers."""
        if self.grpc is not None:
            await self.grpc.set_not_serving()
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
