"""What ``distserve launch`` refuses before Ray or any instance starts (one sentence, exit status 2,
in seconds), what its servers refuse when a port was taken after that check, and how a plan's dummy
weights give way to a real model named by ``--model``."""

import asyncio
import json
import logging
import shutil
import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
import ray
import torch

from distserve.cli import main
from distserve.cluster.api import AsyncCluster
from distserve.cluster.config import ClusterConfig
from distserve.entrypoints.frontend import Frontend
from distserve.entrypoints.grpc_server import GrpcServer
from distserve.entrypoints.launch import load_launch_config
from distserve.entrypoints.openai_server import start_http_server
from distserve.entrypoints.server_config import ServerConfig
from distserve.model_executor.tiny_models import ensure_tiny_model
from placement.deployment import Deployment
from placement.latency import Parallelism
from placement.plan_file import plan_document, write_plan


@pytest.fixture
def models(tmp_path):
    """Broken copies of a tiny model: ``{name}`` in a test's arguments is the path of one."""
    tiny = ensure_tiny_model("tiny-llama")
    no_weights = shutil.copytree(tiny, tmp_path / "no-weights", ignore=shutil.ignore_patterns("*.safetensors"))
    bad_tokenizer = shutil.copytree(tiny, tmp_path / "bad-tokenizer")
    (bad_tokenizer / "tokenizer.json").write_text("{not json")
    (tmp_path / "not-a-model").mkdir()
    odd_heads = shutil.copytree(tiny, tmp_path / "odd-heads")  # 18-wide heads: no 8-bit cache takes them
    config = json.loads((odd_heads / "config.json").read_text())
    (odd_heads / "config.json").write_text(json.dumps({**config, "head_dim": 18}))
    mixed_kv = tmp_path / "mixed-kv.yaml"
    mixed_kv.write_text("model: {model: tiny-llama}\ncluster: {prefill: {kv_cache_dtype: int8}, decode: {}}\n")
    return {
        "missing": tmp_path / "missing" / "model",
        "not_a_model": tmp_path / "not-a-model",
        "no_weights": no_weights,
        "bad_tokenizer": bad_tokenizer,
        "odd_heads": odd_heads,
        "mixed_kv": mixed_kv,
    }


