"""A request whose step fails ends alone, with an error naming it; the instance and the other
requests of its batch go on, their outputs unchanged, and nothing stays in use.

The bad requests take real paths into the step (no fault is injected into the serving code):

- ``nan-at-prefill``: the model's input embedding of one token is NaN (a copy of tiny-llama with
  that row poisoned), and the prompt holds that token, so its logits are NaN at its first sampling;
- ``nan-in-decode``: a prompt whose greedy output's fourth token is the poisoned one: four tokens
  stream out, then its next logits are NaN, in a decode step beside the other streams;
- ``sampling-raises``: a temperature of 10**309, an integer past the largest float, passes
  validation (0 <= t < inf) but cannot become a tensor, so sampling it raises, in a batch with
  the others. (Should validation come to refuse it, this test needs another such value.)

The other requests never hold or generate the poisoned token, so their greedy outputs are the
model's own (transformers'), and equal to a run without the bad request.
"""

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass

import grpc
import pytest
import torch
from conftest import assert_engine_idle, random_prompts, reference_greedy, wait_nothing_in_use
from safetensors.torch import load_file, save_file

from distserve import LLM, SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.core.errors import RequestError, RequestFailed, RequestFault
from distserve.entrypoints.client import AsyncClient, CallError
from distserve.entrypoints.errors import to_serving_error
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.model_executor.isolated_sampling import FAILED_TOKEN, sample_step
from distserve.model_executor.model_runner import BatchInput, SeqInput
from distserve.model_executor.sampler import Sampler, fan_out_samples
from distserve.model_executor.tiny_models import ensure_tiny_model

NUM_STREAMS = 16
MAX_TOKENS = 24
BAD_AFTER = 4  # tokens the nan-in-decode request gives before its logits turn NaN
UNREPRESENTABLE_TEMPERATURE = 10**309  # below infinity, but past the largest float
# The largest gap between two chunks of one of the other streams, in seconds: a step that failed
# and was sampled again row by row, or a failed-over instance, would show here. On a 2-core
# machine the 16 streams' is 0.07-0.11 s with the bad request, 0.08-0.09 s without.
MAX_STREAM_GAP_S = 5.0


@dataclass
class Case:
    """The other requests and their greedy outputs, and the bad requests, on a poisoned model."""

    model: str  # the poisoned model's directory
    poison: int  # the token whose input embedding is NaN there
    prompts: list[list[int]]
    expected: list[list[int]]  # transformers' greedy outputs of ``prompts`` (the unpoisoned model)
    decode_prompt: list[int]  # the nan-in-decode request's prompt
    decode_expected: list[int]  # its first BAD_AFTER tokens


@pytest.fixture(scope="module")
def case(reference_model, tmp_path_factory) -> Case:
    llama = reference_model("tiny-llama")
    vocab = llama.config.vocab_size
    prompts = random_prompts([5 + 9 * i for i in range(NUM_STREAMS)], vocab, seed=67)
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]
    special = {0, llama.config.bos_token_id, llama.config.eos_token_id, llama.config.pad_token_id}
    used = {t for tokens in prompts + expected for t in tokens} | special
    for seed in range(100):  # a prompt whose fourth greedy token no other request holds
        decode_prompt = random_prompts([12], vocab, seed=1000 + seed)[0]
        out = reference_greedy(llama, decode_prompt, BAD_AFTER)
        poison = out[-1]
        if poison not in used and poison not in decode_prompt and poison not in out[:-1]:
            break
    else:
        pytest.fail("no prompt's fourth greedy token is unused by the others")
    source = ensure_tiny_model("tiny-llama")
    target = tmp_path_factory.mktemp("poisoned") / "tiny-llama-nan"
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    weights["model.embed_tokens.weight"][poison] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return Case(str(target), poison, prompts, expected, decode_prompt, out)


def _bad_request(case: Case, kind: str) -> tuple[list[int], dict, str]:
    """The bad request of ``kind``: its prompt, its sampling fields, and what its error names."""
    if kind == "nan-at-prefill":
        return [7, 8, case.poison, 9, 10], {"temperature": 0.0, "max_tokens": MAX_TOKENS}, "NaN"
    if kind == "nan-in-decode":
        return case.decode_prompt, {"temperature": 0.0, "max_tokens": MAX_TOKENS}, "NaN"
    return [11, 12, 13, 14], {"temperature": UNREPRESENTABLE_TEMPERATURE, "max_tokens": MAX_TOKENS}, "sampling"


KINDS = ["nan-at-prefill", "nan-in-decode", "sampling-raises"]


# The sampling of a step ------------------------------------------------------------------------


