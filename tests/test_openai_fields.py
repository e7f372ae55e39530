"""The HTTP server's request fields, field by field over its table (each field honoured, accepted at
its neutral values, ignored, or refused naming it), the docs' table, and the logprobs formatting.
No cluster: requests are parsed against the tiny model's tokenizer, and answered end to end by a
frontend that plays back scripted outputs."""

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from distserve.core.outputs import RequestOutput, TokenLogprobs
from distserve.core.request_limits import RequestLimits
from distserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from distserve.entrypoints.openai_errors import HTTPError
from distserve.entrypoints.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, FIELDS, IGNORED, NEUTRAL, field_table
from distserve.entrypoints.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json, token_text
from distserve.entrypoints.openai_protocol import parse_chat, parse_completion
from distserve.entrypoints.openai_server import build_app
from distserve.entrypoints.server_config import ServerConfig
from distserve.model_executor.tiny_models import ensure_tiny_model

MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024
LIMITS = RequestLimits().resolve(MAX_MODEL_LEN)
# The tiny model's template, with the variables the chat fields may give it shown.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if documents %}[docs:{{ documents|length }}]{% endif %}"
    "{% if reasoning_effort %}[effort:{{ reasoning_effort }}]{% endif %}"
    "{% if mood %}[mood:{{ mood }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
C, CH = "completions", "chat"
BASE = {C: {"prompt": "hi", "max_tokens": 2}, CH: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
PARSE = {C: parse_completion, CH: parse_chat}
TABLES = {C: COMPLETION_FIELDS, CH: CHAT_FIELDS}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(MODEL))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def frontend(tokenizer):
    return SimpleNamespace(
        model_name=MODEL,
        tokenizer=tokenizer,
        max_model_len=MAX_MODEL_LEN,
        max_request_tokens=MAX_MODEL_LEN,
        sampling_defaults={},
        limits=LIMITS,
    )


def _so(**kind):
    return StructuredOutputsParams(**kind)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}

