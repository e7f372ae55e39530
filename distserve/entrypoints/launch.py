"""``distserve launch``: bring up a cluster on Ray and serve it over gRPC and HTTP until SIGINT or
SIGTERM, then drain in-flight requests and stop every actor it started.

Settings come from, in increasing precedence: ``--config`` (engine sections, ``cluster:`` pools,
``server:``), ``--plan`` (the placement planner's output: the same sections plus its ``plan:``
notes), then flags.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from typing import Any

import ray

from distserve.cluster.api import AsyncCluster
from distserve.cluster.config import POOL_FLAGS, ClusterConfig
from distserve.core.config import read_sections
from distserve.entrypoints.server import Server
from distserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger("distserve.launch")

SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)}


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Section-wise merge of two config mappings (one level of nesting deeper for ``cluster:``)."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_launch_config(
    config: str | None = None, plan: str | None = None, flags: dict[str, Any] | None = None
) -> tuple[ClusterConfig, ServerConfig]:
    """The cluster and server configs from the files and flags (flat names, as the CLI passes them)."""
    data: dict[str, Any] = {}
    for path in (config, plan):
        if path:
            data = _merge(data, read_sections(path))
    source = plan or config or "flags"
    notes = data.pop("plan", None)
    if notes:
        logger.info("plan %s: %s", plan, notes)
    flags = dict(flags or {})
    if "role" in flags:
        raise ValueError("each pool sets its instances' role: leave --role out, use the pool flags")
    server = dict(data.pop("server", None) or {})
    unknown = sorted(set(server) - SERVER_FIELDS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)} in section 'server'")
    server.update({key: flags.pop(key) for key in SERVER_FIELDS & set(flags)})
    pools = data.get("cluster") or {}
    for dest, role, key in POOL_FLAGS:
        if dest in flags:
            pools = _merge(pools, {role: {key: flags.pop(dest)}})
    if pools:
        if any(role in pools for role in ("prefill", "decode")) and "colocated" in pools:
            raise ValueError("give prefill/decode pools or a colocated pool, not both")
        data["cluster"] = pools
    return ClusterConfig.from_dict(data, source, **flags), ServerConfig(**server)


async def serve(cluster_config: ClusterConfig, server_config: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM; then drain for up to ``drain_timeout`` (a second signal stops
    waiting) and shut the cluster down."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    server: Server | None = None

    def on_signal(signum: int) -> None:
        if not stopping.is_set():
            logger.info("%s: draining in-flight requests, then stopping", signal.Signals(signum).name)
            stopping.set()
        elif server is not None:
            logger.info("%s again: cancelling in-flight requests", signal.Signals(signum).name)
            server.frontend.end_drain()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    cluster = await AsyncCluster.start(cluster_config)
    try:
        server = Server(cluster, server_config)
        await server.start()
        logger.info("gRPC listening on %s", server.grpc_address)
        logger.info("HTTP listening on %s (OpenAI API at /v1, Prometheus at /metrics)", server.http_url)
        await stopping.wait()
    finally:
        if server is not None:
            await server.stop(server_config.drain_timeout)
        await cluster.shutdown()
        logger.info("stopped")


def launch(cluster_config: ClusterConfig, server_config: ServerConfig) -> None:
    """Start (or join, with ``ray_address``) a Ray cluster and serve on it until a signal."""
    if server_config.ray_address:
        ray.init(address=server_config.ray_address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(serve(cluster_config, server_config))
    finally:
        ray.shutdown()  # stops the Ray processes this launch started; a joined cluster keeps running