def test_sampling_a_batch_leaves_out_the_rows_that_fail():
    """A batch of six sequences (a prompt chunk that samples nothing, a request of three samples
    at its prompt's end): the row of NaN logits and the row whose sampling raises are faults under
    their batch index, their tokens placeholders; every other row's tokens and logprobs are those
    it gets sampled alone."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    seeded = SamplingParams(temperature=1.0, seed=3, n=3)
    bad = SamplingParams(temperature=UNREPRESENTABLE_TEMPERATURE)
    seqs = [
        SeqInput([1], 0, [0], greedy, 0),
        SeqInput([1], 0, [0], greedy, 0),
        SeqInput([1], 0, [0], seeded, 0, sibling_params=[seeded.sample_params(1), seeded.sample_params(2)]),
        SeqInput([1], 0, [0], bad, 0),
        SeqInput([1, 2], 0, [0], greedy, 0, sample=False),
        SeqInput([1], 0, [0], greedy, 0),
    ]
    step = sample_step(Sampler(), logits, BatchInput(is_prefill=True, seqs=seqs))
    assert sorted(step.faults) == [1, 3]
    assert "NaN" in step.faults[1].message and "sampling failed" in step.faults[3].message
    alone = [
        Sampler().sample(*fan_out_samples(logits[row : row + 1], [seqs[i]])) for row, i in ((0, 0), (2, 2), (4, 5))
    ]
    first, samples, last = alone
    assert step.token_ids == [*first.token_ids, FAILED_TOKEN, *samples.token_ids, FAILED_TOKEN, *last.token_ids]
    assert len(samples.token_ids) == 3
    assert step.logprobs == [*first.logprobs, None, None, None, None, None, *last.logprobs]


def test_a_request_fault_reaches_its_client_as_internal_or_invalid_argument():
    """A fault names the request and its cause; it reaches the client as INTERNAL / 500, or as
    INVALID_ARGUMENT / 400 where the request's own values raised a RequestError in its step."""
    internal = RequestFault.of("sampling", OverflowError("int too large")).of_request("r1")
    assert str(internal) == "request 'r1': its sampling failed: OverflowError: int too large"
    named_by_client = internal.of_request("client-id")
    assert str(named_by_client) == "request 'client-id': its sampling failed: OverflowError: int too large"
    assert isinstance(internal.error(), RequestFailed)
    error = to_serving_error(internal.error())
    assert (error.grpc_code, error.http_status) == (grpc.StatusCode.INTERNAL, 500)
    invalid = RequestFault.of("structured output's grammar", RequestError("too deep")).of_request("r2")
    error = to_serving_error(invalid.error())
    assert str(error) == "request 'r2': its structured output's grammar failed: too deep"
    assert (error.grpc_code, error.http_status) == (grpc.StatusCode.INVALID_ARGUMENT, 400)


# The engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(case):
    llm = LLM(model=case.model, num_kv_blocks=128, dtype="float32")
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_whose_step_fails_ends_alone_in_the_engine(llm, case, kind):
    """One batch of the 16 requests, a seeded request of two samples and the bad one (sent as two
    samples, so that both end with it): the bad one ends with finish reason "error" and a message
    naming it, each other output equals the run without it (greedy: transformers' too), the bad
    one shared its steps with them, and no block is in use afterwards."""
    prompt, fields, cause = _bad_request(case, kind)
    # Sampled, it could draw the poisoned token: the bias keeps it from that.
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=2, logit_bias={case.poison: -100})
    prompts = [*case.prompts, case.prompts[0]]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * NUM_STREAMS + [sampled]
    without = llm.generate(prompts, params)
    bad = len(prompts) // 2
    outputs = llm.generate(
        [*prompts[:bad], prompt, *prompts[bad:]],
        [*params[:bad], SamplingParams(n=2, **fields), *params[bad:]],
    )
    failed = outputs[bad : bad + 2]
    assert [o.index for o in failed] == [0, 1]
    for output in failed:
        assert output.finished and output.finish_reason == "error"
        assert f"request '{output.request_id}'" in output.error and cause in output.error, output.error
    if kind == "nan-in-decode":  # its tokens before the poisoned one's logits
        assert failed[0].output_token_ids == case.decode_expected
    others = outputs[:bad] + outputs[bad + 2 :]
    assert [o.output_token_ids for o in others] == [o.output_token_ids for o in without]
    assert [o.text for o in others] == [o.text for o in without]
    assert [o.output_token_ids for o in others[:NUM_STREAMS]] == case.expected
    assert all(o.error is None and o.finish_reason in ("stop", "length") for o in others)
    assert failed[0].metrics.prefill_batch_size == len(prompts) + 1  # prefilled in one step with all the others
    if kind == "nan-in-decode":  # it failed in a decode step beside the others
        assert failed[0].metrics.steps[-1][2] > 2
    assert_engine_idle(llm.engine)