# field -> [(value, expected, more body)]: the request parses, and `expected` holds of it. Keys of
# `expected` are SamplingParams fields of the first prompt's job, or "call.<attribute>", "choices"
# (how many), "prompt" and "text" (the first job's prompt, and its text as sent); {}: the same params
# as without the field. (route, field) keys are for one route only.
ACCEPTED = {
    "model": [(MODEL, {}, {})],
    "prompt": [([5, 6, 7], {"prompt": [5, 6, 7], "text": None}, {}), (["a", "b"], {"choices": 2}, {})],
    "messages": [
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {"text": "<|user|>hi\n<|assistant|>"}, {})
    ],
    (C, "max_tokens"): [(5, {"max_tokens": 5}, {}), (MAX_MODEL_LEN, {"max_tokens": MAX_MODEL_LEN}, {})],
    (CH, "max_tokens"): [(5, {"max_tokens": 5}, {})],
    "max_completion_tokens": [(7, {"max_tokens": 7}, {"max_tokens": 3})],
    "n": [(3, {"choices": 3, "call.n": 3, "n": 3}, {})],
    "best_of": [(1, {}, {}), (2, {"choices": 2}, {"n": 2})],
    "temperature": [(0, {"temperature": 0}, {})],
    "top_p": [(0.5, {"top_p": 0.5}, {})],
    "seed": [(7, {"seed": 7}, {})],
    "stop": [("a", {"stop": ["a"]}, {}), (["a", "b"], {"stop": ["a", "b"]}, {})],
    "stream": [(True, {"call.stream": True}, {})],
    "stream_options": [
        ({"include_usage": True}, {"call.include_usage": True, "call.continuous_usage": False}, {"stream": True}),
        (
            {"include_usage": True, "continuous_usage_stats": True},
            {"call.include_usage": True, "call.continuous_usage": True},
            {"stream": True},
        ),
        ({"continuous_usage_stats": True}, {"call.continuous_usage": False}, {"stream": True}),  # as vLLM
        ({}, {}, {}),
    ],
    "frequency_penalty": [(0.5, {"frequency_penalty": 0.5}, {})],
    "presence_penalty": [(-1, {"presence_penalty": -1}, {})],
    "logit_bias": [({"5": 10, "6": -200}, {"logit_bias": {5: 10.0, 6: -100.0}}, {})],
    (C, "logprobs"): [
        (2, {"logprobs": 2, "call.logprobs": 2, "prompt_logprobs": None}, {}),
        (0, {"logprobs": 0, "call.logprobs": 0}, {}),
    ],
    (CH, "logprobs"): [(True, {"logprobs": 0, "call.logprobs": 0}, {}), (False, {"logprobs": None}, {})],
    "top_logprobs": [(3, {"logprobs": 3, "call.logprobs": 3}, {"logprobs": True}), (0, {}, {})],
    (C, "echo"): [
        (True, {"call.echo": True, "prompt_logprobs": None}, {}),
        (True, {"call.echo": True, "logprobs": 1, "prompt_logprobs": 1}, {"logprobs": 1}),
        (True, {"prompt_logprobs": 3}, {"logprobs": 1, "prompt_logprobs": 3}),
    ],
    (CH, "echo"): [(False, {}, {})],
    "suffix": [("", {}, {})],
    "user": [("me", {}, {})],
    "top_k": [(-1, {"top_k": 0}, {}), (5, {"top_k": 5}, {})],
    "min_p": [(0.1, {"min_p": 0.1}, {})],
    "repetition_penalty": [(1.0, {}, {}), (1.2, {"repetition_penalty": 1.2}, {})],
    "min_tokens": [(1, {"min_tokens": 1}, {})],
    "stop_token_ids": [([5], {"stop_token_ids": [5]}, {})],
    "ignore_eos": [(True, {"ignore_eos": True}, {})],
    "include_stop_str_in_output": [(True, {"include_stop_str_in_output": True}, {})],
    "skip_special_tokens": [(False, {"skip_special_tokens": False}, {})],
    "spaces_between_special_tokens": [(True, {}, {})],
    "allowed_token_ids": [([5, 6], {"allowed_token_ids": [5, 6]}, {})],
    "bad_words": [(["river"], {"bad_words": ["river"]}, {})],
    "prompt_logprobs": [(2, {"prompt_logprobs": 2, "call.prompt_logprobs": True}, {})],
    "truncate_prompt_tokens": [
        (3, {"truncate_prompt_tokens": 3}, {}),
        (-1, {"truncate_prompt_tokens": MAX_MODEL_LEN}, {}),
    ],
    "truncation_side": [("left", {}, {})],
    "use_beam_search": [
        (False, {}, {}),
        (True, {"beam_width": 1, "n": 1}, {}),
        (True, {"beam_width": 3, "n": 3, "choices": 3}, {"n": 3}),
    ],
    "length_penalty": [(2.0, {}, {}), (2.0, {"length_penalty": 2.0}, {"use_beam_search": True})],
    "early_stopping": [
        (True, {}, {}),
        ("never", {}, {}),
        ("never", {"early_stopping": "never"}, {"use_beam_search": True}),
    ],
    "watermarking": [(False, {}, {})],
    "thinking_token_budget": [(-1, {}, {})],
    (C, "add_special_tokens"): [(True, {"prompt": "hi"}, {}), (False, {"prompt": "ENCODED:hi", "text": "hi"}, {})],
    (CH, "add_special_tokens"): [(False, {}, {}), (True, {"prompt": "ENCODED+:<|user|>hi\n<|assistant|>"}, {})],
    "response_format": [
        ({"type": "text"}, {"structured_outputs": None}, {}),
        ({"type": "json_object"}, {"structured_outputs": _so(json_object=True)}, {}),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}},
            {"structured_outputs": _so(json=SCHEMA)},
            {},
        ),
    ],
    "structured_outputs": [
        ({"regex": "a+"}, {"structured_outputs": _so(regex="a+")}, {}),
        ({"choice": ["x", "y"]}, {"structured_outputs": _so(choice=["x", "y"])}, {}),
        ({"json": SCHEMA, "disable_fallback": False}, {"structured_outputs": _so(json=SCHEMA)}, {}),
        ({"grammar": 'root ::= "a"'}, {"structured_outputs": _so(grammar='root ::= "a"')}, {}),
        ({"json_object": True, "regex": None}, {"structured_outputs": _so(json_object=True)}, {}),
    ],
    "guided_json": [(SCHEMA, {"structured_outputs": _so(json=SCHEMA)}, {})],
    "guided_regex": [("a+", {"structured_outputs": _so(regex="a+")}, {})],
    "guided_choice": [(["x"], {"structured_outputs": _so(choice=["x"])}, {})],
    "guided_grammar": [('root ::= "a"', {"structured_outputs": _so(grammar='root ::= "a"')}, {})],
    "guided_decoding_backend": [("xgrammar", {}, {})],
    "priority": [(-5, {"call.priority": -5}, {})],
    "cache_salt": [("tenant-a", {"cache_salt": "tenant-a"}, {}), ("x" * 128, {"cache_salt": "x" * 128}, {})],
    "request_id": [("abc", {"call.request_id": "abc"}, {})],
    "session_id": [("s1", {}, {})],
    "return_token_ids": [(True, {"call.return_token_ids": True}, {})],
    "return_tokens_as_token_ids": [(True, {"call.tokens_as_ids": True}, {})],
    "return_token_offsets": [(True, {}, {})],
    "return_mm_kwargs": [(False, {}, {})],
    "stream_interval": [(4, {}, {})],
    "routed_experts_prompt_start": [(0, {}, {})],
    "vllm_xargs": [({}, {}, {})],
    "tools": [([], {}, {})],
    "tool_choice": [("none", {}, {})],
    "functions": [([], {}, {})],
    "function_call": [("none", {}, {})],
    "parallel_tool_calls": [(True, {}, {})],
    "reasoning_effort": [("low", {"text": "<|user|>hi\n[effort:low]<|assistant|>"}, {})],
    "include_reasoning": [(True, {}, {})],
    "add_generation_prompt": [(False, {"text": "<|user|>hi\n"}, {})],
    "continue_final_message": [
        (True, {"text": "<|user|>hi"}, {}),
        (True, {"text": "<|user|>hi"}, {"add_generation_prompt": False}),
    ],
    "documents": [([{"title": "a", "text": "b"}], {"text": "<|user|>hi\n[docs:1]<|assistant|>"}, {})],
    "chat_template_kwargs": [({"mood": "calm"}, {"text": "<|user|>hi\n[mood:calm]<|assistant|>"}, {})],
    "mm_processor_kwargs": [({}, {}, {})],
    "media_io_kwargs": [({}, {}, {})],
    "return_prompt_text": [(False, {}, {})],
}

