"""Beam search through the servers of a 1 prefill + 1 decode cluster: the prefill instance runs the
prompt and the search's first step, and hands over one prompt's KV with the first step's beams;
the decode instance pulls it once and forks the beams from it. HTTP (vLLM's ``use_beam_search``:
``n`` beams) and gRPC (``beam_width``) answer as transformers' beam search does; streamed, every
beam comes whole at the end, then the usage."""

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from conftest import random_prompts, reference_beams, wait_nothing_in_use

from distserve import SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.client import CallError, Client, make_request
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.v1 import distserve_pb2 as pb

MODEL = "tiny-llama"
KEY = "sk-beams"
SCORE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(ray_cluster):
    config = make_cluster_config(model=MODEL, num_kv_blocks=128, prefill={}, decode={}, dtype="float32")
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0, api_key=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def llama(reference_model):
    return reference_model(MODEL)


def expected(server, llama, prompt: list[int], params: SamplingParams) -> list[tuple[list[int], float]]:
    processor = server.frontend.cluster.orchestrator.input_processor
    return reference_beams(llama, prompt, params, list(processor.resolve(params).all_stop_token_ids))


def post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def decode_pulls(server) -> int:
    infos = ray.get([s.handle.info.remote() for s in server.frontend.cluster.orchestrator.instances])
    return sum(info.num_kv_pulls for info in infos)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_grpc_disaggregated_equal_to_transformers(server, llama, width):
    (prompt,) = random_prompts([13], llama.config.vocab_size, seed=width)
    params = SamplingParams(max_tokens=9, beam_width=width, n=width, length_penalty=1.3, early_stopping="never")
    pulls = decode_pulls(server)
    with Client(server.grpc_address, api_key=KEY) as client:
        results = client.complete_samples(
            prompt, n=width, max_tokens=9, beam_width=width, length_penalty=1.3, early_stopping=pb.EARLY_STOPPING_NEVER
        )
    want = expected(server, llama, prompt, params)
    assert [r.token_ids for r in results] == [tokens for tokens, _ in want]
    assert [r.beam_score for r in results] == pytest.approx([score for _, score in want], abs=SCORE_TOLERANCE)
    for r in results:
        assert r.beam_score == pytest.approx(r.cumulative_logprob / len(r.token_ids) ** 1.3, rel=1e-5)
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(r.token_ids)
    assert decode_pulls(server) - pulls == 1  # one prompt's KV, whatever the width
    wait_nothing_in_use(server.info, server.frontend)


def test_grpc_returns_the_n_best(server, llama):
    (prompt,) = random_prompts([10], llama.config.vocab_size, seed=7)
    params = SamplingParams(max_tokens=7, beam_width=4, n=2, early_stopping=True)
    with Client(server.grpc_address, api_key=KEY) as client:
        results = client.complete_samples(
            prompt, n=2, max_tokens=7, beam_width=4, early_stopping=pb.EARLY_STOPPING_TRUE
        )
    want = expected(server, llama, prompt, params)
    assert [r.token_ids for r in results] == [tokens for tokens, _ in want] and len(results) == 2
    wait_nothing_in_use(server.info, server.frontend)


def test_a_search_that_ends_at_its_first_step_ends_on_the_prefill_instance(server, llama):
    (prompt,) = random_prompts([9], llama.config.vocab_size, seed=5)
    pulls = decode_pulls(server)
    with Client(server.grpc_address, api_key=KEY) as client:
        results = client.complete_samples(prompt, n=3, max_tokens=1, beam_width=3)
    want = expected(server, llama, prompt, SamplingParams(max_tokens=1, beam_width=3, n=3))
    assert [r.token_ids for r in results] == [tokens for tokens, _ in want]
    assert decode_pulls(server) == pulls  # nothing was handed over
    wait_nothing_in_use(server.info, server.frontend)


def test_cancel_mid_search_frees_both_instances(server):
    (prompt,) = random_prompts([20], 1000, seed=9)
    with Client(server.grpc_address, api_key=KEY) as client:
        request = make_request(prompt, max_tokens=400, beam_width=4, ignore_eos=True)
        call = client.stub.Generate(request, metadata=client.metadata)
        deadline = time.monotonic() + 30
        while not any(i.role == "decode" and i.num_running == 4 for i in server.info()):  # the beams decode there
            assert time.monotonic() < deadline, "the search never decoded on the decode instance"
            time.sleep(0.01)
        call.cancel()
    wait_nothing_in_use(server.info, server.frontend)


