"""Fuzzing what clients send, over every sampling field: any GenerateRequest over gRPC and any JSON body
over HTTP gets tokens or a clear refusal (INVALID_ARGUMENT / a 4xx with a message), never an internal
error, a hang or a failed instance; a valid request after each still succeeds, and no KV block is
left in use. The fields come from ``SamplingParams``, the proto and the HTTP field table, so a field
added to any of them is fuzzed, or ``test_every_sampling_field_is_fuzzed`` names it.

The default run draws a fixed, bounded set of examples; ``pytest -m slow tests/test_fuzz.py`` draws
ten times as many, new ones each run."""

import dataclasses
import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from conftest import GRAMMAR, SCHEMA, wait_nothing_in_use
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distserve.cluster.api import make_cluster_config
from distserve.core.request_limits import RequestLimits
from distserve.core.sampling_params import SamplingParams
from distserve.entrypoints.client import Client
from distserve.entrypoints.openai_chat import CHAT_ROLES
from distserve.entrypoints.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, NEUTRAL
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.model_executor.tiny_models import VOCAB_SIZE
from distserve.v1 import distserve_pb2 as pb
from distserve.v1 import distserve_pb2_grpc as pb_grpc

MODEL = "tiny-llama"
# A short context bounds how long any accepted request can generate.
MAX_MODEL_LEN = 96
# Examples per fuzz test, and whether they are the same every run: the default suite's, bounded (all
# the fuzz tests together in about a minute on 2 cores), and a slow run's.
RUNS = [pytest.param(200, True, id="bounded"), pytest.param(2000, False, id="long", marks=pytest.mark.slow)]
MAX_FIELDS = 3  # sampling fields set per request besides the one it is about: with more, most are refused
INT64 = st.integers(-(2**63), 2**63 - 1)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@dataclass(frozen=True)
class Values:
    """A field's values: ``plausible`` ones, which it accepts when set alone, and ``absurd`` ones
    (out of range, negative, huge, NaN and infinities, empty or long lists, unknown token ids...),
    which it may refuse."""

    plausible: st.SearchStrategy
    absurd: st.SearchStrategy

    def any(self) -> st.SearchStrategy:
        """Plausible seven times in eight: a request with one field out of range never reaches the engine."""
        return st.integers(0, 7).flatmap(lambda i: self.absurd if i == 7 else self.plausible)


def oversized(item: st.SearchStrategy, low: int = 100, high: int = 2000) -> st.SearchStrategy:
    """Long lists of one drawn item (cheap to draw, unlike as many drawn items)."""
    return st.builds(lambda n, x: [x] * n, st.integers(low, high), item)


TOKEN_ID = st.integers(0, VOCAB_SIZE - 1)
# Unknown ids: just past the vocabulary, negative, anything.
ANY_TOKEN_ID = st.one_of(TOKEN_ID, st.integers(-2, VOCAB_SIZE + 8), INT64)
TOKEN_IDS = Values(
    st.lists(st.one_of(st.integers(0, 8), TOKEN_ID), min_size=1, max_size=5),  # the first ids: stop and special
    st.one_of(
        st.lists(ANY_TOKEN_ID, max_size=5),
        oversized(ANY_TOKEN_ID),
        st.integers(100, 3000).map(lambda n: [i % VOCAB_SIZE for i in range(n)]),  # every id, in turn
    ),
)
TEXT = st.text(max_size=8)
WORDS = Values(
    st.lists(st.text(min_size=1, max_size=8), max_size=4), st.one_of(st.lists(TEXT, max_size=4), oversized(TEXT))
)
# Prompts of a length the context holds (a character may be several tokens), and longer ones.
ASCII = st.characters(max_codepoint=127)
PROMPT_TEXT = Values(st.text(ASCII, min_size=1, max_size=40), st.text(max_size=200))
PROMPT_IDS = Values(st.lists(TOKEN_ID, min_size=1, max_size=40), st.lists(ANY_TOKEN_ID, max_size=100))