# field -> [(value, param, more body)]: the request is refused with 400, `param` (default: the
# field) naming what is wrong, and the message naming it too.
REFUSED = {
    "model": [(5, None, {})],
    "prompt": [(5, None, {}), ([1, "a"], None, {}), ([], None, {})],
    "messages": [("hi", None, {}), ([], None, {}), ([{"role": "wizard", "content": "hi"}], "messages[0].role", {})],
    "max_tokens": [("ten", None, {}), (0, None, {}), (True, None, {}), (MAX_MODEL_LEN + 1, None, {})],
    "max_completion_tokens": [(0, None, {}), (2.5, None, {}), (MAX_MODEL_LEN + 1, None, {})],
    "n": [(0, None, {}), (17, None, {}), ("2", None, {})],
    "best_of": [(2, None, {}), (1, None, {"n": 2}), ("1", None, {})],
    "temperature": [(-1, None, {}), ("hot", None, {}), (10**309, None, {})],  # an int past the largest float
    "top_p": [(1.5, None, {}), (0, None, {})],
    "seed": [("x", None, {}), (1.5, None, {})],
    "stop": [(5, None, {}), ([""], None, {}), ([1], None, {})],
    "stream": [("yes", None, {})],
    "stream_options": [
        ({"include_usage": True}, None, {}),
        ({"frobnicate": True}, "stream_options.frobnicate", {"stream": True}),
        ({"include_usage": "yes"}, "stream_options.include_usage", {"stream": True}),
        ({"continuous_usage_stats": 1}, "stream_options.continuous_usage_stats", {"stream": True}),
        ("usage", None, {"stream": True}),
    ],
    "frequency_penalty": [(3, None, {}), ("x", None, {})],
    "presence_penalty": [(-3, None, {}), (True, None, {})],
    "logit_bias": [({"a": 1}, None, {}), ({"5": "x"}, None, {}), ([1], None, {})],
    (C, "logprobs"): [(21, None, {}), (-1, None, {}), (True, None, {})],
    (CH, "logprobs"): [(1, None, {}), ("true", None, {})],
    "top_logprobs": [(3, None, {}), (21, None, {"logprobs": True}), (-1, None, {"logprobs": True}), ("x", None, {})],
    (C, "echo"): [("yes", None, {})],
    (CH, "echo"): [(True, None, {})],
    "suffix": [("end", None, {}), (5, None, {})],
    "user": [(5, None, {})],
    "top_k": [(-5, None, {}), ("x", None, {})],
    "min_p": [(2, None, {}), ("x", None, {})],
    "repetition_penalty": [(0, None, {}), (3, None, {}), ("x", None, {})],
    "min_tokens": [(-1, None, {}), (3, None, {}), ("x", None, {})],
    "stop_token_ids": [(["a"], None, {}), ([-1], None, {}), (5, None, {})],
    "ignore_eos": [("x", None, {})],
    "include_stop_str_in_output": [(1, None, {})],
    "skip_special_tokens": [("x", None, {})],
    "spaces_between_special_tokens": [(False, None, {}), ("x", None, {})],
    "allowed_token_ids": [([], None, {}), (["a"], None, {})],
    "bad_words": [("river", None, {}), ([""], None, {})],
    "prompt_logprobs": [(21, None, {}), ("x", None, {}), (1, None, {"stream": True})],
    "truncate_prompt_tokens": [(0, None, {}), (-2, None, {}), ("x", None, {})],
    "truncation_side": [("right", None, {}), (1, None, {})],
    "use_beam_search": [("x", None, {}), (True, "stop", {"stop": "x"}), (True, "n", {"n": 17})],
    "length_penalty": [("x", None, {})],
    "early_stopping": [(5, None, {})],
    "watermarking": [(True, None, {})],
    "repetition_detection": [({"max_pattern_size": 2}, None, {})],
    "thinking_token_budget": [(100, None, {})],
    "logprob_token_ids": [([5], None, {})],
    "logits_processors": [(["x"], None, {})],
    "add_special_tokens": [("x", None, {})],
    "response_format": [
        ("json", None, {}),
        ({"type": "yaml"}, "response_format.type", {}),
        ({"type": "json_schema"}, "response_format.json_schema", {}),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema", {}),
        ({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}, "response_format.json_schema.x", {}),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict",
            {},
        ),
        ({"type": "text", "extra": 1}, "response_format.extra", {}),
        ({"type": "structural_tag"}, None, {}),
        ({"type": "json_object"}, "structured_outputs", {"structured_outputs": {"regex": "a"}}),
    ],
    "structured_outputs": [
        ({}, None, {}),
        ({"regex": "a", "choice": ["b"]}, None, {}),
        ({"frobnicate": 1}, "structured_outputs.frobnicate", {}),
        ({"regex": 5}, "structured_outputs.regex", {}),
        ({"choice": []}, None, {}),
        ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", {}),
        ({"regex": "a", "disable_fallback": True}, "structured_outputs.disable_fallback", {}),
        ("a+", None, {}),
    ],
    "guided_json": [(5, None, {})],
    "guided_regex": [(5, None, {}), ("", None, {})],
    "guided_choice": [("x", None, {}), ([], None, {})],
    "guided_grammar": [(["x"], None, {})],
    "guided_decoding_backend": [(5, None, {})],
    "guided_whitespace_pattern": [(" ", None, {})],
    "priority": [("high", None, {}), (2**63, None, {})],
    "request_id": [(5, None, {})],
    "session_id": [(5, None, {})],
    "return_token_ids": [("x", None, {})],
    "return_tokens_as_token_ids": [("x", None, {})],
    "return_token_offsets": [("x", None, {})],
    "return_mm_kwargs": [("x", None, {})],
    "stream_interval": [("x", None, {})],
    "routed_experts_prompt_start": [(3, None, {})],
    "cache_salt": [("", None, {}), ("x" * 129, None, {}), ("a/b", None, {}), ("a@b", None, {}), (5, None, {})],
    "kv_transfer_params": [({"do_remote_decode": True}, None, {})],
    "ec_transfer_params": [({"a": 1}, None, {})],
    "vllm_xargs": [({"a": 1}, None, {})],
    "prompt_embeds": [("AAAA", None, {})],
    "tools": [([{"type": "function", "function": {"name": "f"}}], None, {}), ("x", None, {})],
    "tool_choice": [("auto", None, {})],
    "functions": [([{"name": "f"}], None, {})],
    "function_call": [("auto", None, {})],
    "parallel_tool_calls": [("x", None, {})],
    "reasoning_effort": [(5, None, {})],
    "include_reasoning": [(False, None, {})],
    "add_generation_prompt": [("x", None, {})],
    "continue_final_message": [(True, None, {"add_generation_prompt": True}), ("x", None, {})],
    "documents": [("x", None, {}), ([1], None, {})],
    "chat_template": [("{{ messages }}", None, {})],
    "chat_template_kwargs": [({"tokenize": True}, "chat_template_kwargs.tokenize", {}), ("x", None, {})],
    "mm_processor_kwargs": [({"a": 1}, None, {})],
    "media_io_kwargs": [({"image": {}}, None, {})],
    "return_prompt_text": [(True, None, {})],
}

