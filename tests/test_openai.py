"""The OpenAI-compatible HTTP endpoint, driven by the official ``openai`` client (raw HTTP where
the client would not send the body), in front of a 1 prefill + 1 decode cluster."""

import json
import re
import ssl
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from conftest import SCHEMA, check_structured, make_tls_cert, random_prompts, wait_nothing_in_use
from transformers import AutoTokenizer

from distserve import LLM, SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.frontend import Frontend
from distserve.entrypoints.openai_chat import render_chat
from distserve.entrypoints.openai_server import start_http_server
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.model_executor.tiny_models import ensure_tiny_model

MODEL = "tiny-llama"
KEY = "sk-test"
NUM_KV_BLOCKS = 256
PROMPT = "The cache block"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the river?"}]
LONG = 1000  # tokens of a request the tests cancel: about 3 s of decoding here, far longer than they wait


@pytest.fixture(scope="module")
def server(ray_cluster):
    config = make_cluster_config(model=MODEL, num_kv_blocks=NUM_KV_BLOCKS, prefill={}, decode={}, dtype="float32")
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0, api_key=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    """Greedy output of the offline engine for a prompt (text or token ids)."""
    llm = LLM(MODEL, num_kv_blocks=NUM_KV_BLOCKS, dtype="float32")

    def greedy(prompt, max_tokens):
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]

    yield greedy
    llm.shutdown()


def _request(server, path, body=None, key=KEY, method=None, context=None, port=None):
    """(status, parsed JSON or text) of a raw HTTP request."""
    scheme = "https" if context else "http"
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(
        f"{scheme}://127.0.0.1:{port or server.http_port}{path}", data=data, headers=headers, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def _metric(server, name):
    _, text = _request(server, "/metrics", method="GET")
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE))


def _chat_prompt_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_equals_offline_greedy_streamed_or_not(server, client, offline):
    ref = offline(PROMPT, 12)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.created <= time.time()
    [choice] = out.choices
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    num_prompt = len(server.frontend.tokenizer.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt, len(ref.output_token_ids))
    assert out.usage.total_tokens == num_prompt + len(ref.output_token_ids)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == out.usage


def test_token_id_prompts_give_the_offline_tokens(client, offline):
    prompts = [[5, 77, 300, 12, 9], [400, 401, 402]]
    refs = [offline(p, 10) for p in prompts]
    out = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt, ref in zip(out.choices, prompts, refs):
        assert (choice.text, choice.token_ids, choice.prompt_token_ids) == (ref.text, ref.output_token_ids, prompt)
    assert out.usage.prompt_tokens == sum(map(len, prompts))

    stream = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].prompt_token_ids == prompts[0]
    assert [t for c in chunks for t in c.token_ids] == refs[0].output_token_ids


def test_chat_equals_offline_greedy_on_the_rendered_prompt(server, client, offline):
    ids = _chat_prompt_ids(server.frontend.tokenizer, MESSAGES)
    ref = offline(ids, 10)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(ref.output_token_ids))

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *deltas, usage_chunk = chunks
    assert deltas[0].object == "chat.completion.chunk" and deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == ref.text
    assert deltas[-1].choices[0].finish_reason == ref.finish_reason
    assert usage_chunk.choices == [] and _counts(usage_chunk.usage) == _counts(out.usage)
    # The same prompt just ran, and its blocks were found cached; but a server not started with
    # enable_prompt_tokens_details does not say so (tests/test_tenants.py has one that does).
    assert usage_chunk.usage.prompt_tokens_details is None

    # text parts are joined by newlines
    parts = [{"role": "user", "content": [{"type": "text", "text": "Where is"}, {"type": "text", "text": "it?"}]}]
    joined = [{"role": "user", "content": "Where is\nit?"}]
    a, b = (
        client.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0) for m in (parts, joined)
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert _counts(a.usage) == _counts(b.usage)


