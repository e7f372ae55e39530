"""What one request may ask for (``cluster.limits``), the same over gRPC, HTTP and the Python API:
each limit refused one over it with INVALID_ARGUMENT / 400 / RequestError naming the limit and its
option, and served at it; huge values refused at once, before any work; routing load and admission
counting every sample; ``priority`` refused where no queue reads it; and a request id reused right
after a cancel served in full."""

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
import yaml
from conftest import wait_nothing_in_use
from test_routing import instance

from distserve.cluster.api import AsyncCluster, make_cluster_config
from distserve.cluster.config import ClusterConfig
from distserve.cluster.request_table import RequestState
from distserve.cluster.routing import Router
from distserve.core.errors import RequestError
from distserve.core.request_limits import RequestLimits
from distserve.core.sampling_params import SamplingParams
from distserve.entrypoints.client import Client, Completion, make_request
from distserve.entrypoints.launch import load_launch_config
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.v1 import distserve_pb2 as pb

LIMITS = {
    "max_n": 4,
    "max_tokens": 64,
    "max_prompt_bytes": 512,
    "max_stop": 2,
    "max_bad_words": 2,
    "max_word_chars": 6,
    "max_logit_bias": 3,
    "max_token_ids": 3,
    "max_structured_output_bytes": 32,
}
# limit -> (request field, sampling at the limit, one over it); a prompt's are its text.
CASES = {
    "max_n": ("n", {"n": 4}, {"n": 5}),
    "max_tokens": ("max_tokens", {"max_tokens": 64}, {"max_tokens": 65}),
    "max_prompt_bytes": ("prompt", "é" * 256, "é" * 256 + "a"),  # 2 bytes a character in UTF-8
    "max_stop": ("stop", {"stop": ["zq1", "zq2"]}, {"stop": ["zq1", "zq2", "zq3"]}),
    "max_bad_words": ("bad_words", {"bad_words": ["qq", "ww"]}, {"bad_words": ["qq", "ww", "ee"]}),
    "max_word_chars": ("stop", {"stop": ["zqzqzq"]}, {"stop": ["zqzqzqz"]}),
    "max_logit_bias": (
        "logit_bias",
        {"logit_bias": {5: 1.0, 6: 1.0, 7: 1.0}},
        {"logit_bias": {5: 1, 6: 1, 7: 1, 8: 1}},
    ),
    "max_token_ids": ("allowed_token_ids", {"allowed_token_ids": [5, 6, 7]}, {"allowed_token_ids": [5, 6, 7, 8]}),
    "max_structured_output_bytes": (
        "structured_outputs",
        {"structured_outputs": {"choice": ["a" * 16, "b" * 16]}},
        {"structured_outputs": {"choice": ["a" * 16, "b" * 17]}},
    ),
}
PROMPT = "The cache"
FAST_S = 0.5  # "at once": a refusal that did any work per sample, token or byte would take seconds


@pytest.fixture(scope="module")
def server(ray_cluster):
    config = make_cluster_config(model="tiny-llama", num_kv_blocks=128, prefill={}, decode={}, limits=LIMITS)
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_address) as client:
        yield client


@pytest.fixture(autouse=True)
def nothing_left_in_use(request):
    """After each test that served, no block, queue entry or admission is left in use."""
    yield
    if "server" in request.fixturenames:
        server = request.getfixturevalue("server")
        wait_nothing_in_use(server.info, server.frontend)


def _request(case, at_limit: bool) -> tuple[str, dict]:
    """(prompt, sampling) of a case, at its limit or one over."""
    _, at, over = CASES[case]
    value = at if at_limit else over
    if isinstance(value, str):
        return value, {"max_tokens": 2}
    return PROMPT, {"max_tokens": 2, **value}


def _grpc(client, prompt, request_id="", priority=0, timeout=60, **sampling) -> list[pb.GenerateResponse]:
    return list(client.stub.Generate(make_request(prompt, request_id, priority, **sampling), timeout=timeout))