ROUTE_FIELDS = [(route, name) for route in (C, CH) for name in TABLES[route]]


def _cases(table: dict, route: str, name: str) -> list:
    return table.get((route, name), table.get(name, []))


def test_every_field_of_the_table_has_its_cases():
    """A field added to the table without cases here fails: each is refused at some value, and each
    that is not refused outright is accepted at some value."""
    missing_refused = [(r, n) for r, n in ROUTE_FIELDS if not _cases(REFUSED, r, n)]
    refused_outright = {(r, n) for r, n in ROUTE_FIELDS if TABLES[r][n].how == NEUTRAL and not TABLES[r][n].neutral}
    missing_accepted = [
        (r, n) for r, n in ROUTE_FIELDS if (r, n) not in refused_outright and not _cases(ACCEPTED, r, n)
    ]
    assert not missing_refused and not missing_accepted, (missing_refused, missing_accepted)
    names = {f.name for f in FIELDS}
    stale = {k if isinstance(k, str) else k[1] for k in (*ACCEPTED, *REFUSED)} - names
    assert not stale, stale
    assert len(names) == len(FIELDS), "a field is in the table twice"


def _parse(frontend, route, body):
    return PARSE[route](frontend, body)


def _value(call, path, tokenizer):
    job = call.jobs[0]
    if path.startswith("call."):
        return getattr(call, path[5:])
    if path == "choices":
        return call.num_choices
    if path in ("prompt", "text"):
        return getattr(job, path)
    return getattr(job.params, path)