# Structured outputs: a valid spec of each kind, and specs that do not compile or whose language is
# empty.
SCHEMAS = [
    SCHEMA,
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "string", "maxLength": 4},
    {"enum": ["x", "y"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
]
BAD_SCHEMAS = [
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"type": "nonsense"},
    {"$ref": "#/definitions/nowhere"},
    {"type": "string", "pattern": "("},
    {"type": "integer", "minimum": "x"},
    {"not": {}},
    "not json",
    "{",
    "[]",
    "42",
]
SCHEMA_KEYS = st.sampled_from(["type", "properties", "enum", "items", "minimum", "pattern", "$ref"])
JSON_SCHEMA = Values(
    st.sampled_from(SCHEMAS).flatmap(lambda s: st.sampled_from([s, json.dumps(s)])),
    st.one_of(
        st.sampled_from(BAD_SCHEMAS),
        st.dictionaries(
            SCHEMA_KEYS, st.one_of(st.sampled_from(["object", "string", "integer"]), st.integers(-2, 5), TEXT)
        ),
    ),
)
REGEX = Values(
    st.sampled_from(["[a-z]{3}-[0-9]{2}", "yes|no", "(a|b)*c", "\\d+", ".*", "a{2,5}", "[^x]"]),
    st.one_of(st.sampled_from(["", "(", "[z-a]", "a{5,2}", "\\", "a**", "(?=a)b", "(?P<x>a)", "\\1"]), TEXT),
)
EBNF = Values(
    st.sampled_from([GRAMMAR, 'root ::= "a" | "b"', 'root ::= "a"*', 'root ::= "a" "b"?']),
    st.one_of(
        st.sampled_from(['root ::= ""', "root ::= root", "root ::= ", 'x ::= "a"', "root ::= [", "root ::= a"]), TEXT
    ),
)
CHOICE = Values(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4), st.lists(TEXT, max_size=4))
KINDS = {
    "json": JSON_SCHEMA,
    "regex": REGEX,
    "choice": CHOICE,
    "grammar": EBNF,
    "json_object": Values(st.just(True), st.just(False)),
}


def one_kind(part: str) -> st.SearchStrategy[dict]:
    """``{kind: spec}`` of any kind, its spec ``plausible`` or ``absurd``."""
    return st.sampled_from(sorted(KINDS)).flatmap(lambda k: getattr(KINDS[k], part).map(lambda v: {k: v}))


LOGPROBS = Values(st.integers(0, 20), st.one_of(st.integers(-2, 30), INT64))

MAX_N = RequestLimits().max_n