def _counts(usage) -> tuple[int, int, int]:
    """An OpenAI usage's token counts, without the cached ones, which depend on what ran before."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_chat_default_max_tokens_fills_the_context(server, client):
    tokenizer, max_len = server.frontend.tokenizer, server.frontend.max_model_len

    def num_tokens(words):
        return len(_chat_prompt_ids(tokenizer, [{"role": "user", "content": " river" * words}]))

    base, per_word = num_tokens(0), num_tokens(1) - num_tokens(0)
    words = (max_len - 8 - base) // per_word
    messages = [{"role": "user", "content": " river" * words}]
    num_prompt = num_tokens(words)
    assert max_len - 40 < num_prompt < max_len
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == max_len - num_prompt and out.choices[0].finish_reason == "length"


def test_batch_and_n_give_indexed_choices(server, client):
    prompts = ["The cache", "A river", "Music"]
    kwargs = dict(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0.9, seed=3)
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    tokenizer = server.frontend.tokenizer
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    # seeded, so the same request samples the same texts
    assert [c.text for c in client.completions.create(**kwargs).choices] == [c.text for c in out.choices]

    finished = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert sorted(finished) == list(range(6))

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=3)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DROP = object()


def _with(base, **changes):
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def _case(path, body, status, needle, id):
    return pytest.param(path, body, status, needle, id=id)


C, CH = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    _case(C, _with(COMPLETION, max_tokens="ten"), 400, "max_tokens", "max_tokens-string"),
    _case(C, _with(COMPLETION, max_tokens=True), 400, "max_tokens", "max_tokens-bool"),
    _case(C, _with(COMPLETION, max_tokens=0), 400, "max_tokens", "max_tokens-zero"),
    _case(C, _with(COMPLETION, max_tokens=2.5), 400, "max_tokens", "max_tokens-float"),
    _case(C, _with(COMPLETION, temperature=[1]), 400, "temperature", "temperature-list"),
    _case(C, _with(COMPLETION, temperature=-1), 400, "temperature", "temperature-negative"),
    _case(C, _with(COMPLETION, temperature=float("nan")), 400, "temperature", "temperature-nan"),
    _case(C, _with(COMPLETION, top_p=1.5), 400, "top_p", "top_p-above-1"),
    _case(C, _with(COMPLETION, top_k=-5), 400, "top_k", "top_k-negative"),
    _case(C, _with(COMPLETION, n=0), 400, "n must be an integer >= 1", "n-zero"),
    _case(C, _with(COMPLETION, n=1000), 400, "cluster.limits.max_n", "n-too-many"),
    _case(C, _with(COMPLETION, seed="x"), 400, "seed", "seed-string"),
    _case(C, _with(COMPLETION, stop=5), 400, "stop", "stop-int"),
    _case(C, _with(COMPLETION, stop=[""]), 400, "stop", "stop-empty"),
    _case(C, _with(COMPLETION, stop_token_ids=["a"]), 400, "stop_token_ids", "stop_token_ids-strings"),
    _case(C, _with(COMPLETION, stream="yes"), 400, "stream", "stream-string"),
    _case(C, _with(COMPLETION, stream_options={"include_usage": True}), 400, "stream_options", "options-no-stream"),
    _case(C, _with(COMPLETION, prompt=""), 400, "empty", "prompt-empty"),
    _case(C, _with(COMPLETION, prompt=[]), 400, "prompt", "prompt-empty-list"),
    _case(C, _with(COMPLETION, prompt=DROP), 400, "prompt", "prompt-missing"),
    _case(C, _with(COMPLETION, prompt=[1, "a"]), 400, "prompt", "prompt-mixed"),
    _case(C, _with(COMPLETION, prompt=[10**6]), 400, "token ids", "prompt-token-out-of-vocab"),
    _case(C, _with(COMPLETION, prompt=[5] * 2000), 400, "context", "prompt-too-long"),
    _case(C, _with(COMPLETION, prompt=["ok", ""]), 400, "empty", "batch-with-empty-prompt"),
    _case(C, _with(COMPLETION, frobnicate=1), 400, "frobnicate", "unknown-field"),
    _case(C, _with(COMPLETION, logprobs=21), 400, "logprobs", "logprobs-too-many"),
    _case(C, _with(COMPLETION, echo="yes"), 400, "echo", "echo-string"),
    _case(C, _with(COMPLETION, best_of=3), 400, "best_of", "best_of"),
    _case(C, _with(COMPLETION, suffix="end"), 400, "suffix", "suffix"),
    _case(C, _with(COMPLETION, use_beam_search=True, stop=["x"]), 400, "stop", "use_beam_search-with-stop"),
    _case(C, _with(COMPLETION, logit_bias={"5": "x"}), 400, "logit_bias", "logit_bias-string"),
    _case(C, _with(COMPLETION, logit_bias={"5000": 1}), 400, "logit_bias", "logit_bias-out-of-vocab"),
    _case(C, _with(COMPLETION, frequency_penalty=3), 400, "frequency_penalty", "frequency_penalty"),
    _case(C, _with(COMPLETION, prompt_logprobs=1, stream=True), 400, "prompt_logprobs", "prompt_logprobs-stream"),
    _case(C, _with(COMPLETION, structured_outputs={"regex": "a", "choice": ["b"]}), 400, "exactly one", "two-kinds"),
    _case(C, _with(COMPLETION, model="gpt-4"), 404, "gpt-4", "wrong-model"),
    _case(C, b"{not json", 400, "JSON", "not-json"),
    _case(C, [COMPLETION], 400, "object", "body-is-a-list"),
    _case(CH, _with(CHAT, messages=DROP), 400, "messages", "messages-missing"),
    _case(CH, _with(CHAT, messages=[]), 400, "messages", "messages-empty"),
    _case(CH, _with(CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400, "role", "bad-role"),
    _case(CH, _with(CHAT, messages=[{"role": "user"}]), 400, "content", "content-missing"),
    _case(CH, _with(CHAT, messages=["hi"]), 400, "messages[0]", "message-not-object"),
    _case(
        CH,
        _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "image_url",
        "image-part",
    ),
    _case(CH, _with(CHAT, messages=[{"role": "user", "content": "hi", "mood": 1}]), 400, "mood", "message-field"),
    _case(CH, _with(CHAT, messages=[{"role": "user", "content": "river " * 1100}]), 400, "context", "chat-too-long"),
    _case(CH, _with(CHAT, max_completion_tokens=-1), 400, "max_completion_tokens", "max_completion_tokens"),
    _case(CH, _with(CHAT, tools=[{"type": "function"}]), 400, "tools", "tools"),
    _case(CH, _with(CHAT, response_format={"type": "yaml"}), 400, "response_format", "response_format"),
    _case(CH, _with(CHAT, top_logprobs=2), 400, "logprobs", "chat-top_logprobs-without-logprobs"),
    _case(CH, _with(CHAT, echo=True), 400, "echo", "chat-echo"),
    _case(CH, _with(CHAT, chat_template="{{ messages }}"), 400, "chat_template", "chat-template"),
    _case(CH, _with(CHAT, presence_penalty="1"), 400, "presence_penalty", "presence_penalty"),
    _case(CH, _with(CHAT, prompt="hi"), 400, "prompt", "chat-prompt-field"),
    _case(CH, _with(CHAT, model="other"), 404, "other", "chat-wrong-model"),
    _case("/v1/embeddings", COMPLETION, 404, "/v1/embeddings", "unknown-route"),
]


@pytest.mark.parametrize("path, body, status, needle", BAD_REQUESTS)
def test_bad_request_is_refused_naming_the_problem(server, path, body, status, needle):
    got, reply = _request(server, path, body)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle.lower() in error["message"].lower(), error
    assert error["type"] == "invalid_request_error"
    if status == 404 and path != "/v1/embeddings":
        assert error["code"] == "model_not_found" and error["param"] == "model"


def test_serves_after_bad_requests_and_accepts_neutral_values(server, client):
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        echo=False,
        best_of=1,
        frequency_penalty=0,
        logit_bias={},
        user="me",
        extra_body={"top_k": -1, "ignore_eos": True, "skip_special_tokens": False},
    )
    assert out.usage.completion_tokens == 3
    status, _ = _request(server, "/v1/completions", COMPLETION)
    assert status == 200
    assert _request(server, "/v1/completions", method="GET")[0] == 405


def _stream_events(server, path, body):
    """The data events of a streamed request, parsed, up to [DONE]."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [line[6:] for line in response.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_vllm_clients_requests_are_served_with_usage_on_every_chunk(server):
    """The body `vllm bench serve --backend vllm` sends (with its sampling flags at their neutral
    values), then guidellm's `continuous_usage_stats`: every chunk has its choice's usage so far."""
    bench = {
        "model": MODEL,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": 6,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "best_of": 1,
        "use_beam_search": False,
    }
    *chunks, last = _stream_events(server, "/v1/completions", bench)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert not any("usage" in c for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)

    for path, body in (
        ("/v1/completions", bench),
        ("/v1/chat/completions", {**_with(bench, prompt=DROP, logprobs=DROP), "messages": MESSAGES}),
    ):
        body = _with(body, stream_options={"include_usage": True, "continuous_usage_stats": True})
        *chunks, last = _stream_events(server, path, body)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 6, counts
        for c in chunks:
            usage = c["usage"]
            assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if path == "/v1/completions":
            assert "".join(c["choices"][0]["text"] for c in chunks) == text


