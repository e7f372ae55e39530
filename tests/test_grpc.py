"""The gRPC frontend over loopback: streams equal to the offline greedy output, health and
reflection, concurrency, cancellation, authentication and every refusal's status."""

import asyncio
import json
import math
import re
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from conftest import (
    PROMPTS,
    SCHEMA,
    check_structured,
    in_use,
    make_tls_cert,
    random_prompts,
    reference_greedy,
    wait_nothing_in_use,
)
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from distserve import LLM, SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.client import AsyncClient, CallError, Client, Completion, grpc_target, make_request
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import API_KEY_ENV, ServerConfig
from distserve.v1 import distserve_pb2 as pb

API_KEY = "sk-grpc-test"
NUM_KV_BLOCKS = 48  # per instance, of 16 tokens: 768 tokens, less than the model's context of 1024


@pytest.fixture(scope="module")
def server(ray_cluster):
    config = make_cluster_config(
        model="tiny-llama", num_kv_blocks=NUM_KV_BLOCKS, prefill={}, decode={}, dtype="float32"
    )
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0, api_key=API_KEY)) as server:
        yield server


@pytest.fixture
def client(server):
    with Client(server.grpc_address, api_key=API_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def llama(reference_model):
    return reference_model("tiny-llama")


def test_stream_equals_transformers_greedy(client, llama):
    prompts = random_prompts([1, 9, 40, 100], llama.config.vocab_size, seed=3)
    for prompt, max_tokens in zip(prompts, [20, 5, 33, 12]):
        chunks = list(client.generate(prompt, max_tokens=max_tokens, temperature=0))
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference_greedy(llama, prompt, max_tokens)
        # Streamed, not in one piece: the first token alone, the rest in the instances' output batches.
        assert len(chunks[0].token_ids) == 1 and (len(chunks) > 1 or len(tokens) == 1)
        last = chunks[-1]
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(tokens))
        t = last.timings
        assert 0 < t.ttft <= t.e2e and t.prefill > 0 and t.queue >= 0
        assert (t.migration > 0) == (len(tokens) > 1)  # a request done at its first token never migrates


def test_penalties_and_logprobs_cross_the_hand_over(client, llama):
    """The prefill instance samples the first token and the decode instance the rest: the repetition
    penalty still counts every token, and every token has its logprobs."""
    prompt = [3 + t % 7 for t in range(30)]
    completion = Completion.from_chunks(
        client.generate(prompt, max_tokens=12, temperature=0, repetition_penalty=1.8, logprobs=2, prompt_logprobs=1)
    )
    with torch.inference_mode():
        want = llama.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8)
        assert completion.token_ids == want[0, len(prompt) :].tolist()
        full = llama(torch.tensor([prompt + completion.token_ids])).logits[0].float().log_softmax(-1)
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    got = torch.tensor([lp.logprob for lp in completion.logprobs])
    rows = full[len(prompt) - 1 : -1]
    assert torch.allclose(got, rows.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1), atol=1e-4)
    assert all(len(lp.top_token_ids) == 2 for lp in completion.logprobs)
    assert [lp.token_id for lp in completion.prompt_logprobs] == prompt[1:]


def test_json_schema_output_validates_across_the_hand_over(client):
    """The prefill instance samples the opening brace, the decode instance the rest, under the
    grammar it rebuilt from that token: every output is a complete, valid document."""
    for seed in range(3):
        completion = Completion.from_chunks(
            client.generate(
                PROMPTS[seed], max_tokens=300, temperature=1.0, seed=seed, structured_outputs={"json": SCHEMA}
            )
        )
        assert completion.finish_reason == "stop", completion.text
        assert completion.text.lstrip().startswith("{") and completion.timings.migration > 0
        check_structured("json", completion.text)


def test_text_stream_equals_offline_engine(client):
    prompts = ["The cache block", "Hello there, how", "A"]
    llm = LLM("tiny-llama", dtype="float32")
    try:
        expected = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    finally:
        llm.shutdown()
    for prompt, offline in zip(prompts, expected):
        completion = client.complete(prompt, max_tokens=24, temperature=0)
        assert completion.text == offline.text
        assert completion.token_ids == offline.output_token_ids
        assert completion.finish_reason == offline.finish_reason