# Every SamplingParams field a client sets.
VALUES: dict[str, Values] = {
    "max_tokens": Values(st.integers(1, 40), st.one_of(st.integers(-3, 0), INT64)),
    "temperature": Values(st.sampled_from([0.0, 1e-6, 0.7, 1.0]) | st.floats(0, 5), ANY_FLOAT),
    "top_k": Values(st.integers(0, 50), st.one_of(st.integers(-2, -1), st.integers(VOCAB_SIZE, 2**20), INT64)),
    "top_p": Values(st.sampled_from([1.0, 0.5, 1e-9]) | st.floats(1e-9, 1), ANY_FLOAT),
    "min_p": Values(st.sampled_from([0.0, 1.0]) | st.floats(0, 1), ANY_FLOAT),
    "seed": Values(st.integers(0, 2**32), INT64),
    "stop": WORDS,
    "stop_token_ids": TOKEN_IDS,
    "ignore_eos": Values(st.booleans(), st.booleans()),
    "include_stop_str_in_output": Values(st.booleans(), st.booleans()),
    "skip_special_tokens": Values(st.booleans(), st.booleans()),
    "min_tokens": Values(st.integers(0, 10), st.one_of(st.integers(-2, 100), INT64)),
    "presence_penalty": Values(st.floats(-2, 2), ANY_FLOAT),
    "frequency_penalty": Values(st.floats(-2, 2), ANY_FLOAT),
    "repetition_penalty": Values(st.floats(0.01, 2), ANY_FLOAT),
    "logit_bias": Values(
        st.dictionaries(TOKEN_ID, st.floats(-200, 200), max_size=4),
        st.one_of(
            st.dictionaries(ANY_TOKEN_ID, ANY_FLOAT, max_size=4),
            st.integers(100, 3000).map(lambda n: {t % VOCAB_SIZE: -100.0 for t in range(n)}),  # bans all but a few
        ),
    ),
    "allowed_token_ids": TOKEN_IDS,
    "bad_words": WORDS,
    "logprobs": LOGPROBS,
    "prompt_logprobs": LOGPROBS,
    "truncate_prompt_tokens": Values(st.integers(1, 100), st.one_of(st.integers(-2, 0), INT64)),
    # Exactly one kind, or none, or two.
    "structured_outputs": Values(
        one_kind("plausible"),
        one_kind("absurd") | st.fixed_dictionaries({}, optional={k: v.any() for k, v in KINDS.items()}),
    ),
    "n": Values(st.integers(1, 3), st.integers(-(2**63), 0) | st.sampled_from([MAX_N + 1, 10**6, 2**62])),
    "cache_salt": Values(
        st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=20),
        st.text(max_size=200) | st.sampled_from(["", "a/b", "a@b", "x" * 129]),
    ),
    "beam_width": Values(st.integers(1, 3), st.integers(-(2**63), 0) | st.sampled_from([MAX_N + 1, 2**62])),
    # Alone (no beam_width) only their neutral values are taken; with it, any.
    "length_penalty": Values(st.just(1.0), ANY_FLOAT),
    "early_stopping": Values(st.just(0), st.integers(0, 2**31 - 1)),  # the proto's enum: 0, 1, 2 are known
}
# SamplingParams fields that HTTP sets under another name: vLLM's use_beam_search asks for n beams.
HTTP_NAMES = {"beam_width": "use_beam_search"}
SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if not f.metadata.get("internal")]


@pytest.fixture(scope="module")
def server(ray_cluster):
    config = make_cluster_config(model=MODEL, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, prefill={}, decode={})
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
        yield server


@pytest.fixture(autouse=True)
def nothing_left_in_use(server):
    """After each test (all its examples), no block, queue entry or admission is left in use, and no
    instance failed (a replacement would have another name)."""
    names = sorted(info.name for info in server.info())
    yield
    wait_nothing_in_use(server.info, server.frontend)
    assert sorted(info.name for info in server.info()) == names


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_address) as client:
        yield client


def fields_of(values: dict[str, Values], most: int = MAX_FIELDS) -> st.SearchStrategy[dict]:
    """Up to ``most`` of the fields, each with a value of its own."""
    names = st.lists(st.sampled_from(sorted(values)), max_size=most, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({name: values[name].any() for name in chosen}))


def sampling_fields(values: dict[str, Values], about: str) -> st.SearchStrategy[dict]:
    """A request's sampling fields: the one it is ``about``, at a plausible value, and up to
    ``MAX_FIELDS`` more of any value."""
    return st.builds(lambda more, value: {**more, about: value}, fields_of(values), values[about].plausible)