def _expected(value, tokenizer):
    if isinstance(value, str) and value.startswith("ENCODED:"):
        return tokenizer.encode(value[8:], add_special_tokens=False)
    if isinstance(value, str) and value.startswith("ENCODED+:"):
        return tokenizer.encode(value[9:], add_special_tokens=True)
    return value


@pytest.mark.parametrize("route, name", ROUTE_FIELDS)
def test_field_is_accepted_as_the_table_says(frontend, tokenizer, route, name):
    base_params = _parse(frontend, route, BASE[route]).jobs[0].params
    for value, expected, more in _cases(ACCEPTED, route, name):
        body = {**BASE[route], **more, name: value}
        call = _parse(frontend, route, body)
        without = _parse(frontend, route, {**BASE[route], **more}).jobs[0].params
        if not expected or TABLES[route][name].how in (NEUTRAL, IGNORED):
            # the field changes nothing the engine sees
            assert call.jobs[0].params == without, (name, value)
        for path, want in expected.items():
            assert _value(call, path, tokenizer) == _expected(want, tokenizer), (name, value, path)
    if name not in BASE[route]:  # null is the default, for every field not required
        assert _parse(frontend, route, {**BASE[route], name: None}).jobs[0].params == base_params


@pytest.mark.parametrize("route, name", ROUTE_FIELDS)
def test_field_is_refused_naming_it(frontend, route, name):
    for value, param, more in _cases(REFUSED, route, name):
        body = {**BASE[route], **more, name: value}
        with pytest.raises(HTTPError) as error:
            _parse(frontend, route, body)
        e = error.value
        assert e.status == 400, (name, value, str(e))
        want = param or name
        assert e.param == want, (name, value, str(e), e.param)
        assert want.split(".")[0].split("[")[0].replace("_", " ") in str(e).replace("_", " "), (name, value, str(e))


@pytest.mark.parametrize("route", [C, CH])
def test_unknown_fields_are_refused_naming_them(frontend, route):
    other = {C: "messages", CH: "prompt"}[route]
    for name in ("frobnicate", other):
        with pytest.raises(HTTPError) as error:
            _parse(frontend, route, {**BASE[route], name: 1})
        assert error.value.param == name and f"unknown field '{name}'" in str(error.value)