def test_samples_of_one_request_stream_with_their_index(client, llama):
    (prompt,) = random_prompts([21], llama.config.vocab_size, seed=8)
    samples = client.complete_samples(prompt, 3, max_tokens=8, temperature=0.8, seed=5)
    assert [s.index for s in samples] == [0, 1, 2]
    alone = [client.complete(prompt, max_tokens=8, temperature=0.8, seed=5 + i) for i in range(3)]
    assert [s.token_ids for s in samples] == [a.token_ids for a in alone]
    assert len({tuple(s.token_ids) for s in samples}) == 3
    assert all(s.usage.completion_tokens == len(s.token_ids) == 8 or s.finish_reason == "stop" for s in samples)
    with pytest.raises(ValueError, match="complete_samples"):
        client.complete(prompt, n=2)


def test_health_serving_without_key(server):
    with Client(server.grpc_address) as anonymous:
        assert anonymous.health() == "SERVING"
        assert anonymous.health("distserve.v1.DistServe") == "SERVING"


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.grpc_address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"distserve.v1.DistServe", "grpc.health.v1.Health"} <= services


def test_cluster_info_and_tokenizer(server, client):
    info = client.cluster_info()
    assert info.model == "tiny-llama" and not info.draining
    roles = sorted(pb.Role.Name(i.role) for i in info.instances)
    assert roles == ["ROLE_DECODE", "ROLE_PREFILL"]
    assert all(i.num_blocks == NUM_KV_BLOCKS and not i.failure for i in info.instances)
    ids = client.tokenize("The cache block", add_special_tokens=False)
    assert ids and client.detokenize(ids) == "The cache block"

    async def through_async_client():
        async with AsyncClient(server.grpc_address, api_key=API_KEY) as aclient:
            return await aclient.tokenize("The cache block", add_special_tokens=False), await aclient.detokenize(ids)

    assert asyncio.run(through_async_client()) == (ids, "The cache block")


def test_32_concurrent_streams_complete(server, llama):
    prompts = random_prompts([5 + 7 * i for i in range(32)], llama.config.vocab_size, seed=4)
    max_tokens = [4 + i % 13 for i in range(32)]

    async def run() -> list[list[int]]:
        async with AsyncClient(server.grpc_address, api_key=API_KEY) as client:
            completions = await asyncio.gather(
                *(client.complete(p, max_tokens=n, temperature=0) for p, n in zip(prompts, max_tokens))
            )
        return [c.token_ids for c in completions]

    outputs = asyncio.run(run())
    for prompt, n, tokens in zip(prompts, max_tokens, outputs):
        assert tokens == reference_greedy(llama, prompt, n)
    wait_nothing_in_use(server.info, server.frontend)


