"""``distserve launch``: bring up a cluster on Ray and serve it over gRPC and HTTP until SIGINT or
SIGTERM, then drain in-flight requests and stop every actor it started.

Settings come from, in increasing precedence: ``--config`` (engine sections, ``cluster:`` pools,
``server:``), ``--plan`` (the placement planner's output: the same sections plus its ``plan:``
notes), then flags. Before Ray starts, ``preflight`` checks the ports, the model and the resources.

Torch, transformers and Ray are imported where they are first needed, not at the top: importing
them takes seconds, and a bad setting is refused before that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distserve.cluster.config import LIMITS_FLAGS, LOCAL_PREFILL_FLAGS, POOL_FLAGS, ROLE_CONTROL_FLAGS, ClusterConfig
from distserve.core.config import read_sections
from distserve.entrypoints.preflight import preflight
from distserve.entrypoints.server_config import ServerConfig
from distserve.model_executor.tiny_models import TINY_MODELS

if TYPE_CHECKING:
    from distserve.cluster.api import AsyncCluster

logger = logging.getLogger("distserve.launch")

SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)}
START_KILL_INTERVAL_S = 0.5  # how often instances still starting are killed again after a signal


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Section-wise merge of two config mappings (one level of nesting deeper for ``cluster:``)."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _has_weights(model: str) -> bool:
    """A model directory or a built-in tiny model: names whose weights exist here (a preset's do not)."""
    return Path(model).expanduser().is_dir() or model.lower() in TINY_MODELS


def _drop_dummy_of_other_model(data: dict[str, Any], flags: dict[str, Any], source: str) -> None:
    """A file's ``load_format: dummy`` was meant for the file's model (the planner writes it for a
    preset): when ``--model`` names another model that has weights, those weights load."""
    section = data.get("model") or {}
    model = flags.get("model")
    if (
        model is None
        or not isinstance(section, dict)
        or "load_format" in flags
        or section.get("load_format") != "dummy"
        or section.get("model") == model
        or not _has_weights(model)
    ):
        return
    data["model"] = {key: value for key, value in section.items() if key != "load_format"}
    logger.info("%s: its load_format dummy is for %s: loading the weights of %s", source, section.get("model"), model)


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
    _drop_dummy_of_other_model(data, flags, source)
    server = dict(data.pop("server", None) or {})
    unknown = sorted(set(server) - SERVER_FIELDS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)} in section 'server'")
    server.update({key: flags.pop(key) for key in SERVER_FIELDS & set(flags)})
    pools = data.get("cluster") or {}
    for dest, role, key in POOL_FLAGS:
        if dest in flags:
            pools = _merge(pools, {role: {key: flags.pop(dest)}})
    for section, section_flags in (("role_control", ROLE_CONTROL_FLAGS), ("local_prefill", LOCAL_PREFILL_FLAGS)):
        if not isinstance(pools.get(section), dict | None):  # a mode alone: the mapping it stands for
            pools = {**pools, section: {"mode": pools[section]}}
        for dest, key in section_flags:
            if dest in flags:
                pools = _merge(pools, {section: {key: flags.pop(dest)}})
    for key in ("api_servers", "server_lease"):
        if key in flags:
            pools = {**pools, key: flags.pop(key)}
    for dest, key in LIMITS_FLAGS:
        if dest in flags:
            pools = _merge(pools, {"limits": {key: flags.pop(dest)}})
    if pools:
        if any(role in pools for role in ("prefill", "decode")) and "colocated" in pools:
            raise ValueError("give prefill/decode pools or a colocated pool, not both")
        data["cluster"] = pools
    cluster = ClusterConfig.from_dict(data, source, **flags)
    model = cluster.engine.model
    if model.load_format == "dummy" and _has_weights(model.model):
        logger.warning("load_format dummy: serving random weights in the shape of %s, not its own", model.model)
    return cluster, ServerConfig(**server)