def test_wrong_model_is_404(frontend):
    with pytest.raises(HTTPError) as error:
        parse_completion(frontend, {**BASE[C], "model": "gpt-4"})
    assert (error.value.status, error.value.code, error.value.param) == (404, "model_not_found", "model")


def test_everything_vllm_bench_and_lm_eval_send_is_accepted(frontend):
    bench = {
        "model": MODEL, "prompt": "hi", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "best_of": 1,
    }  # fmt: skip
    call = parse_completion(frontend, bench)
    assert call.continuous_usage and call.jobs[0].params == SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    lm_eval = {
        "model": MODEL,
        "prompt": [[5, 6, 7]],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    call = parse_completion(frontend, lm_eval)
    params = call.jobs[0].params
    assert call.echo and (params.logprobs, params.prompt_logprobs, call.jobs[0].prompt) == (1, 1, [5, 6, 7])


def test_structured_output_fields_name_one_constraint(frontend):
    with pytest.raises(HTTPError) as error:
        parse_chat(frontend, {**BASE[CH], "guided_regex": "a", "response_format": {"type": "json_object"}})
    assert "exactly one" in str(error.value) and error.value.param in ("guided_regex", "response_format")


def test_docs_have_the_table():
    text = (Path(__file__).parent.parent / "docs" / "openai.md").read_text()
    assert field_table() in text, "docs/openai.md's field table is not field_table(): paste it in again"
    assert "Not supported" not in text


# -- logprobs formatting -------------------------------------------------------------------------


def _entry(token_id, logprob, rank, top):
    return TokenLogprobs(token_id, logprob, rank, [t for t, _ in top], [v for _, v in top])


def test_token_text_is_the_token_decoded_alone(tokenizer):
    ids = tokenizer.encode("The cache über 中")
    assert [token_text(tokenizer, t) for t in ids] == [tokenizer.decode([t]) for t in ids]
    assert "\ufffd" in [token_text(tokenizer, t) for t in ids]  # pieces of a character, as vLLM names them
    assert token_text(tokenizer, 7, as_id=True) == "token_id:7"

    # A SentencePiece word-start token keeps its leading space, which decoding it alone drops.
    pieces = {1: "\u2581the", 2: "the", 3: "\u2581\u2581x"}
    sentencepiece = SimpleNamespace(
        decode=lambda ids: pieces[ids[0]].replace("\u2581", " ").lstrip(), convert_ids_to_tokens=pieces.get
    )
    assert [token_text(sentencepiece, t) for t in (1, 2, 3)] == [" the", "the", "  x"]


def test_completion_logprobs_shape(tokenizer):
    ids = tokenizer.encode("The cache block")
    a, b, c = ids
    entries = [
        None,  # the prompt's first token
        _entry(b, -0.5, 2, [(a, -0.25), (b, -0.5)]),
        _entry(c, -float("inf"), 900, [(a, -0.1), (b, -0.2)]),
    ]
    out = completion_logprobs(tokenizer, ids, entries, 2, text_offset=4)
    texts = [tokenizer.decode([t]) for t in ids]
    assert out == {
        "tokens": texts,
        "token_logprobs": [None, -0.5, -9999.0],
        "top_logprobs": [
            None,
            {texts[1]: -0.5, texts[0]: -0.25},  # the token first, then the likeliest, once each
            {texts[2]: -9999.0, texts[0]: -0.1, texts[1]: -0.2},  # -inf as OpenAI writes it
        ],
        "text_offset": [4, 4 + len(texts[0]), 4 + len(texts[0]) + len(texts[1])],
    }
    json.dumps(out, allow_nan=False)
    # only the num_top likeliest
    assert completion_logprobs(tokenizer, ids[2:], entries[2:], 1)["top_logprobs"] == [
        {texts[2]: -9999.0, texts[0]: -0.1}
    ]
    as_ids = completion_logprobs(tokenizer, ids[1:2], entries[1:2], 2, as_ids=True)
    assert as_ids["tokens"] == [f"token_id:{b}"] and set(as_ids["top_logprobs"][0]) == {
        f"token_id:{b}",
        f"token_id:{a}",
    }


def test_chat_logprobs_shape(tokenizer):
    a, b = tokenizer.encode(" cache über")[:2]
    entries = [_entry(a, -0.5, 2, [(b, -0.25), (a, -0.5), (7, -3.0)])]
    out = chat_logprobs(tokenizer, entries, 2)
    ta, tb = tokenizer.decode([a]), tokenizer.decode([b])
    assert out == {
        "content": [
            {
                "token": ta,
                "logprob": -0.5,
                "bytes": list(ta.encode()),
                "top_logprobs": [
                    {"token": tb, "logprob": -0.25, "bytes": list(tb.encode("utf-8", errors="replace"))},
                    {"token": ta, "logprob": -0.5, "bytes": list(ta.encode())},
                ],
            }
        ]
    }
    assert chat_logprobs(tokenizer, entries, 0)["content"][0]["top_logprobs"] == []


def test_prompt_logprobs_shape(tokenizer):
    a, b = tokenizer.encode("The cache")
    entries = [None, _entry(b, -2.0, 3, [(a, -0.5), (b, -2.0)])]
    assert prompt_logprobs_json(tokenizer, entries) == [
        None,
        {
            str(b): {"logprob": -2.0, "rank": 3, "decoded_token": tokenizer.decode([b])},
            str(a): {"logprob": -0.5, "rank": 1, "decoded_token": tokenizer.decode([a])},
        },
    ]


# -- answers, end to end over HTTP, of scripted outputs --------------------------------------------

OUTPUT = [40, 41, 42, 43]  # what the scripted frontend generates for any prompt


class ScriptedFrontend:
    """Answers every request with OUTPUT (up to max_tokens), a token per output, with logprobs: the
    token's is -(1 + position) / 10, the likeliest are (token, 5, 6) with ranks 1, 2, 3."""

    model_name = MODEL
    max_model_len = max_request_tokens = MAX_MODEL_LEN
    limits = LIMITS
    draining = False
    sampling_defaults: dict = {}
    config = ServerConfig(enable_prompt_tokens_details=True)
    server_index = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = []

    def authenticate(self, authorization):
        pass

    @contextmanager
    def admission(self, count=1):
        yield

    async def off_loop(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    @staticmethod
    def entry(token_id, position, num_top):
        top = [(token_id, -(1 + position) / 10), (5, -2.0), (6, -3.0)][:num_top]
        return _entry(token_id, -(1 + position) / 10, 1, top)

    async def generate(self, prompt, params, request_id=None, priority=0, admitted=False, slo=None):
        """Its ``n`` samples' outputs in turn, token by token; the prompt's logprobs with sample 0's first."""
        self.calls.append((prompt, params, request_id, priority))
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        tokens = OUTPUT[: params.max_tokens]
        prompt_entries = None
        if params.prompt_logprobs is not None:
            prompt_entries = [None] + [self.entry(t, i, params.prompt_logprobs) for i, t in enumerate(prompt_ids[1:])]
        logprobs = [[] for _ in range(params.n)]
        for i, token in enumerate(tokens):
            for index in range(params.n):
                await asyncio.sleep(0)
                new = [self.entry(token, i, params.logprobs)] if params.logprobs is not None else None
                logprobs[index] += new or []
                finished = i == len(tokens) - 1
                yield RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt_ids,
                    output_token_ids=tokens[: i + 1],
                    text=self.tokenizer.decode(tokens[: i + 1]),
                    new_token_ids=[token],
                    new_text=self.tokenizer.decode([token]),
                    finished=finished,
                    finish_reason="length" if finished else None,
                    num_cached_tokens=0,
                    logprobs=list(logprobs[index]) if new is not None else None,
                    new_logprobs=new,
                    prompt_logprobs=prompt_entries if i == 0 and index == 0 else None,
                    index=index,
                )


def _post(tokenizer, path, body):
    """(frontend, status, reply or the list of streamed events) of a request to the scripted server."""
    frontend = ScriptedFrontend(tokenizer)

    async def go():
        async with TestClient(TestServer(build_app(frontend))) as client:
            response = await client.post(path, json=body)
            raw = await response.read()
            return response.status, raw

    status, raw = asyncio.run(go())
    if body.get("stream") and status == 200:
        events = [line[6:] for line in raw.splitlines() if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        return frontend, status, [json.loads(e) for e in events[:-1]]
    return frontend, status, json.loads(raw)


PROMPT = "The cache block"


def test_completion_echo_with_logprobs_streamed_or_not(tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    ids = prompt_ids + OUTPUT[:3]
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "echo": True}
    frontend, status, reply = _post(tokenizer, "/v1/completions", body)
    assert status == 200, reply
    [(_, params, _, _)] = frontend.calls
    assert params.prompt_logprobs == 1  # computed, so echo can show them
    [choice] = reply["choices"]
    assert choice["text"] == PROMPT + tokenizer.decode(OUTPUT[:3])
    assert "prompt_logprobs" not in choice  # not asked for
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][len(prompt_ids) :] == [-0.1, -0.2, -0.3]
    assert logprobs["top_logprobs"][-1] == {tokenizer.decode([OUTPUT[2]]): -0.3}
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids))]
    assert logprobs["text_offset"] == offsets

    _, status, events = _post(tokenizer, "/v1/completions", {**body, "stream": True})
    choices = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == choice["text"]
    assert choices[0]["text"].startswith(PROMPT)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in choices for x in c["logprobs"][key]] == logprobs[key], key
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [len(prompt_ids) + 1, 1, 1]