# The tests below need the engine to honour the fields (logprobs, logit bias, structured outputs).


def test_a_log_likelihood_request_equals_transformers_log_softmax(server, reference_model):
    """What lm-eval's local-completions model sends to score a continuation: token-id prompts, one
    token, echo and logprobs. Each prompt token's logprob is transformers' log-softmax at it."""
    model = reference_model(MODEL)
    prompts = random_prompts([12, 40], model.config.vocab_size, seed=8)
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    status, reply = _request(server, "/v1/completions", body)
    assert status == 200, reply
    for prompt, choice in zip(prompts, sorted(reply["choices"], key=lambda c: c["index"])):
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(prompt) + 1 and got[0] is None
        with torch.inference_mode():
            want = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        expected = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(got[1 : len(prompt)]), expected, atol=1e-4)
        assert got[-1] == pytest.approx(want[-1].max().item(), abs=1e-4)  # greedy: the likeliest


def test_completion_logprobs_with_echo_streamed_or_not(server, client, offline):
    ref = offline(PROMPT, 5)
    tokenizer = server.frontend.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    ids = prompt_ids + ref.output_token_ids
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True)
    out = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    [choice] = out.choices
    assert choice.text == PROMPT + ref.text
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for i in range(1, len(ids)):
        top = lp.top_logprobs[i]
        assert lp.token_logprobs[i] <= 0 and top[lp.tokens[i]] == lp.token_logprobs[i]
        assert 2 <= len(top) <= 3  # the 2 likeliest and the token itself
    for i in range(len(prompt_ids), len(ids)):  # greedy: each output token is the likeliest
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()))

    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)

    prompt_only = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1}
    ).choices[0]
    positions = prompt_only.prompt_logprobs
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for i, position in enumerate(positions[1:], 1):
        own = position[str(prompt_ids[i])]
        assert own["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-4)
        assert own["rank"] >= 1 and own["decoded_token"] == lp.tokens[i]
        assert any(p["rank"] == 1 for p in position.values())


def test_chat_logprobs_streamed_or_not(server, client, offline):
    tokenizer = server.frontend.tokenizer
    ref = offline(_chat_prompt_ids(tokenizer, MESSAGES), 5)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ref.output_token_ids]
    for c in content:
        assert c.bytes == list(c.token.encode("utf-8", errors="replace"))
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)  # greedy: the likeliest

    stream = client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    streamed = [t for chunk in stream if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [c.token for c in content]


def test_sampling_fields_reach_the_engine(client, offline):
    ref = offline(PROMPT, 4)
    first = ref.output_token_ids[0]
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert banned.choices[0].token_ids[0] != first
    allowed = [40, 41, 42]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"allowed_token_ids": allowed, "return_token_ids": True}
    )
    assert set(out.choices[0].token_ids) <= set(allowed)