def test_http_completion_and_stream(server, llama):
    (prompt,) = random_prompts([12], llama.config.vocab_size, seed=11)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": 4, "use_beam_search": True,
            "length_penalty": 0.7, "return_token_ids": True}  # fmt: skip
    status, text = post(server, "completions", body)
    assert status == 200, text
    choices = json.loads(text)["choices"]
    want = expected(server, llama, prompt, SamplingParams(max_tokens=8, beam_width=4, n=4, length_penalty=0.7))
    assert [c["token_ids"] for c in choices] == [tokens for tokens, _ in want]
    for choice, (tokens, score) in zip(choices, want):
        assert choice["cumulative_logprob"] / len(tokens) ** 0.7 == pytest.approx(score, abs=SCORE_TOLERANCE)
    usage = json.loads(text)["usage"]
    assert usage["completion_tokens"] == sum(len(tokens) for tokens, _ in want)

    status, stream = post(server, "completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200, stream
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    streamed: dict[int, dict] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        entry = streamed.setdefault(choice["index"], {"text": "", "token_ids": []})
        entry["text"] += choice["text"]
        entry["token_ids"] += choice["token_ids"]
        if choice["finish_reason"] is not None:
            entry["finish_reason"], entry["cumulative_logprob"] = choice["finish_reason"], choice["cumulative_logprob"]
    assert [streamed[i]["token_ids"] for i in range(4)] == [c["token_ids"] for c in choices]
    assert [streamed[i]["text"] for i in range(4)] == [c["text"] for c in choices]
    assert [streamed[i]["cumulative_logprob"] for i in range(4)] == [c["cumulative_logprob"] for c in choices]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == usage
    assert stream.rstrip().endswith("data: [DONE]")
    wait_nothing_in_use(server.info, server.frontend)


def test_http_chat_beam_search(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Where is the river?"}], "max_tokens": 6,
            "n": 3, "use_beam_search": True, "early_stopping": "never", "return_token_ids": True}  # fmt: skip
    status, text = post(server, "chat/completions", body)
    assert status == 200, text
    choices = json.loads(text)["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in choices}) == 3
    scores = [c["cumulative_logprob"] / len(c["token_ids"]) for c in choices]  # length_penalty 1
    assert scores == sorted(scores, reverse=True)  # best first
    wait_nothing_in_use(server.info, server.frontend)


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"logprobs": 2}, "logprobs", "does not apply to beam search (beam_width)"),
        ({"stop": ["x"]}, "stop", "does not apply to beam search (beam_width)"),
        ({"n": 17}, "n", "over the limit of 16"),
    ],
)
def test_http_refusals(server, fields, param, message):
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 4, "n": 2, "use_beam_search": True, **fields}
    status, text = post(server, "completions", body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param and message in error["message"], text


def test_http_length_penalty_without_beam_search_is_ignored(server):
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 5, "temperature": 0}
    status, plain = post(server, "completions", body)
    status_with, with_penalty = post(server, "completions", {**body, "length_penalty": 3.0, "early_stopping": True})
    assert status == status_with == 200
    assert json.loads(plain)["choices"][0]["text"] == json.loads(with_penalty)["choices"][0]["text"]


def test_grpc_refusals(server):
    with Client(server.grpc_address, api_key=KEY) as client:
        with pytest.raises(CallError) as refused:
            client.complete_samples("The river", n=3, max_tokens=4, beam_width=2)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "n must be at most beam_width=2" in refused.value.details()
        with pytest.raises(CallError) as refused:
            client.complete_samples("The river", n=1, max_tokens=4, beam_width=2, repetition_penalty=1.3)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "repetition_penalty does not apply to beam search" in refused.value.details()
        # The server goes on: a plain request after them.
        assert client.complete("The river", max_tokens=3, temperature=0).finish_reason == "length"
    wait_nothing_in_use(server.info, server.frontend)