@pytest.mark.parametrize("chunks_before_cancel", [0, 1, 5])
def test_cancelled_stream_frees_its_blocks(server, client, chunks_before_cancel):
    request = make_request(list(range(10, 300)), max_tokens=400, ignore_eos=True)  # blocks on both sides
    call = client.stub.Generate(request, metadata=client.metadata)
    if chunks_before_cancel == 0:
        time.sleep(0.02)  # the call is on its way but nothing has come back
    for _ in range(chunks_before_cancel):
        assert next(call).finish_reason == pb.FINISH_REASON_UNSPECIFIED  # still decoding
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    wait_nothing_in_use(server.info, server.frontend)
    assert client.complete("still serving", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


BAD_REQUESTS = [
    (pb.GenerateRequest(), "no prompt"),
    (make_request(""), "prompt is empty"),
    (make_request([]), "prompt is empty"),
    (make_request([5, 10**9]), "token ids must be in"),
    (make_request([-1]), "token ids must be in"),
    (make_request("x", max_tokens=0), "max_tokens"),
    (make_request("x", max_tokens=-3), "max_tokens"),
    (make_request("x", temperature=-0.5), "temperature"),
    (make_request("x", temperature=math.nan), "temperature"),
    (make_request("x", temperature=math.inf), "temperature"),
    (make_request("x", top_p=0.0), "top_p"),
    (make_request("x", top_p=1.5), "top_p"),
    (make_request("x", top_k=-1), "top_k"),
    (make_request("x", stop=[""]), "stop strings"),
    (make_request("x", stop_token_ids=[-2]), "stop_token_ids"),
    (make_request([5] * 3000), "context"),
    (make_request([5] * 700, max_tokens=200), "KV cache"),
    (pb.GenerateRequest(text="x", slo_ttft=-1.0), "slo_ttft must be > 0"),
    (pb.GenerateRequest(text="x", slo_tpot=math.nan), "slo_tpot must be > 0"),
    # A message quoting all 1000 ids (under the limit of 1024) would be long: it is cut.
    (make_request("x", stop_token_ids=[-1] * 1000), "stop_token_ids must be non-negative integers, got [-1, -1"),
]


@pytest.mark.parametrize("request_message, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_request_gets_invalid_argument_and_the_next_succeeds(client, request_message, message):
    with pytest.raises(grpc.RpcError) as error:
        list(client.stub.Generate(request_message, metadata=client.metadata))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    assert client.complete("Hello", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4


def test_detokenize_refuses_unknown_ids(client):
    with pytest.raises(CallError) as error:
        client.detokenize([10**9])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_refusal_raises_a_call_error_of_one_sentence(server, client):
    with pytest.raises(CallError) as error:
        client.complete([5] * 3000)
    refusal = error.value
    assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in refusal.details()
    assert str(refusal) == f"{server.grpc_address} answered INVALID_ARGUMENT: {refusal.details()}"
    assert isinstance(refusal, grpc.RpcError)  # code written against raw gRPC errors still catches it
    with pytest.raises(CallError) as error:  # 700 decode steps take seconds: the deadline passes mid-stream
        client.complete([5] * 8, max_tokens=700, ignore_eos=True, temperature=0, timeout=0.2)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(error.value) == f"{server.grpc_address} did not answer within the timeout"


def test_an_unreachable_server_is_one_sentence():
    with socket.socket() as probe:  # a port just freed: nothing listens there
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    expected = f"cannot reach a server at {address}: connection refused"
    with Client(address) as client, pytest.raises(CallError) as error:
        client.cluster_info(timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and str(error.value) == expected

    async def stream() -> None:
        async with AsyncClient(address) as aclient:
            await aclient.complete("Hi")

    with pytest.raises(CallError, match=f"^{re.escape(expected)}$"):
        asyncio.run(stream())


def test_the_api_key_comes_from_the_environment_unless_given(server, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    with Client(server.grpc_address) as client:
        assert client.cluster_info().model == "tiny-llama"

    async def tokenize() -> list[int]:
        async with AsyncClient(server.grpc_address) as aclient:
            return await aclient.tokenize("Hi")

    assert asyncio.run(tokenize())
    with Client(server.grpc_address, api_key="sk-wrong") as client, pytest.raises(CallError) as error:
        client.cluster_info()
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "address, target",
    [
        ("localhost", "localhost:50051"),
        ("10.0.0.7:6000", "10.0.0.7:6000"),
        ("[::1]", "[::1]:50051"),
        ("::1", "[::1]:50051"),
        ("[::1]:7000", "[::1]:7000"),
        ("unix:/tmp/distserve.sock", "unix:/tmp/distserve.sock"),
        ("dns:///example.com:443", "dns:///example.com:443"),
    ],
)
def test_an_address_without_a_port_means_the_default_grpc_port(address, target):
    assert grpc_target(address) == target
    with Client(address) as client:
        assert client.address == target


@pytest.mark.parametrize("api_key", [None, "sk-wrong"])
def test_missing_or_wrong_key_is_unauthenticated(server, api_key, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with Client(server.grpc_address, api_key=api_key) as client:
        for call in (lambda: client.complete("Hello"), client.cluster_info, lambda: client.tokenize("x")):
            with pytest.raises(CallError) as error:
                call()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in error.value.details()


def test_full_admission_queue_is_resource_exhausted(server, client):
    config = server.frontend.config
    limit, config.max_pending_requests = config.max_pending_requests, 1
    try:
        busy = client.generate("keep going", max_tokens=400, ignore_eos=True)
        next(busy)  # admitted and streaming
        with pytest.raises(CallError) as error:
            client.complete("one too many")
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry later" in error.value.details()
        busy.close()
        wait_nothing_in_use(server.info, server.frontend)
        assert client.complete("room again", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    finally:
        config.max_pending_requests = limit


def test_a_burst_past_the_admission_limit_is_refused_not_cancelled(server):
    """3000 calls at once on one connection, far past what the server admits: each one runs or is
    answered RESOURCE_EXHAUSTED with its message (gRPC core's own queue would cancel those past its
    1000th)."""
    config = server.frontend.config
    limit, config.max_pending_requests = config.max_pending_requests, 1

    async def burst():
        async def one():
            try:
                await aclient.complete("Hello", max_tokens=2)
                return "done"
            except CallError as e:
                return e.code(), "retry later" in e.details()

        async with AsyncClient(server.grpc_address, api_key=API_KEY) as aclient:
            return await asyncio.gather(*(one() for _ in range(3000)))

    try:
        outcomes = asyncio.run(burst())
    finally:
        config.max_pending_requests = limit
    refused = (grpc.StatusCode.RESOURCE_EXHAUSTED, True)
    assert set(outcomes) <= {"done", refused} and outcomes.count(refused) > 2900
    wait_nothing_in_use(server.info, server.frontend)


def test_status_and_remote_generate_cli(server, client, capsys):
    from distserve.cli import main

    assert main(["status", "--server", server.grpc_address, "--api-key", API_KEY]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama: SERVING" in out
    assert "prefill" in out and "decode" in out and f"0/{NUM_KV_BLOCKS} (0%)" in out
    assert re.search(r"KV used +KV dtype", out) and len(re.findall(rf"0/{NUM_KV_BLOCKS} \(0%\) +auto ", out)) == 2
    assert [i.kv_cache_dtype for i in client.cluster_info().instances] == ["auto", "auto"]

    expected = client.complete("The cache block", max_tokens=8, temperature=0)
    args = ["generate", "--server", server.grpc_address, "--api-key", API_KEY]
    args += ["--max-tokens", "8", "--temperature", "0"]
    assert main([*args, "The cache block"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected.text + "\n"
    assert "TTFT" in captured.err and "TPOT" in captured.err

    assert main([*args, "--block-size", "8", "Hi"]) == 2  # an engine setting means nothing to a server
    assert main(["status", "--server", server.grpc_address]) == 1  # no key
    assert "UNAUTHENTICATED" in capsys.readouterr().err

    # --seed with --server is the request's seed: the same samples as the client's seeded call.
    sampled = client.complete("The cache block", max_tokens=8, temperature=1.0, seed=7)
    seeded = [*args[:-1], "1.0", "--seed", "7", "The cache block"]  # --temperature 1.0
    assert main(seeded) == 0
    assert capsys.readouterr().out == sampled.text + "\n"

    # Structured values as JSON: a regex the text matches, a bias that makes token 7 every token.
    assert main([*seeded[:-1], "--structured-outputs", '{"regex": "[a-z]{3}-[0-9]{2}"}', "Hi"]) == 0
    check_structured("regex", capsys.readouterr().out.rstrip("\n"))
    assert main([*args, "--logit-bias", '{"7": 100}', "Hi"]) == 0
    biased = client.complete("Hi", max_tokens=8, temperature=0, logit_bias={7: 100})
    assert biased.token_ids == [7] * 8 and capsys.readouterr().out == biased.text + "\n"


def test_tls_and_a_lost_decode_instance(ray_cluster, tmp_path):
    """Over TLS, with re-runs and replacement off: streams in flight when the decode instance dies end
    with UNAVAILABLE (gRPC) or an error event (HTTP); later requests are refused the same way; the
    prefill side frees every block. (With them on, tests/test_faults.py shows the streams go on.)"""
    cert, key = make_tls_cert(tmp_path)
    config = make_cluster_config(
        model="tiny-llama", num_kv_blocks=48, prefill={}, decode={}, max_request_attempts=1,
        replace_failed_instances=False, dtype="float32",
    )  # fmt: skip
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0, tls_cert=cert, tls_key=key)) as server:
        with Client(server.grpc_address) as plaintext, pytest.raises(CallError) as error:
            plaintext.complete("Hi", timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE

        tls = ssl.create_default_context(cafile=cert)
        body = json.dumps({"prompt": "Once", "max_tokens": 600, "ignore_eos": True, "stream": True}).encode()
        http_request = urllib.request.Request(f"{server.http_url}/v1/completions", data=body)
        with Client(server.grpc_address, root_certificates=Path(cert).read_bytes()) as client:
            assert client.complete("Hi", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
            grpc_stream = client.generate("Upon", max_tokens=600, ignore_eos=True)
            next(grpc_stream)
            with urllib.request.urlopen(http_request, context=tls, timeout=30) as http_stream:
                assert http_stream.readline().startswith(b"data: {")
                decode = next(s for s in server.cluster.orchestrator.instances if s.role == "decode")
                ray_cluster.kill(decode.handle)
                with pytest.raises(CallError) as error:
                    list(grpc_stream)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                assert decode.name in error.value.details()
                events = [line for line in http_stream.read().decode().splitlines() if line.startswith("data: ")]
                assert "error" in json.loads(events[-1].removeprefix("data: "))

            assert decode.failure is not None
            with pytest.raises(CallError) as error:
                client.complete("Hi")
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no decode instance" in error.value.details()
            refused = urllib.request.Request(f"{server.http_url}/v1/completions", data=b'{"prompt": "Hi"}')
            with pytest.raises(urllib.error.HTTPError) as http_error:
                urllib.request.urlopen(refused, context=tls, timeout=30)
            assert http_error.value.code == 503
            prefill = next(i for i in client.cluster_info().instances if i.role == pb.ROLE_PREFILL)
            assert not in_use([prefill])


def test_chat_without_max_tokens_fits_a_kv_cache_smaller_than_the_context(server):
    """This server's instances hold 768 tokens, less than the model's context of 1024: a chat
    request that leaves max_tokens to the server gets what fits rather than a refusal."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{server.http_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        usage = json.loads(response.read())["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == NUM_KV_BLOCKS * 16


def test_cached_prompt_tokens_are_not_reported_unless_the_server_is_started_to(server, client, llama):
    """They would tell a client whether another's prompt began as its own (vLLM reports them only
    with --enable-prompt-tokens-details); the prefix cache works all the same."""
    (prompt,) = random_prompts([40], llama.config.vocab_size, seed=21)
    cached_before = sum(i.cached_prompt_tokens for i in client.cluster_info().instances)
    for _ in range(2):
        assert client.complete(prompt, max_tokens=2, temperature=0).usage.cached_prompt_tokens == 0
    assert sum(i.cached_prompt_tokens for i in client.cluster_info().instances) - cached_before == 32
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(
        f"{server.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        usage = json.loads(response.read())["usage"]
    assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] == 40
    assert sum(i.cached_prompt_tokens for i in client.cluster_info().instances) - cached_before == 64


def test_role_changes_are_refused_without_an_admin_key(server, client):
    """This server has an API key and no admin key: no key changes roles (tests/test_tenants.py
    has a server with one)."""
    prefill = next(i.name for i in client.cluster_info().instances if i.role == pb.ROLE_PREFILL)
    for options in ({"api_key": API_KEY}, {"api_key": API_KEY, "admin_key": "sk-guess"}):
        with Client(server.grpc_address, **options) as caller, pytest.raises(CallError) as refusal:
            caller.set_roles({prefill: "prefill"})
        assert refusal.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "this server has none: start it with --admin-key" in refusal.value.details()