def test_completion_prompt_logprobs_and_token_ids(tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "n": 2, "request_id": "r1", "priority": 3}
    frontend, status, reply = _post(
        tokenizer, "/v1/completions", {**body, "return_tokens_as_token_ids": True, "logprobs": 0}
    )
    assert status == 200, reply
    assert reply["id"] == "cmpl-r1" and [(c[1].n, c[3]) for c in frontend.calls] == [(2, 3)]  # one request
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    prompt_ids = tokenizer.encode(PROMPT)
    for choice in reply["choices"]:
        positions = choice["prompt_logprobs"]
        assert len(positions) == len(prompt_ids) and positions[0] is None
        assert positions[1] == {
            str(prompt_ids[1]): {"logprob": -0.1, "rank": 1, "decoded_token": tokenizer.decode([prompt_ids[1]])},
            "5": {"logprob": -2.0, "rank": 2, "decoded_token": tokenizer.decode([5])},
        }
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in OUTPUT[:2]]


def test_chat_logprobs_streamed_or_not(tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    _, status, reply = _post(tokenizer, "/v1/chat/completions", {**body, "prompt_logprobs": 1})
    assert status == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in OUTPUT[:3]]
    assert [c["logprob"] for c in content] == [-0.1, -0.2, -0.3]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [
        [tokenizer.decode([t]), tokenizer.decode([5])] for t in OUTPUT[:3]
    ]
    assert reply["prompt_logprobs"][0] is None and "prompt_logprobs" not in reply["choices"][0]

    _, status, events = _post(tokenizer, "/v1/chat/completions", {**body, "stream": True})
    assert [t for e in events for t in e["choices"][0]["logprobs"]["content"]] == content
    _, status, reply = _post(tokenizer, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert reply["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", BASE[CH])])