def fuzz(
    examples: int, fixed: bool, requests: Callable[[str], st.SearchStrategy], check: Callable[[Any], bool]
) -> None:
    """``check`` ``examples`` requests, as many about each sampling field (``requests(field)``;
    ``fixed``: the same ones every run); it says whether a request was served (else refused). A
    fuzzer whose requests are all refused tests nothing: a third are served, and one about each field
    at least."""
    served: Counter[str] = Counter()
    slow = [HealthCheck.too_slow, HealthCheck.data_too_large]
    each = settings(max_examples=max(1, examples // len(SAMPLING_FIELDS)), deadline=None, derandomize=fixed,
                    database=None, suppress_health_check=slow)  # fmt: skip

    def counted(about: str) -> Callable[[Any], None]:
        def run(request) -> None:
            served[about] += check(request)

        return run

    for about in SAMPLING_FIELDS:
        each(given(requests(about))(counted(about)))()
    assert served.total() >= examples // 3, f"{served.total()} of {examples} requests served"
    missing = [name for name in SAMPLING_FIELDS if not served[name]]
    assert not missing, f"no request about {missing} was served: draw more examples, or more values that pass"


def test_every_sampling_field_is_fuzzed():
    """Every SamplingParams field a client sets has its values here, is a field of the proto's
    SamplingParams, and is a field of both HTTP routes under its own name (so both fuzzers set it)."""
    assert sorted(VALUES) == sorted(SAMPLING_FIELDS), set(VALUES) ^ set(SAMPLING_FIELDS)
    proto = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    assert proto == set(SAMPLING_FIELDS), proto ^ set(SAMPLING_FIELDS)
    http_fields = {HTTP_NAMES.get(name, name) for name in SAMPLING_FIELDS}
    for table in HTTP_TABLES.values():
        assert http_fields <= set(table), http_fields - set(table)
    for route in HTTP_TABLES:
        http_values(route)  # every field of the route has values, or this names the one without


# -- gRPC ----------------------------------------------------------------------------------------

_BY_PROTO_TYPE = {
    FieldDescriptor.TYPE_INT64: Values(st.integers(-5, 5), INT64),
    FieldDescriptor.TYPE_DOUBLE: Values(st.floats(0.001, 100), ANY_FLOAT),
    FieldDescriptor.TYPE_BOOL: Values(st.booleans(), st.booleans()),
    FieldDescriptor.TYPE_STRING: Values(st.text(ASCII, max_size=20), st.text(max_size=20)),
}


def _set_proto(message, name: str, value) -> None:
    """Set a proto field from a SamplingParams-like value (a list, dict or scalar)."""
    field = message.DESCRIPTOR.fields_by_name[name]
    if field.message_type is pb.StructuredOutputs.DESCRIPTOR:
        structured = getattr(message, name)
        structured.SetInParent()  # set, even with no kind: the server refuses that
        for kind, spec in value.items():  # a oneof: the last kind given stays
            if kind == "choice":
                structured.choice.choices[:] = spec
            elif kind == "json":
                structured.json = spec if isinstance(spec, str) else json.dumps(spec)
            else:
                setattr(structured, kind, spec)
    elif field.message_type is not None and field.message_type.GetOptions().map_entry:
        getattr(message, name).update(value)
    elif field.is_repeated:
        getattr(message, name).extend(value)
    else:
        setattr(message, name, value)


def _int64(value):
    """``value`` with its integers clamped to int64, the proto's type (HTTP takes any)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return max(-(2**63), min(2**63 - 1, value))
    if isinstance(value, list):
        return [_int64(v) for v in value]
    if isinstance(value, dict):
        return {_int64(k): _int64(v) for k, v in value.items()}
    return value


def _grpc_message(values: dict) -> pb.SamplingParams:
    message = pb.SamplingParams()
    for name, value in values.items():
        _set_proto(message, name, _int64(value))
    return message


def _requests(about: str) -> st.SearchStrategy[pb.GenerateRequest]:
    """GenerateRequests: a text prompt, token ids or none; sampling params of the proto's fields; the
    request's other scalar fields (id, priority, SLOs...) of any value of their type, as the proto
    declares them."""
    text = PROMPT_TEXT.any().map(lambda t: {"text": t})
    ids = PROMPT_IDS.any().map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)})
    prompt = Values(st.one_of(text, ids), st.just({})).any()
    params = sampling_fields(
        {f.name: VALUES[f.name] for f in pb.SamplingParams.DESCRIPTOR.fields if f.name in VALUES}, about
    )
    oneof = pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["prompt"]
    scalars = {
        f.name: _BY_PROTO_TYPE[f.type]
        for f in pb.GenerateRequest.DESCRIPTOR.fields
        if f.containing_oneof is not oneof and f.message_type is None
    }
    return st.builds(
        lambda prompt, params, other: pb.GenerateRequest(**prompt, **other, sampling_params=_grpc_message(params)),
        prompt,
        params,
        fields_of(scalars, most=2),
    )


@pytest.mark.parametrize("examples, fixed", RUNS)
def test_any_grpc_request_gets_tokens_or_invalid_argument(client, examples, fixed):
    def check(request: pb.GenerateRequest) -> bool:
        try:
            chunks = list(client.stub.Generate(request, timeout=60))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), str(request)[:2000])
            assert e.details()
            served = False
        else:
            assert chunks and chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            served = True
        assert client.complete("Hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        return served

    fuzz(examples, fixed, _requests, check)


# -- HTTP ----------------------------------------------------------------------------------------

HTTP_TABLES = {"completions": COMPLETION_FIELDS, "chat": CHAT_FIELDS}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUIRED = {"completions": "prompt", "chat": "messages"}
# Values of a field by the type the table checks it for.
OBJECT = st.dictionaries(st.text(max_size=8), JSON, max_size=3)
_BY_CHECK = {
    "an integer": st.integers(-3, 40),
    "a finite number": st.floats(-3, 3),
    "a boolean": st.booleans(),
    "a string": st.text(max_size=12),
    "an object": OBJECT,
    "a list": st.lists(JSON, max_size=3),
    "a list of integers": st.lists(ANY_TOKEN_ID, max_size=4),
    "a list of strings": st.lists(TEXT, max_size=4),
    "a list of objects": st.lists(OBJECT, max_size=3),
    "a string or a list of strings": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "a JSON schema (an object, or its text)": JSON_SCHEMA.any(),
    'a boolean or "never"': st.one_of(st.booleans(), st.just("never")),
    "anything": JSON,
}
MESSAGE_TEXT = st.text(ASCII, max_size=20)  # three of them and the template fit the context
# Fields whose values are not SamplingParams' nor their type's alone; (route, field) for one route.
_HTTP_VALUES = {
    "model": Values(st.just(MODEL), st.text(max_size=8)),
    "prompt": Values(
        st.one_of(
            PROMPT_TEXT.plausible,
            PROMPT_IDS.plausible,
            st.lists(PROMPT_TEXT.plausible, min_size=1, max_size=3),
            st.lists(PROMPT_IDS.plausible, min_size=1, max_size=3),
        ),
        st.one_of(PROMPT_TEXT.absurd, PROMPT_IDS.absurd, st.lists(PROMPT_IDS.any(), max_size=3)),
    ),
    "messages": Values(
        st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES), "content": MESSAGE_TEXT}),
            min_size=1,
            max_size=3,
        ),  # fmt: skip
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["tool", ""]) | TEXT, "content": JSON}), max_size=3),
    ),
    "max_tokens": Values(VALUES["max_tokens"].plausible, VALUES["max_tokens"].absurd | st.integers(2**63, 2**70)),
    "max_completion_tokens": VALUES["max_tokens"],
    "n": Values(st.integers(1, 3), st.sampled_from([-1, 0, MAX_N + 1, 2**40])),
    "best_of": Values(st.just(1), st.integers(-1, 3)),
    "top_logprobs": LOGPROBS,
    ("chat", "logprobs"): Values(st.booleans(), LOGPROBS.any()),
    "truncate_prompt_tokens": Values(st.integers(1, 100) | st.just(-1), VALUES["truncate_prompt_tokens"].absurd),
    "response_format": Values(
        st.one_of(
            st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
            JSON_SCHEMA.plausible.filter(lambda s: isinstance(s, dict)).map(
                lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
            ),
        ),
        st.one_of(
            st.sampled_from([{"type": "structural_tag"}, {"type": "xml"}, {"type": "json_schema"}]),
            JSON_SCHEMA.absurd.map(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}),
        ),
    ),
    "guided_json": JSON_SCHEMA,
    "guided_regex": REGEX,
    "guided_choice": CHOICE,
    "guided_grammar": EBNF,
    "stream_options": Values(
        st.just({}), st.fixed_dictionaries({}, optional={"include_usage": JSON, "continuous_usage_stats": JSON})
    ),
    "priority": Values(st.just(0), st.one_of(INT64, st.integers(2**63, 2**70))),  # any other is refused under fcfs
    "use_beam_search": Values(st.booleans(), st.booleans()),
    "length_penalty": Values(st.floats(-2, 2), ANY_FLOAT),  # ignored without use_beam_search, as vLLM
    "early_stopping": Values(st.sampled_from([False, True, "never"]), st.sampled_from([1, "always", 0.5])),
}


def http_values(route: str) -> dict[str, Values]:
    """Values for each field of the route's table: its own, SamplingParams', or those of its type (a
    field accepted only at neutral values: those); any JSON is among the absurd ones."""
    values = {}
    for name, use in HTTP_TABLES[route].items():
        own = _HTTP_VALUES.get((route, name), _HTTP_VALUES.get(name, VALUES.get(name)))
        if own is None and use.how == NEUTRAL:
            own = Values(st.sampled_from(use.neutral) if use.neutral else JSON, JSON)
        if own is None:
            by_type = _BY_CHECK.get(use.check[0])
            assert by_type is not None, f"no values to fuzz the HTTP field {name!r}, {use.check[0]}, with"
            own = Values(by_type, JSON)
        values[name] = Values(own.plausible, own.absurd | JSON)
    return values


def _bodies(route: str, about: str) -> st.SearchStrategy[bytes | str]:
    """Bodies of the route's fields (the required one mostly; sampling fields, and up to two of the
    others), with an unknown field now and then; any JSON document; bytes that are not JSON."""
    values = http_values(route)
    required = REQUIRED[route]
    sampling = {name for name in values if name in VALUES or name in HTTP_NAMES.values()}
    body = st.builds(
        lambda first, sampling, more, unknown: {**first, **more, **unknown, **sampling},
        Values(st.fixed_dictionaries({required: values[required].any()}), st.just({})).any(),
        sampling_fields({name: values[name] for name in sampling}, HTTP_NAMES.get(about, about)),
        fields_of({name: v for name, v in values.items() if name not in sampling and name != required}, most=2),
        Values(st.just({}), st.dictionaries(st.text(max_size=8), JSON, max_size=1)).any(),
    )
    return Values(body.map(json.dumps), JSON.map(json.dumps) | st.binary(max_size=40)).any()


def _post(url: str, body: bytes | str) -> tuple[int, bytes]:
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _check_http(server, path: str, body: bytes | str) -> bool:
    """Whether the body was served (else refused)."""
    status, payload = _post(f"{server.http_url}{path}", body)
    if status == 200:
        # Nor an error event inside a stream but the client's own.
        assert payload and b'"internal_error"' not in payload and b'"service_unavailable"' not in payload, payload
    else:
        assert 400 <= status < 500, (status, payload[:300], body[:1000])
        assert json.loads(payload)["error"]["message"]
    ok, _ = _post(f"{server.http_url}/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert ok == 200
    return status == 200


@pytest.mark.parametrize("route", sorted(HTTP_TABLES))
@pytest.mark.parametrize("examples, fixed", RUNS)
def test_any_http_body_gets_a_result_or_a_4xx(server, route, examples, fixed):
    fuzz(examples, fixed, lambda about: _bodies(route, about), lambda body: _check_http(server, PATHS[route], body))


def test_oversized_messages_are_refused_and_the_server_goes_on(server, client):
    """A gRPC message over the server's cap gets RESOURCE_EXHAUSTED, an HTTP body over it 413, both
    without reaching the engine; the server then serves as before."""
    from distserve.entrypoints.grpc_server import MAX_MESSAGE_BYTES
    from distserve.entrypoints.openai_server import MAX_BODY_BYTES

    # The client's own send cap must not stop the message before the server sees it.
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(server.grpc_address, options=options) as channel:
        stub = pb_grpc.DistServeStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(pb.GenerateRequest(text="x" * (MAX_MESSAGE_BYTES + 1)), timeout=60))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 1)}).encode()
    status, _ = _post(f"{server.http_url}/v1/completions", body)
    assert status == 413
    assert client.complete("Hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    ok, _ = _post(f"{server.http_url}/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert ok == 200