def _http(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{server.http_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _http_body(prompt: str, sampling: dict) -> dict:
    body = {"prompt": prompt, **sampling}
    if "logit_bias" in body:  # JSON's keys are strings
        body["logit_bias"] = {str(token): value for token, value in body["logit_bias"].items()}
    return body


def _python(server, prompt, priority=0, **sampling) -> dict:
    """The Python API's final output of each sample."""

    async def run():
        finals = {}
        async for output in server.cluster.generate(prompt, SamplingParams(**sampling), priority=priority):
            finals[output.index] = output
        return finals

    return server.loop.run(run())


def _names_limit(message: str, limit: str) -> None:
    assert f"cluster.limits.{limit}" in message and f"--limits-{limit.replace('_', '-')}" in message, message
    assert f"over the limit of {LIMITS[limit]} " in message, message


# -- each limit, on each surface ------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_grpc_refuses_one_over_each_limit_and_serves_at_it(client, case):
    prompt, sampling = _request(case, at_limit=False)
    with pytest.raises(grpc.RpcError) as error:
        _grpc(client, prompt, **sampling)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _names_limit(error.value.details(), case)
    prompt, sampling = _request(case, at_limit=True)
    chunks = _grpc(client, prompt, **sampling)
    ends = [c for c in chunks if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert len(ends) == sampling.get("n", 1)


@pytest.mark.parametrize("case", CASES)
def test_http_refuses_one_over_each_limit_with_400_and_serves_at_it(server, case):
    field = CASES[case][0]
    status, reply = _http(server, "/v1/completions", _http_body(*_request(case, at_limit=False)))
    assert status == 400, reply
    assert reply["error"]["param"] == field and reply["error"]["type"] == "invalid_request_error"
    _names_limit(reply["error"]["message"], case)
    prompt, sampling = _request(case, at_limit=True)
    status, reply = _http(server, "/v1/completions", _http_body(prompt, sampling))
    assert status == 200, reply
    assert len(reply["choices"]) == sampling.get("n", 1)


@pytest.mark.parametrize("case", CASES)
def test_python_api_refuses_one_over_each_limit_and_serves_at_it(server, case):
    prompt, sampling = _request(case, at_limit=False)
    with pytest.raises(RequestError) as error:
        _python(server, prompt, **sampling)
    _names_limit(str(error.value), case)
    prompt, sampling = _request(case, at_limit=True)
    finals = _python(server, prompt, **sampling)
    assert len(finals) == sampling.get("n", 1) and all(out.finished for out in finals.values())


def test_the_other_lists_and_chat_are_bound_too(server, client):
    """stop_token_ids share max_token_ids, bad words max_word_chars; a chat's rendered conversation
    is the prompt max_prompt_bytes bounds, and so is /tokenize's and Tokenize's text."""
    others = [({"stop_token_ids": [5, 6, 7, 8]}, "max_token_ids"), ({"bad_words": ["x" * 7]}, "max_word_chars")]
    for sampling, limit in others:
        with pytest.raises(grpc.RpcError) as error:
            _grpc(client, PROMPT, max_tokens=2, **sampling)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        _names_limit(error.value.details(), limit)
    messages = [{"role": "user", "content": "x" * 512}]
    status, reply = _http(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert (status, reply["error"]["param"]) == (400, "messages")
    _names_limit(reply["error"]["message"], "max_prompt_bytes")
    status, reply = _http(server, "/tokenize", {"prompt": "x" * 513})
    assert (status, reply["error"]["param"]) == (400, "prompt")
    with pytest.raises(grpc.RpcError) as error:
        client.stub.Tokenize(pb.TokenizeRequest(text="x" * 513), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _names_limit(error.value.details(), "max_prompt_bytes")
    status, reply = _http(server, "/tokenize", {"prompt": "x" * 512})
    assert status == 200 and reply["count"] > 0


# -- huge values, refused before any work ----------------------------------------------------------


@pytest.mark.parametrize("n", [10**6, 2**62])
def test_a_huge_n_is_refused_at_once_and_the_server_serves_on(server, client, n):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        _grpc(client, PROMPT, max_tokens=2, n=n)
    grpc_seconds = time.monotonic() - started
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _names_limit(error.value.details(), "max_n")
    started = time.monotonic()
    status, reply = _http(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": n})
    http_seconds = time.monotonic() - started
    assert (status, reply["error"]["param"]) == (400, "n")
    started = time.monotonic()
    with pytest.raises(RequestError, match="cluster.limits.max_n"):
        _python(server, PROMPT, max_tokens=2, n=n)
    python_seconds = time.monotonic() - started
    print(f"n={n} refused in {grpc_seconds:.3f} s (gRPC), {http_seconds:.3f} s (HTTP), {python_seconds:.3f} s (Python)")
    assert max(grpc_seconds, http_seconds, python_seconds) < FAST_S
    assert Completion.from_chunks(_grpc(client, PROMPT, max_tokens=4, ignore_eos=True)).usage.completion_tokens == 4
    wait_nothing_in_use(server.info, server.frontend)


def test_huge_max_tokens_is_refused_naming_its_limit_not_clipped(server, client):
    with pytest.raises(grpc.RpcError) as error:
        _grpc(client, PROMPT, max_tokens=2**62)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _names_limit(error.value.details(), "max_tokens")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, reply = _http(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 10**9})
    assert (status, reply["error"]["param"]) == (400, "max_completion_tokens")
    # Left out, a chat's max_tokens is what is left of the context, within the limit.
    status, reply = _http(server, "/v1/chat/completions", {**chat, "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == LIMITS["max_tokens"]


def test_a_64_mib_prompt_is_refused_without_being_tokenized(server, client):
    """Tokenizing takes about a second per MiB: a refusal in well under a second never tokenized it.
    The Python API takes it whole; gRPC and HTTP take messages up to 16 and 32 MiB, so theirs is 15 MiB."""
    huge = "x" * 64 * 2**20
    started = time.monotonic()
    with pytest.raises(RequestError) as error:
        _python(server, huge, max_tokens=2)
    python_seconds = time.monotonic() - started
    _names_limit(str(error.value), "max_prompt_bytes")
    large = "y" * 15 * 2**20
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as rpc_error:
        _grpc(client, large, max_tokens=2)
    grpc_seconds = time.monotonic() - started
    assert rpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    started = time.monotonic()
    status, reply = _http(server, "/v1/completions", {"prompt": large, "max_tokens": 2})
    http_seconds = time.monotonic() - started
    assert (status, reply["error"]["param"]) == (400, "prompt")
    print(f"refused in {python_seconds:.3f} s (64 MiB, Python), {grpc_seconds:.3f} s (15 MiB, gRPC), ", end="")
    print(f"{http_seconds:.3f} s (15 MiB, HTTP)")
    assert max(python_seconds, grpc_seconds, http_seconds) < FAST_S
    assert Completion.from_chunks(_grpc(client, PROMPT, max_tokens=4, ignore_eos=True)).usage.completion_tokens == 4


def test_a_15_mib_logit_bias_is_refused_before_it_is_read_entry_by_entry(client):
    """A message's lists are measured before they are copied and checked: converting this one's
    million logit biases alone took 1.3 s."""
    request = make_request(PROMPT, max_tokens=2, logit_bias={token: 1.0 for token in range(10**6)})
    assert request.ByteSize() > 14 * 2**20
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        list(client.stub.Generate(request, timeout=60))
    seconds = time.monotonic() - started
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _names_limit(error.value.details(), "max_logit_bias")
    print(f"refused in {seconds:.3f} s, the message's transfer and parsing included")
    assert seconds < 2 * FAST_S


# -- admission and routing count every sample ------------------------------------------------------


def test_admission_counts_each_sample(server, client):
    stream = client.stub.Generate(make_request(PROMPT, max_tokens=64, ignore_eos=True, n=3), timeout=60)
    next(stream)  # the request is in flight, its samples decoding
    try:
        assert server.frontend.num_pending == 3
    finally:
        stream.cancel()


def test_routing_load_counts_every_sample():
    params = SamplingParams(max_tokens=200, n=4)
    state = RequestState("r", None, list(range(3, 103)), params)
    assert state.load == 100 + 4 * 200  # the samples share the prompt's KV, each generates its own
    roomy, busy = instance("roomy", load_tokens=0, prefill_tokens=500), instance("busy", load_tokens=1000)
    state.routed(roomy, 100)
    assert roomy.load_tokens == 900
    state.unassign()
    assert roomy.load_tokens == 0
    # busy (1000 of 1600 tokens taken) prefills nothing: it gets a request of one sample, but has no
    # room for four, which go where there is room though more prompt tokens wait there.
    router = Router(16)
    one = RequestState("one", None, list(range(3, 103)), SamplingParams(max_tokens=200))
    assert router.pick_prefill([busy, roomy], one.prompt_token_ids, one.load)[0] is busy
    assert router.pick_prefill([busy, roomy], state.prompt_token_ids, state.load)[0] is roomy


# -- priority ------------------------------------------------------------------------------------


def test_priority_is_refused_unless_the_priority_policy_runs(server, client):
    with pytest.raises(grpc.RpcError) as error:
        _grpc(client, PROMPT, priority=3, max_tokens=2)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority 3" in error.value.details() and "--policy priority" in error.value.details()
    status, reply = _http(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "priority": 3})
    assert status == 400 and "--policy priority" in reply["error"]["message"]
    with pytest.raises(RequestError, match="priority -1 is used only under the priority scheduling policy"):
        _python(server, PROMPT, priority=-1, max_tokens=2)
    assert _grpc(client, PROMPT, priority=0, max_tokens=2)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    status, _ = _http(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "priority": 0})
    assert status == 200


def test_priority_is_served_under_the_priority_policy(ray_cluster):
    async def scenario():
        async with AsyncCluster(model="tiny-llama", num_kv_blocks=32, policy="priority", colocated={}) as cluster:
            outputs = [o async for o in cluster.generate(PROMPT, SamplingParams(max_tokens=3), priority=7)]
            assert outputs[-1].finished and len(outputs[-1].output_token_ids) == 3

    asyncio.run(scenario())


# -- request ids -----------------------------------------------------------------------------------


def test_an_id_reused_right_after_a_cancel_is_served_in_full(server, client):
    """The old run's last outputs (its abort's end, a hand-over on its way) must not reach the new
    request of the same id: each reuse gets its whole greedy text, under its own id."""
    wanted = Completion.from_chunks(_grpc(client, "Another prompt", max_tokens=16, temperature=0, ignore_eos=True))
    assert len(wanted.token_ids) == 16
    for attempt in range(6):
        old = client.stub.Generate(
            make_request(PROMPT, "reused", max_tokens=64, ignore_eos=True, temperature=0), timeout=60
        )
        if attempt % 2:
            next(old)  # cancelled decoding; else, cancelled before its first token
        old.cancel()
        chunks = _grpc(client, "Another prompt", "reused", max_tokens=16, temperature=0, ignore_eos=True)
        got = Completion.from_chunks(chunks)
        assert {c.request_id for c in chunks} == {"reused"}
        assert (got.token_ids, got.text, got.finish_reason) == (wanted.token_ids, wanted.text, "length"), attempt

    async def python_api():  # the same through the Python API, where nothing lies between the two
        for _ in range(3):
            old = server.cluster.generate(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True), "again")
            await old.__anext__()
            await old.aclose()
            params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
            outputs = [o async for o in server.cluster.generate("Another prompt", params, "again")]
            assert {o.request_id for o in outputs} == {"again"}
            assert outputs[-1].output_token_ids == wanted.token_ids

    server.loop.run(python_api())


def test_two_live_requests_may_share_an_id(client):
    """Ids need not be unique: each request is run under its own, its outputs carry the client's."""
    streams = [
        client.stub.Generate(make_request(prompt, "twin", max_tokens=8, temperature=0, ignore_eos=True), timeout=60)
        for prompt in ("First prompt", "Second prompt")
    ]
    got = [Completion.from_chunks(stream) for stream in streams]
    for prompt, completion in zip(("First prompt", "Second prompt"), got):
        alone = Completion.from_chunks(_grpc(client, prompt, max_tokens=8, temperature=0, ignore_eos=True))
        assert (completion.request_id, completion.token_ids) == ("twin", alone.token_ids)


# -- configuration -------------------------------------------------------------------------------


def test_limits_defaults_and_the_model_s_context():
    limits = RequestLimits()
    assert (limits.max_n, limits.max_stop, limits.max_logit_bias, limits.max_structured_output_bytes) == (
        16,
        64,
        1024,
        65536,
    )
    resolved = limits.resolve(1024)
    assert (resolved.max_tokens, resolved.max_prompt_bytes) == (1024, 16 * 1024)
    own = RequestLimits(max_tokens=100, max_prompt_bytes=7)
    assert own.resolve(1024) == own
    # A character is up to 4 bytes: the prompt is encoded only when its length alone cannot settle it.
    resolved.check_prompt("ü" * 4096)  # 8192 bytes
    with pytest.raises(RequestError, match="the prompt has 16386 bytes, over the limit of 16384 bytes"):
        resolved.check_prompt("ü" * 8193)
    with pytest.raises(RequestError, match="the prompt has 16385 characters"):
        resolved.check_prompt("a" * 16385)
    resolved.check_prompt(list(range(10**5)))  # token ids are bounded by the context, as before


def test_limits_from_yaml_and_launch_flags(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"model": "tiny-llama"}, "cluster": {"limits": {"max_n": 2, "max_stop": 5}}})
    )
    assert ClusterConfig.from_yaml(path).limits == RequestLimits(max_n=2, max_stop=5)
    cluster, _ = load_launch_config(str(path), flags={"limits_max_n": 3, "limits_max_prompt_bytes": 4096})
    assert cluster.limits == RequestLimits(max_n=3, max_stop=5, max_prompt_bytes=4096)
    assert make_cluster_config(limits={"max_tokens": 9}).limits.max_tokens == 9
    with pytest.raises(ValueError, match="unknown limits option.*max_widgets"):
        make_cluster_config(limits={"max_widgets": 1})
    with pytest.raises(ValueError, match="limits.max_n must be an integer >= 1, got 0"):
        make_cluster_config(limits={"max_n": 0})