@pytest.mark.timeout(120)  # a check that stopped refusing would go on to start Ray and serve
@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--model", "{missing}"], "model directory '{missing}' does not exist"),
        (["--model", "{not_a_model}"], "{not_a_model} has no config.json"),
        (["--model", "{no_weights}"], "{no_weights} has no weights (*.safetensors or *.bin)"),
        (["--model", "{bad_tokenizer}"], "the tokenizer in {bad_tokenizer} does not load"),
        (["--prefill-tensor-parallel-size", "3"], "4 attention heads, which 3 tensor parallel ranks cannot share"),
        (["--decode-pipeline-parallel-size", "3"], "3 pipeline stages need at least 3 decoder layers"),
        (["--prefill-tensor-parallel-size", "0"], "the prefill pool: tensor_parallel_size must be at least 1"),
        (["--max-model-len", "5000"], "exceeds the model's context of 1024 positions"),
        (
            ["--model", "opt-175b", "--load-format", "dummy", "--decode-instances", "4", "--device", "cpu"],
            "GiB is available",
        ),
        (["--grpc-port", "7411", "--port", "7411"], "the gRPC and the HTTP server cannot share port 7411"),
        (
            ["--config", "{mixed_kv}"],
            "a hand-over copies KV blocks as they are: every pool must use the same cache.kv_cache_dtype, got "
            "prefill int8 and decode auto",
        ),
        (
            ["--model", "{odd_heads}", "--kv-cache-dtype", "int8"],
            "an int8 KV cache needs a head size that is a multiple of 4, not 18",
        ),
    ],
    ids=[
        "missing-dir",
        "not-a-model",
        "no-weights",
        "bad-tokenizer",
        "heads-over-tp",
        "layers-over-pp",
        "pool-option",
        "context",
        "memory",
        "same-ports",
        "pools-kv-dtypes",
        "kv-dtype-head-size",
    ],
)
def test_launch_refuses_before_ray_starts(args, phrase, models, capsys, monkeypatch):
    ray_inits = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: ray_inits.append(a))  # another test's Ray may be up
    args = [arg.format(**models) for arg in args]
    code = main(["launch", "--grpc-port", "0", "--http-port", "0", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("distserve: error: ") and len(err.splitlines()) == 1, err
    assert phrase.format(**models) in err
    assert not ray_inits


@pytest.fixture(params=["socket", "grpc"])
def busy_port(request):
    """A port another server listens on: a plain socket, or a gRPC server with gRPC's default
    SO_REUSEPORT, whose port a second server with that default would share without a word."""
    if request.param == "socket":
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            yield listener.getsockname()[1]
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        yield port
        server.stop(None)


@pytest.mark.parametrize("flag, server", [("--grpc-port", "gRPC"), ("--port", "HTTP")])
def test_a_busy_port_is_refused_in_seconds_before_ray_starts(busy_port, flag, server):
    other = "--port" if flag == "--grpc-port" else "--grpc-port"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "launch", "--model", "tiny-llama", flag, str(busy_port), other, "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"distserve: error: the {server} port {busy_port} on 127.0.0.1 is already in use: stop the server there "
        f"or pick another port with {flag}"
    ]
    assert time.monotonic() - start < 10  # no torch, transformers or Ray before the ports are checked


def test_the_servers_refuse_a_port_taken_after_the_check(busy_port):
    config = ServerConfig(grpc_port=busy_port, http_port=busy_port)

    async def bind() -> None:
        frontend = Frontend(AsyncCluster(ClusterConfig()), config)  # a cluster never started: only binding here
        with pytest.raises(OSError, match=f"the gRPC port {busy_port} on 127.0.0.1 is already in use"):
            GrpcServer(frontend, config)
        with pytest.raises(OSError, match=f"the HTTP port {busy_port} on 127.0.0.1 is already in use"):
            await start_http_server(frontend, config)

    asyncio.run(bind())


def test_a_plan_for_a_preset_loads_the_weights_of_the_model_given_by_flag(tmp_path, caplog):
    plan = tmp_path / "plan.yaml"
    deployment = Deployment("high", Parallelism(1, 1), 1, Parallelism(1, 1), 1)
    write_plan(plan, plan_document(deployment, "opt-13b", 8, 2048, 64, {"rate": 1.0}))
    model_dir = str(ensure_tiny_model("tiny-llama"))

    def model_settings(**flags):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="distserve.launch"):
            cluster, _ = load_launch_config(plan=str(plan), flags=flags)
        return cluster.engine.model.model, cluster.engine.model.load_format

    assert model_settings() == ("opt-13b", "dummy")  # the preset the plan was made for: shapes only
    assert model_settings(model=model_dir) == (model_dir, "auto")
    assert f"load_format dummy is for opt-13b: loading the weights of {model_dir}" in caplog.text
    assert model_settings(model=model_dir, load_format="dummy") == (model_dir, "dummy")
    assert f"serving random weights in the shape of {model_dir}, not its own" in caplog.text
    assert model_settings(model="llama-2-7b") == ("llama-2-7b", "dummy")  # another preset: still dummy


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8"])
def test_the_memory_estimate_counts_the_kv_cache_at_the_size_of_its_blocks(cache_dtype):
    """Weights in the model's dtype and ``num_kv_blocks`` blocks of the cache's, as the engine
    allocates them: an 8-bit cache's codes and scales."""
    from distserve.core.config import EngineConfig
    from distserve.entrypoints.preflight import _bytes_needed
    from distserve.kv_transfer.plan import KVCacheShape
    from distserve.model_executor.model_loader import resolve_model

    engine = EngineConfig.from_flat(model="tiny-llama", block_size=16, num_kv_blocks=100, kv_cache_dtype=cache_dtype)
    resolved = resolve_model(engine.model)
    shape = resolved.shape
    blocks = KVCacheShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, 16, torch.bfloat16, cache_dtype)
    expected = shape.num_params * 2 + 100 * blocks.bytes_per_block
    assert _bytes_needed(engine, resolved, torch.bfloat16) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_launch_refuses_more_ranks_than_gpus(capsys, monkeypatch):
    ray_inits = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: ray_inits.append(a))
    gpus = torch.cuda.device_count()
    code = main(["launch", "--grpc-port", "0", "--http-port", "0", "--decode-instances", str(gpus)])
    assert code == 2
    assert f"the instances have {gpus + 1} ranks, one GPU each, but this machine has {gpus} GPU(s)" in (
        capsys.readouterr().err
    )
    assert not ray_inits
