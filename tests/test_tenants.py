"""Tenants kept apart, and the model's own defaults: ``cache_salt`` keeps prefix caches apart (an
instance's cache, the prefix tier, the router's record), cached-token counts are reported only by a
server started to report them, a model's generation_config.json defaults the sampling fields a
request leaves out as vLLM computes them, and role changes need the admin key."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from conftest import IndexTierClient, random_prompts, wait_nothing_in_use
from transformers import AutoTokenizer

from distserve import LLM, SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.cluster.instance import InstanceInfo
from distserve.cluster.routing import InstanceState, Router
from distserve.core.config import EngineConfig, ModelConfig
from distserve.core.request_limits import RequestLimits
from distserve.core.role import Role
from distserve.core.sequence import Sequence
from distserve.entrypoints.client import CallError, Client
from distserve.entrypoints.grpc_server import sampling_params_from_proto
from distserve.entrypoints.openai_protocol import parse_chat, parse_completion
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ADMIN_KEY_ENV, API_KEY_ENV, ServerConfig
from distserve.kv_connector.tier import TierConnector
from distserve.model_executor.model_loader import default_sampling_params, resolve_model
from distserve.model_executor.tiny_models import ensure_tiny_model
from distserve.scheduling.block_manager import BlockManager
from distserve.v1 import distserve_pb2 as pb

MODEL = "tenant-llama"  # the served name of tiny-llama with sampling defaults of its own
KEY, ADMIN = "sk-tenant", "sk-tenant-admin"
BLOCK = 16  # the default block size the server runs with
# A generation_config.json that sets sampling defaults; presence_penalty is none of transformers'
# own fields, and vLLM reads it all the same.
GENERATION_CONFIG = {
    "temperature": 0.7, "top_k": 5, "top_p": 0.8, "repetition_penalty": 1.3, "presence_penalty": 0.5,
    "max_new_tokens": 12, "do_sample": True,
}  # fmt: skip
LIMITS = RequestLimits().resolve(1024)
# What vLLM 0.32's ModelConfig.get_diff_sampling_param computes from it (checked against vLLM's
# own code below where it is installed).
DEFAULTS = {
    "temperature": 0.7, "top_k": 5, "top_p": 0.8, "repetition_penalty": 1.3, "presence_penalty": 0.5,
    "max_tokens": 12,
}  # fmt: skip
SAMPLING_DEFAULTS = {k: v for k, v in DEFAULTS.items() if k != "max_tokens"}
VLLM_PYTHON = Path.home() / "venvs" / "vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama, its generation_config.json setting sampling defaults."""
    directory = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(ensure_tiny_model("tiny-llama"), directory)
    path = directory / "generation_config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k != "_from_model_config"}
    path.write_text(json.dumps({**config, **GENERATION_CONFIG}, indent=2))
    return directory


# -- the model's defaults, as vLLM computes them -------------------------------------------------