def test_structured_outputs_constrain_the_output(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    chat = client.chat.completions.create(**kwargs, extra_body={"structured_outputs": {"choice": ["river", "sea"]}})
    assert chat.choices[0].message.content in ("river", "sea")
    schema = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    free = dict(kwargs, max_tokens=300, temperature=1.0)
    for seed in range(2):  # on the prefill instance the opening brace, on the decode instance the rest
        [choice] = client.chat.completions.create(**free, seed=seed, response_format=schema).choices
        assert choice.finish_reason == "stop", choice.message.content
        check_structured("json", choice.message.content)
    [choice] = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=300,
        seed=1,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
    ).choices
    check_structured("regex", choice.text)


def test_tokenize_and_detokenize_as_vllm_serves_them(server):
    tokenizer = server.frontend.tokenizer
    status, reply = _request(server, "/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False})
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert status == 200 and reply == {"count": len(ids), "max_model_len": server.frontend.max_model_len, "tokens": ids}
    assert _request(server, "/detokenize", {"model": MODEL, "tokens": ids}) == (200, {"prompt": PROMPT})
    status, reply = _request(server, "/detokenize", {"tokens": [len(tokenizer) + 3]})
    assert status == 400 and "token ids must be in" in reply["error"]["message"]
    assert _request(server, "/tokenize", {"prompt": PROMPT}, key=None)[0] == 401


def test_api_key_is_needed_except_for_health(server):
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    for path, body in (("/v1/completions", COMPLETION), ("/v1/models", None), ("/metrics", None)):
        status, reply = _request(server, path, body, key=None)
        assert status == 401 and reply["error"]["type"] == "authentication_error", (path, reply)
    assert _request(server, "/health", key=None) == (200, {"status": "serving"})


def test_draining_server_is_unhealthy_and_refuses(server):
    server.frontend.draining = True
    try:
        assert _request(server, "/health", key=None)[0] == 503
        status, reply = _request(server, "/v1/completions", COMPLETION)
        assert status == 503 and "shutting down" in reply["error"]["message"]
    finally:
        server.frontend.draining = False
    assert _request(server, "/health", key=None)[0] == 200


def test_metrics_show_latencies_and_instance_gauges(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    status, text = _request(server, "/metrics", method="GET")
    assert status == 200
    assert _metric(server, "distserve_time_to_first_token_seconds_count") > 0
    for role in ("prefill", "decode"):
        assert re.search(rf'^distserve_instance_kv_cache_usage{{.*role="{role}".*}} ', text, re.MULTILINE)
        blocks = rf'^distserve_instance_kv_cache_blocks{{instance="[^"]+",kv_cache_dtype="auto",role="{role}"}} [1-9]'
        assert re.search(blocks, text, re.MULTILINE)
        assert re.search(rf'^distserve_instance_healthy{{.*role="{role}".*}} 1\.0$', text, re.MULTILINE)


def test_client_leaving_early_cancels_and_frees_blocks(server, client):
    finished = _metric(server, 'distserve_requests_total{finish_reason="length"}')
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_nothing_in_use(server.info, server.frontend)

    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG, extra_body={"ignore_eos": True}
        )
    wait_nothing_in_use(server.info, server.frontend)
    # both were cancelled, not run to their length
    assert _metric(server, 'distserve_requests_total{finish_reason="length"}') == finished


def test_tls_server_with_an_admission_limit_answers_429(server, tmp_path):
    cert, key = make_tls_cert(tmp_path)
    config = ServerConfig(host="127.0.0.1", http_port=0, tls_cert=cert, tls_key=key, max_pending_requests=1)
    frontend = Frontend(server.cluster, config)
    runner, port = server.loop.run(start_http_server(frontend, config))
    context = ssl.create_default_context(cafile=cert)
    try:
        body = _with(COMPLETION, max_tokens=LONG, stream=True, ignore_eos=True)
        request = urllib.request.Request(
            f"https://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60, context=context) as stream:
            assert stream.readline().startswith(b"data: {")
            status, reply = _request(server, "/v1/completions", COMPLETION, context=context, port=port)
            assert status == 429 and reply["error"]["type"] == "rate_limit_error"
        wait_nothing_in_use(server.info, frontend)  # this server's own frontend: its admissions
        assert _request(server, "/v1/completions", COMPLETION, context=context, port=port)[0] == 200
    finally:
        server.loop.run(runner.cleanup())


def test_a_batch_is_admitted_whole_or_refused_whole(server):
    """A batch that does not fit under the admission limit is refused before any of its prompts
    starts; one larger than the limit itself can never run, so it is a 400, not a 429."""
    config = ServerConfig(host="127.0.0.1", http_port=0, max_pending_requests=3)
    frontend = Frontend(server.cluster, config)
    runner, port = server.loop.run(start_http_server(frontend, config))
    batch = _with(COMPLETION, prompt=[PROMPT, "Another prompt", "A third"], max_tokens=4)
    try:
        body = json.dumps(_with(COMPLETION, max_tokens=LONG, stream=True, ignore_eos=True)).encode()
        busy = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(busy, timeout=60) as stream:
            assert stream.readline().startswith(b"data: {")
            status, reply = _request(server, "/v1/completions", batch, port=port)
            assert status == 429 and reply["error"]["type"] == "rate_limit_error"
            assert len(server.cluster.orchestrator.requests) == 1  # only the stream: nothing of the batch ran
        status, reply = _request(server, "/v1/completions", _with(batch, n=2), port=port)
        assert status == 400 and "more than the server runs at once (3)" in reply["error"]["message"]
        wait_nothing_in_use(server.info, frontend)  # this server's own frontend: its admissions
        status, reply = _request(server, "/v1/completions", batch, port=port)
        assert status == 200 and len(reply["choices"]) == 3
    finally:
        server.loop.run(runner.cleanup())


def test_default_chat_template_for_a_tokenizer_without_one():
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(MODEL))
    tokenizer.chat_template = None
    text = render_chat(tokenizer, MESSAGES)
    assert text == "<|bos|>system: Be brief.\nuser: Where is the river?\nassistant:"