def test_continuous_usage_is_on_every_chunk(tokenizer, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, status, events = _post(
        tokenizer, path, {**body, "max_tokens": 4, "n": 2, "stream": True, "stream_options": options}
    )
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    num_prompt = last["usage"]["prompt_tokens"]
    done = {0: 0, 1: 0}
    for chunk in chunks:
        [choice] = chunk["choices"]
        done[choice["index"]] += 1
        assert chunk["usage"] == {
            "prompt_tokens": num_prompt,
            "completion_tokens": done[choice["index"]],
            "total_tokens": num_prompt + done[choice["index"]],
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    _, status, events = _post(tokenizer, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert not any("usage" in e for e in events[:-1]) and "usage" in events[-1]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([10**309, -(10**309)])  # JSON integers past the largest float
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@pytest.mark.parametrize("route", [C, CH])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_values_of_known_fields_parse_or_are_a_4xx(frontend, route, data):
    """Any JSON in any of the route's fields (plausible values of their own, or of the same type
    as another field's) parses or is refused with a 4xx naming a field; nothing else is raised."""
    names = st.sampled_from(sorted(TABLES[route]))
    values = st.one_of(JSON, st.sampled_from([v for cases in ACCEPTED.values() for v, _, _ in cases]))
    body = {**BASE[route], **data.draw(st.dictionaries(names, values, max_size=4))}
    try:
        _parse(frontend, route, body)
    except HTTPError as e:
        assert 400 <= e.status < 500 and str(e)