def test_the_generation_configs_defaults_are_vllms(model_dir, tmp_path):
    resolved = resolve_model(ModelConfig(model=str(model_dir)))
    assert default_sampling_params(resolved, "auto") == DEFAULTS
    assert default_sampling_params(resolved, "vllm") == {}
    assert default_sampling_params(resolve_model(ModelConfig(model="tiny-llama")), "auto") == {}  # sets none
    with pytest.raises(ValueError, match="generation_config"):
        ModelConfig(generation_config="model")

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / "generation_config.json").write_text(json.dumps({"repetition_penalty": 5.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: repetition_penalty must be in \(0, 2\]"):
        default_sampling_params(resolve_model(ModelConfig(model=str(bad))), "auto")

    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed at {VLLM_PYTHON}: checked against the figures it gave")
    # vLLM's own function, on the same directory, without a server or an engine.
    script = (
        "import json, sys, types\n"
        "from vllm.config.model import ModelConfig\n"
        "for source in ('auto', 'vllm'):\n"
        "    c = types.SimpleNamespace(generation_config=source, override_generation_config={}, hf_config_path=None,\n"
        "        model=sys.argv[1], trust_remote_code=False, _hf_config_revision=None, revision=None,\n"
        "        code_revision=None, config_format='auto', hf_token=None)\n"
        "    c.try_get_generation_config = types.MethodType(ModelConfig.try_get_generation_config, c)\n"
        "    print(json.dumps(ModelConfig.get_diff_sampling_param(c)))\n"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, str(model_dir)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    auto, vllm = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert (auto, vllm) == (DEFAULTS, {})


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_fields_a_request_leaves_out_take_the_models_defaults_on_each_path(tokenizer):
    """HTTP: absent or null; gRPC: proto3 presence (a field sent at zero is set); max_tokens: the
    route's own rule, with the model's max_new_tokens where vLLM reads it."""
    frontend = SimpleNamespace(
        model_name=MODEL,
        tokenizer=tokenizer,
        max_model_len=1024,
        max_request_tokens=1024,
        sampling_defaults=DEFAULTS,
        limits=LIMITS,
    )
    completion = parse_completion(frontend, {"prompt": "hi"}).jobs[0].params
    assert completion == SamplingParams(max_tokens=16, **SAMPLING_DEFAULTS)  # 16: a completion's, as in vLLM
    given = {"prompt": "hi", "temperature": 0, "top_k": None, "repetition_penalty": 1.0, "max_tokens": 3}
    completion = parse_completion(frontend, given).jobs[0].params
    assert completion == SamplingParams(
        **{**SAMPLING_DEFAULTS, "temperature": 0, "repetition_penalty": 1.0}, max_tokens=3
    )
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(frontend, chat).jobs[0].params == SamplingParams(**DEFAULTS)  # max_new_tokens: 12
    frontend.max_request_tokens = len(parse_chat(frontend, chat).jobs[0].prompt) + 5
    assert parse_chat(frontend, chat).jobs[0].params.max_tokens == 5  # the room left, being less
    assert parse_chat(frontend, {**chat, "max_completion_tokens": 40}).jobs[0].params.max_tokens == 40

    assert sampling_params_from_proto(pb.SamplingParams(), LIMITS, DEFAULTS) == SamplingParams(**DEFAULTS)
    sent = sampling_params_from_proto(pb.SamplingParams(temperature=0, top_k=0, max_tokens=3), LIMITS, DEFAULTS)
    assert sent == SamplingParams(**{**DEFAULTS, "temperature": 0, "top_k": 0, "max_tokens": 3})
    assert sampling_params_from_proto(pb.SamplingParams(), LIMITS) == SamplingParams()


# -- cache_salt: prefixes shared only within a salt -----------------------------------------------


def test_salted_prompts_share_no_block_in_the_instance_cache_or_the_tier():
    bm = BlockManager(num_blocks=32, block_size=4)
    client = IndexTierClient(capacity=16)
    bm.tier = tier = TierConnector(bm, client)
    tokens = list(range(10, 27))  # 17 tokens: 4 full blocks may come from a cache

    def run(salt: str | None, save: bool = False) -> tuple[int, int]:
        """(prompt tokens found cached, of them from the tier) of a request; ``save``: its blocks join the tier."""
        seq = Sequence(tokens, SamplingParams(cache_salt=salt))
        bm.allocate(seq)
        client.full = not save
        meta = tier.build_connector_meta()  # None: nothing to load or save
        if meta is not None:
            tier.update_connector_output(meta, 0.0)
        bm.free(seq)
        return seq.num_cached_tokens, 4 * len(meta.loads) if meta is not None else 0

    assert run("tenant-a", save=True) == (0, 0)
    assert run("tenant-b") == run(None) == (0, 0)  # A's blocks are in both caches, under A's salt
    assert run("tenant-a") == (16, 0)  # from the instance's own cache
    bm.set_prefix_caching(False)  # forget it: only the tier holds A's prefix now
    bm.set_prefix_caching(True)
    assert run("tenant-b") == run(None) == (0, 0)
    assert run("tenant-a") == (16, 16)
    assert bm.num_free_blocks == bm.num_blocks


def _instance(name: str) -> InstanceState:
    info = InstanceInfo(name, Role.COLOCATED, 1, 1, 100, BLOCK, 100, 0, 0, 0, 0, 0, 0, 0, None)
    return InstanceState(name, Role.COLOCATED, None, info, EngineConfig())


def test_the_router_counts_a_prefix_only_under_its_salt():
    router = Router(BLOCK)
    router.use_tier(capacity_blocks=64)
    a, b = _instance("a"), _instance("b")
    prompt = list(range(200))
    assert router.pick_prefill([a, b], prompt[:160], 170, cache_salt="tenant-a") == (a, 160)
    a.prefill_tokens = 160
    # b computes the whole prompt under another salt (or none), not the 40 the tier would spare it.
    assert router.pick_prefill([a, b], prompt, 210, cache_salt="tenant-b") == (b, 200)
    b.prefill_tokens = 0
    assert router.pick_prefill([a, b], prompt, 210) == (b, 200)
    b.prefill_tokens = 0
    assert router.pick_prefill([a, b], prompt, 210, cache_salt="tenant-a") == (b, 40)  # the tier has A's
    router.remember(_instance("decode"), list(range(1000, 1064)), cache_salt="tenant-c")
    assert router.pick_prefill([a, b], list(range(1000, 1080)), 90, cache_salt="tenant-c")[1] == 16
    assert router.pick_prefill([a, b], list(range(1000, 1080)), 90, cache_salt="tenant-d")[1] == 80


def test_salted_block_keys_agree_between_processes():
    """The tier is shared between processes: a salted key must not depend on the process's string hashing."""
    code = "from distserve.cluster.prefix_index import PrefixIndex as P; print(P(4).block_hashes(list(range(12)), 'a'))"
    keys = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(keys) == 1


# -- a cluster serving the model with defaults, salts, reported cached tokens and an admin key ----


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    config = make_cluster_config(
        model=str(model_dir), num_kv_blocks=64, prefill={}, decode={}, dtype="float32", kv_tier_space=0.01
    )
    server_config = ServerConfig(
        grpc_port=0, http_port=0, api_key=KEY, admin_key=ADMIN, enable_prompt_tokens_details=True,
        served_model_name=MODEL,
    )  # fmt: skip
    with BackgroundServer(config, server_config) as server:
        yield server


@pytest.fixture
def client(server):
    with Client(server.grpc_address, api_key=KEY) as client:
        yield client


def _http(server, path: str, body: dict | None = None, key: str = KEY) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.http_url}{path}",
        data=data,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_tenant_sees_cached_tokens_only_for_prefixes_sent_under_its_salt(server, client):
    first, second = random_prompts([40, 40], server.frontend.vocab_size, seed=11)
    cached = (40 - 1) // BLOCK * BLOCK  # the full blocks before the last token

    def grpc_cached(salt: str | None) -> tuple[int, list[int]]:
        done = client.complete(first, max_tokens=4, temperature=0, cache_salt=salt)
        return done.usage.cached_prompt_tokens, done.token_ids

    def http_cached(salt: str | None) -> tuple[int, list[int]]:
        body = {"model": MODEL, "prompt": second, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        status, reply = _http(server, "/v1/completions", {**body, "cache_salt": salt})
        assert status == 200, reply
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"], reply["choices"][0]["token_ids"]

    for run in (grpc_cached, http_cached):
        owner, tokens = run("tenant-a")
        assert owner == 0
        # Another tenant, or a request without a salt, finds nothing of it, in either instance's
        # cache or the tier; the tokens are the same whatever the salt.
        assert run("tenant-b") == run(None) == (0, tokens)
        assert run("tenant-a") == (cached, tokens)
        assert run("tenant-b") == (cached, tokens)  # its own, from the run above
    messages = [{"role": "user", "content": " river" * 40}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    replies = [_http(server, "/v1/chat/completions", {**chat, "cache_salt": salt})[1] for salt in ("c", "d", "c")]
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in replies] == [False, False, True]
    status, refused = _http(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": "a/b"})
    assert status == 400 and refused["error"]["param"] == "cache_salt"
    with pytest.raises(CallError) as refusal:
        client.complete("hi", cache_salt="x" * 129)
    assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refusal.value.details()
    wait_nothing_in_use(server.info, server.frontend)


def test_requests_leaving_sampling_fields_out_sample_with_the_models_defaults(server, client, model_dir, capsys):
    (prompt,) = random_prompts([24], server.frontend.vocab_size, seed=12)
    left_out = client.complete(prompt, max_tokens=10, seed=7)
    explicit = client.complete(prompt, max_tokens=10, seed=7, **SAMPLING_DEFAULTS)
    servers_own = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, presence_penalty=0.0)
    plain = client.complete(prompt, max_tokens=10, seed=7, **servers_own)
    assert left_out.token_ids == explicit.token_ids != plain.token_ids
    assert client.complete(prompt, ignore_eos=True).usage.completion_tokens == 12  # max_new_tokens

    body = {"model": MODEL, "prompt": prompt, "seed": 7, "max_tokens": 10, "return_token_ids": True}
    assert _http(server, "/v1/completions", body)[1]["choices"][0]["token_ids"] == left_out.token_ids
    body = {"model": MODEL, "prompt": prompt, "ignore_eos": True}
    assert _http(server, "/v1/completions", body)[1]["usage"]["completion_tokens"] == 16  # a completion's default
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    assert _http(server, "/v1/chat/completions", body)[1]["usage"]["completion_tokens"] == 12

    # The defaults in effect: on /v1/models, in ClusterInfo and in `distserve status`.
    assert _http(server, "/v1/models")[1]["data"][0]["default_sampling_params"] == DEFAULTS
    shown = client.cluster_info().default_sampling_params
    assert {field.name: value for field, value in shown.ListFields()} == pytest.approx(DEFAULTS)
    from distserve.cli import main

    assert main(["status", "--server", server.grpc_address, "--api-key", KEY]) == 0
    assert (
        "sampling defaults (the model's generation_config.json): max_tokens 12, temperature 0.7, top_k 5, "
        "top_p 0.8, presence_penalty 0.5, repetition_penalty 1.3"
    ) in capsys.readouterr().out

    # The Python API: defaults when no params are given (vLLM's LLM.get_default_sampling_params);
    # under generation_config vllm, SamplingParams' own, which sample as the server's own above.
    for source, defaults in (("auto", DEFAULTS), ("vllm", {})):
        llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, generation_config=source)
        try:
            assert llm.get_default_sampling_params() == SamplingParams(**defaults)
            if source == "vllm":
                seeded = dataclasses.replace(llm.get_default_sampling_params(), seed=7, max_tokens=10)
                assert llm.generate(prompt, seeded)[0].output_token_ids == plain.token_ids
        finally:
            llm.shutdown()
    assert EngineConfig.from_flat(generation_config="vllm").model.generation_config == "vllm"


# -- the admin key ---------------------------------------------------------------------------------


def test_role_changes_need_the_admin_key(server, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    with Client(server.grpc_address, api_key=KEY) as client:
        names = [i.name for i in client.cluster_info().instances]
        prefill = next(i.name for i in client.cluster_info().instances if i.role == pb.ROLE_PREFILL)
        refusals = [
            ({"api_key": KEY}, grpc.StatusCode.PERMISSION_DENIED, "the API key does not allow changing the cluster"),
            ({"api_key": KEY, "admin_key": "sk-guess"}, grpc.StatusCode.UNAUTHENTICATED, "the admin key is wrong"),
            ({}, grpc.StatusCode.UNAUTHENTICATED, "send 'authorization: Bearer <admin key>'"),
        ]
        for options, code, message in refusals:
            with Client(server.grpc_address, **options) as caller, pytest.raises(CallError) as refusal:
                caller.set_roles({names[1]: "colocated"}, role_control="fixed")
            assert refusal.value.code() == code and message in refusal.value.details()
        assert not client.cluster_info().role_changes  # nothing changed
    # The admin key alone: it changes roles, and is taken for every other call too.
    with Client(server.grpc_address, admin_key=ADMIN) as admin:
        assert list(admin.set_roles({prefill: "prefill"}, role_control="fixed").changes) == []  # its role already
        assert admin.complete("hi", max_tokens=2).usage.completion_tokens == 2
    done = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "roles", "--server", server.grpc_address, "--control", "fixed"],
        capture_output=True, text=True, timeout=60, env={**os.environ, API_KEY_ENV: KEY},
    )  # fmt: skip
    assert done.returncode == 1 and "PERMISSION_DENIED" in done.stderr
    with pytest.raises(ValueError, match="admin_key must differ from api_key"):
        ServerConfig(api_key="same", admin_key="same")
    monkeypatch.setenv(ADMIN_KEY_ENV, "from-env")
    assert ServerConfig().admin_key == "from-env" and ServerConfig(admin_key="given").admin_key == "given"
