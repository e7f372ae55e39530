"""What ``distserve launch`` checks before it starts Ray or any instance: its ports, the model
(directory, weights, tokenizer), the parallel sizes and KV cache dtype of every pool and, on a
machine of its own, the GPUs and memory the instances need. Each problem is one sentence
(ValueError or OSError) within seconds, rather than a Ray traceback after the instances have loaded.
"""

from __future__ import annotations

import errno
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from distserve.cluster.config import ClusterConfig
from distserve.core.config import EngineConfig
from distserve.core.kv_cache_dtype import check_kv_cache_dtype
from distserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger(__name__)

# torch and transformers are imported where the model is checked, not here: they take seconds to
# import, and a busy port is refused before that.
if TYPE_CHECKING:
    import torch

    from distserve.model_executor.model_loader import DtypeChoice, ResolvedModel

_PORT_FLAGS = {"gRPC": "--grpc-port", "HTTP": "--port"}
GIB = 2**30


def port_in_use(server: str, host: str, port: int) -> OSError:
    """The error of a ``server`` ("gRPC" or "HTTP") port that another process listens on."""
    return OSError(
        f"the {server} port {port} on {host} is already in use: stop the server there or pick another port "
        f"with {_PORT_FLAGS[server]}"
    )


def check_port(server: str, host: str, port: int) -> None:
    """Raise OSError unless ``server`` could listen on ``host:port`` (0: any free port) now."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        message = f"host '{host}' does not resolve ({e.strerror}): pass an address of this machine with --host"
        raise OSError(message) from None
    failure: OSError | None = None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As both servers do: a port whose old connections linger in TIME_WAIT is free; one that a
            # server listens on is not, with or without SO_REUSEPORT on its side.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
                probe.listen()
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise port_in_use(server, host, port) from None
                failure = e  # e.g. an IPv6 address where IPv6 is off: the servers skip it too
                continue
            return
    raise OSError(f"the {server} server cannot listen on {host}:{port} ({failure.strerror})")


def check_ports(config: ServerConfig) -> None:
    if config.grpc_port and config.grpc_port == config.http_port:
        raise ValueError(f"the gRPC and the HTTP server cannot share port {config.grpc_port}: give each its own")
    check_port("gRPC", config.host, config.grpc_port)
    check_port("HTTP", config.host, config.http_port)


def _first_line(error: BaseException) -> str:
    """transformers' errors run over many lines; the first one says what went wrong."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _resolve(engine: EngineConfig, loaded_tokenizers: set[Path]) -> ResolvedModel:
    """The model of ``engine``, once its directory, weights and tokenizer are known to be usable."""
    from distserve.model_executor.model_loader import load_tokenizer, resolve_model, weight_files

    name = engine.model.model
    if "/" in name and not Path(name).expanduser().exists():
        raise ValueError(
            f"model directory '{name}' does not exist (nothing is downloaded: pass a local Hugging Face "
            "model directory)"
        )
    try:
        resolved = resolve_model(engine.model)
    except (OSError, ValueError) as e:
        raise ValueError(_first_line(e)) from None
    model_dir = resolved.model_dir  # None for a preset, which has dummy weights only
    if model_dir is not None and engine.model.load_format == "auto" and not weight_files(model_dir):
        raise ValueError(
            f"{model_dir} has no weights (*.safetensors or *.bin): add them, or serve random weights of "
            "its architecture with --load-format dummy"
        )
    if resolved.tokenizer_dir not in loaded_tokenizers:
        try:
            load_tokenizer(resolved)
        except Exception as e:  # whatever breaks in a tokenizer's files, the user's remedy is the same
            raise ValueError(
                f"the tokenizer in {resolved.tokenizer_dir} does not load ({_first_line(e)}): "
                "fix its files or pass --tokenizer DIR"
            ) from None
        loaded_tokenizers.add(resolved.tokenizer_dir)
    return resolved


def _bytes_needed(engine: EngineConfig, resolved: ResolvedModel, dtype: torch.dtype) -> int:
    """An instance's weights and its smallest useful KV cache: ``num_kv_blocks`` when set, else
    enough for one request as long as the context, in the cache's dtype (the weights keep theirs)."""
    shape, cache = resolved.shape, engine.cache
    blocks = cache.num_kv_blocks or -(-resolved.max_model_len // cache.block_size)
    kv_per_token = shape.kv_bytes_per_token(dtype.itemsize, cache.kv_cache_dtype)
    return shape.num_params * dtype.itemsize + blocks * cache.block_size * kv_per_token


def check_instances(config: ClusterConfig, local: bool) -> None:
    """The model, tokenizer and parallel sizes of every pool; with ``local`` (a Ray of this
    machine's own) also the GPUs and host memory its instances need."""
    import torch

    from distserve.model_executor.model_loader import choose_dtype, resolve_device
    from distserve.parallel.ranks import check_parallel_config

    loaded_tokenizers: set[Path] = set()
    gpus = memory = 0
    dtypes: set[DtypeChoice] = set()
    for pool in config.pools:
        engine = config.engine_config(pool)
        resolved = _resolve(engine, loaded_tokenizers)
        check_parallel_config(resolved.hf_config, resolved.shape, engine.parallel)
        check_kv_cache_dtype(engine.cache.kv_cache_dtype, resolved.shape.head_dim)
        if not local:
            continue
        device = resolve_device(engine.model.device)
        choice = choose_dtype(engine.model.dtype, resolved.hf_config, device)
        dtypes.add(choice)
        if device.type == "cuda":
            gpus += pool.instances * engine.parallel.world_size  # one GPU per rank
        else:
            memory += pool.instances * _bytes_needed(engine, resolved, choice.dtype)
    for choice in dtypes:
        (logger.warning if choice.slow else logger.info)("dtype: %s", choice)
    if gpus > torch.cuda.device_count():
        raise ValueError(
            f"the instances have {gpus} ranks, one GPU each, but this machine has {torch.cuda.device_count()} "
            "GPU(s): use fewer instances or lower parallel sizes, or join a larger Ray cluster with --ray-address"
        )
    available = psutil.virtual_memory().available
    if memory > available:
        raise ValueError(
            f"the instances need at least {memory / GIB:.1f} GiB of memory for their weights and the KV cache "
            f"of one full-length request each, but {available / GIB:.1f} GiB is available: use a smaller model, "
            "fewer instances, a lower --max-model-len or --num-kv-blocks, or join a larger Ray cluster with "
            "--ray-address"
        )


def preflight(cluster: ClusterConfig, server: ServerConfig) -> None:
    """Every check that needs neither Ray nor a loaded model; raises ValueError or OSError."""
    check_ports(server)
    # On a joined Ray cluster the instances may run on other nodes: placing them is Ray's to judge.
    check_instances(cluster, local=not server.ray_address)