# The cluster -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(ray_cluster, case):
    config = make_cluster_config(model=case.model, num_kv_blocks=96, prefill={}, decode={}, dtype="float32")
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
        yield server


async def _stream(client: AsyncClient, prompt: list[int]) -> tuple[list[int], str, float]:
    """A greedy stream's tokens, text and the largest gap between two of its chunks."""
    tokens, text, last, gap = [], "", None, 0.0
    async for chunk in client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0):
        now = time.monotonic()
        gap, last = (gap if last is None else max(gap, now - last)), now
        tokens += chunk.token_ids
        text += chunk.text
    return tokens, text, gap


async def _wave(server, prompts: list[list[int]], bad: Coroutine | None = None) -> tuple[list, str | None]:
    """Greedy streams of ``prompts``, sent at once, and ``bad`` (a bad request's call) started
    amid them, after the first half: each stream's result, and what ``bad`` returned."""
    async with AsyncClient(server.grpc_address) as client:
        calls = [_stream(client, p) for p in prompts]
        middle = len(calls) // 2
        if bad is not None:
            calls.insert(middle, bad)
        results = await asyncio.gather(*calls)
    return results, results.pop(middle) if bad is not None else None


def _http(server, body: dict) -> tuple[int, list[dict]]:
    """(status, the JSON objects of the answer: one, or a stream's events) of a completion."""
    request = urllib.request.Request(
        f"{server.http_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    if body.get("stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith(b"data: ")]
        return status, [json.loads(e) for e in events if e != b"[DONE]"]
    return status, [json.loads(raw)]


async def _send_bad(server, case: Case, kind: str, surface: str) -> str:
    """Send the bad request of ``kind`` over ``surface`` and check its status: gRPC INTERNAL, HTTP
    500, an error event in an HTTP stream after its tokens' text, ``RequestFailed`` from the
    Python API; the error message its client got."""
    prompt, fields, _ = _bad_request(case, kind)
    if surface == "grpc":
        async with AsyncClient(server.grpc_address) as client:
            with pytest.raises(CallError) as raised:
                await client.complete(prompt, request_id="bad-request", **fields)
        assert raised.value.code() == grpc.StatusCode.INTERNAL, raised.value
        assert "request 'bad-request'" in raised.value.details()
        return raised.value.details()
    if surface == "python":

        async def generate() -> str:
            with pytest.raises(RequestFailed) as raised:
                async for _ in server.cluster.generate(prompt, SamplingParams(**fields), request_id="bad-request"):
                    pass
            return str(raised.value)

        message = await asyncio.to_thread(server.loop.run, generate())
        assert "request 'bad-request'" in message
        return message
    stream = surface == "http-stream"
    status, answer = await asyncio.to_thread(_http, server, {"prompt": prompt, "stream": stream, **fields})
    if stream:
        assert status == 200
        *chunks, error = answer
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text and server.frontend.detokenize(case.decode_expected).startswith(text)
    else:
        assert status == 500, answer
        (error,) = answer
    assert error["error"]["type"] == "internal_error", error
    return error["error"]["message"]


@pytest.fixture(scope="module")
def without(server, case) -> list[tuple[list[int], str, float]]:
    """The 16 streams without a bad request."""
    return asyncio.run(_wave(server, case.prompts))[0]


@pytest.mark.parametrize(
    "kind, surface",
    [
        ("nan-at-prefill", "grpc"),
        ("nan-at-prefill", "http"),
        ("nan-in-decode", "http-stream"),
        ("sampling-raises", "python"),
    ],
)
def test_a_request_whose_step_fails_ends_alone_in_a_cluster(server, case, without, kind, surface):
    """1 prefill + 1 decode instance, 16 concurrent greedy gRPC streams and the bad request sent
    with them (its prompt may share their prefill steps, and it decodes beside them): the bad one
    gets its error, naming it; each stream completes with the tokens and text of the run without
    it (transformers' greedy output); no instance failed or was replaced; nothing is in use
    afterwards. The streams' largest gap between chunks is printed."""
    names = [info.name for info in server.info()]
    outputs, message = asyncio.run(_wave(server, case.prompts, _send_bad(server, case, kind, surface)))
    _, _, cause = _bad_request(case, kind)
    assert "request '" in message and cause in message, message
    assert [tokens for tokens, _, _ in outputs] == case.expected
    assert [(tokens, text) for tokens, text, _ in outputs] == [(tokens, text) for tokens, text, _ in without]
    gap = max(gap for _, _, gap in outputs)
    print(f"{kind}: the streams' largest gap between chunks {gap:.3f} s (without the bad request "
          f"{max(g for _, _, g in without):.3f} s)")  # fmt: skip
    assert gap < MAX_STREAM_GAP_S
    wait_nothing_in_use(server.info, server.frontend)  # every block free, no failure
    assert [info.name for info in server.info()] == names  # none replaced