class _Interrupted(BaseException):
    """A signal before serving began. A BaseException, so that no ``except Exception`` on the way
    mistakes it for a failure to report."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT and SIGTERM for the whole of a launch.

    Until Ray starts a signal ends the launch at once: nothing needs stopping. From ``hold()`` on it
    is only recorded and passed to the listener (the event loop, once it runs), so neither Ray's
    start nor an instance's load is cut short half-way, which leaves Ray processes behind.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal
        self.listener: Callable[[int], None] | None = None
        self._holding = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if not self._holding:
            raise _Interrupted(signum)
        if self.listener is not None:
            self.listener(signum)

    def install(self) -> None:
        """(Re)install the handlers: ``ray.init`` puts its own on SIGTERM."""
        for signum in self.SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def hold(self) -> None:
        self._holding = True

    def raise_received(self) -> None:
        if self.received is not None:
            raise _Interrupted(self.received)

    def __enter__(self) -> _Signals:
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


async def _start_cluster(config: ClusterConfig, stopping: asyncio.Event, signals: _Signals) -> AsyncCluster:
    """The started cluster. A signal while its instances load kills them (an actor is killed by its
    name, again until the start gives up, as one may be created after a kill) and raises _Interrupted."""
    import ray

    from distserve.cluster.api import AsyncCluster

    start = asyncio.create_task(AsyncCluster.start(config))
    stop = asyncio.create_task(stopping.wait())
    await asyncio.wait([start, stop], return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not stopping.is_set():
        return start.result()
    if not start.done():
        logger.info("%s: stopping the instances that are starting", signal.Signals(signals.received).name)
    names = [name for name, _ in config.instance_configs()]
    while not start.done():
        for name in names:
            try:
                ray.kill(ray.get_actor(name))
            except ValueError:  # not created yet, or already gone
                pass
        await asyncio.wait([start], timeout=START_KILL_INTERVAL_S)
    if start.exception() is None:  # it had just finished loading
        await start.result().shutdown()
    raise _Interrupted(signals.received)


async def _serve(cluster_config: ClusterConfig, server_config: ServerConfig, signals: _Signals) -> None:
    """Serve until SIGINT/SIGTERM; then drain for up to ``drain_timeout`` (a second signal stops
    waiting) and shut the cluster down. A signal before serving began raises _Interrupted."""
    from distserve.entrypoints.server import Server

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    server: Server | None = None
    serving = False

    def on_signal(signum: int) -> None:
        if not serving:  # still starting: the start sees ``stopping`` and stops what it started
            stopping.set()
        elif not stopping.is_set():
            logger.info("%s: draining in-flight requests, then stopping", signal.Signals(signum).name)
            stopping.set()
        else:
            logger.info("%s again: cancelling in-flight requests", signal.Signals(signum).name)
            server.frontend.end_drain()

    def listener(signum: int) -> None:
        if not loop.is_closed():  # once closed (serving is over), a signal is only recorded
            loop.call_soon_threadsafe(on_signal, signum)

    signals.listener = listener
    signals.raise_received()
    logger.info(
        "starting %d instances of %s", len(cluster_config.instance_configs()), cluster_config.engine.model.model
    )
    cluster = await _start_cluster(cluster_config, stopping, signals)
    try:
        server = Server(cluster, server_config)
        await server.start()
        signals.raise_received()
        serving = True
        logger.info("gRPC listening on %s", server.grpc_address)
        logger.info("HTTP listening on %s (OpenAI API at /v1, Prometheus at /metrics)", server.http_url)
        await stopping.wait()
    finally:
        if server is not None:
            await server.stop(server_config.drain_timeout)
        await cluster.shutdown()
        logger.info("stopped")


def _check_start_and_serve(cluster_config: ClusterConfig, server_config: ServerConfig, signals: _Signals) -> None:
    preflight(cluster_config, server_config)
    import ray

    signals.hold()
    try:
        if server_config.ray_address:
            logger.info("joining the Ray cluster at %s", server_config.ray_address)
            ray.init(address=server_config.ray_address, log_to_driver=False)
        else:
            cluster_config = _place_cores(cluster_config)
            logger.info("starting a local Ray")
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        signals.install()
        signals.raise_received()
        asyncio.run(_serve(cluster_config, server_config, signals))
    finally:
        ray.shutdown()  # stops the Ray processes this launch started; a joined cluster keeps running


def _place_cores(config: ClusterConfig) -> ClusterConfig:
    """Give the instances cores of their own (``cpu_cores: auto``) and bind this process to the
    cores they leave: its servers, its orchestrator and the Ray processes it is about to start."""
    import torch

    from distserve.cluster.core_plan import plan_cores
    from distserve.core.cpu_cores import available_cores, bind_process

    device = config.engine.model.device  # Ray is not up yet to say (``cluster_device``): this machine's
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    plan = plan_cores(config, available_cores(), cpu=on_cpu)
    for line in plan.describe() if on_cpu else []:
        logger.info("cores: %s", line)
    if plan.serving:
        bind_process(plan.serving)
    return plan.config


def launch(cluster_config: ClusterConfig, server_config: ServerConfig) -> None:
    """Check the settings, start (or join, with ``ray_address``) a Ray cluster and serve on it until
    a signal. A signal before serving begins stops what has started and exits with 128 + its number."""
    try:
        with _Signals() as signals:
            _check_start_and_serve(cluster_config, server_config, signals)
    except _Interrupted as e:
        logger.warning("%s during start-up: stopped before serving", signal.Signals(e.signum).name)
        raise SystemExit(128 + e.signum) from None
