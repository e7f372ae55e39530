"""Property-based fuzzing of what clients send: any GenerateRequest over gRPC and any JSON body over
HTTP gets tokens or a clear refusal (INVALID_ARGUMENT / a 4xx with a message), never an internal
error or a hang; a valid request after each still succeeds, and no KV block is left in use."""

import json
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import wait_nothing_in_use
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.client import Client
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.v1 import distserve_pb2 as pb
from distserve.v1 import distserve_pb2_grpc as pb_grpc

# A short context bounds how long any accepted request can generate.
MAX_MODEL_LEN = 96
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
INT64 = st.integers(-(2**63), 2**63 - 1)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)


@pytest.fixture(scope="module")
def server(ray_cluster):
    config = make_cluster_config(
        model="tiny-llama", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, prefill={}, decode={}
    )
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
        yield server


@pytest.fixture(autouse=True)
def nothing_left_in_use(server):
    """After each test (all its examples), no block, queue entry or admission is left in use."""
    yield
    wait_nothing_in_use(server.info, server.frontend)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_address) as client:
        yield client


def _sampling() -> st.SearchStrategy[pb.SamplingParams]:
    optional = {
        "max_tokens": st.one_of(st.integers(-3, 40), INT64),
        "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), ANY_FLOAT),
        "top_k": st.one_of(st.integers(-2, 50), INT64),
        "top_p": st.one_of(st.sampled_from([0.0, 0.5, 1.0]), ANY_FLOAT),
        "seed": INT64,
        "skip_special_tokens": st.booleans(),
    }
    return st.builds(
        lambda fields, stop, stop_ids, ignore_eos, include: pb.SamplingParams(
            **{k: v for k, v in fields.items() if v is not None},
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=ignore_eos,
            include_stop_str_in_output=include,
        ),  # fmt: skip
        st.fixed_dictionaries({k: st.none() | v for k, v in optional.items()}),
        st.lists(st.text(max_size=8), max_size=3),
        st.lists(st.one_of(st.integers(-2, 1100), INT64), max_size=3),
        st.booleans(),
        st.booleans(),
    )


def _requests() -> st.SearchStrategy[pb.GenerateRequest]:
    text = st.text(max_size=120).map(lambda t: {"text": t})
    ids = st.lists(st.one_of(st.integers(-2, 1100), INT64), max_size=120).map(
        lambda ids: {"token_ids": pb.TokenIds(ids=ids)}
    )
    return st.builds(
        lambda prompt, params, request_id, priority: pb.GenerateRequest(
            **prompt, sampling_params=params, request_id=request_id, priority=priority
        ),
        st.one_of(text, ids, st.just({})),
        st.none() | _sampling(),
        st.text(max_size=20),
        st.just(0) | INT64,  # any other priority is refused under the server's fcfs policy
    )


@FUZZ
@given(request=_requests())
def test_any_grpc_request_gets_tokens_or_invalid_argument(client, request):
    try:
        chunks = list(client.stub.Generate(request, timeout=60))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert e.details()
        event("INVALID_ARGUMENT")
    else:
        assert chunks and chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        event("generated")
    assert client.complete("Hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                     "stream", "ignore_eos", "logprobs", "stream_options", "user"]  # fmt: skip
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "stream", "n", "stop"]


def _bodies(fields: list[str], required: str) -> st.SearchStrategy[bytes]:
    """Plausible bodies (the right field names, values near their valid ranges), bodies with any JSON in
    any field or an unknown field, any JSON document, and bytes that are not JSON."""
    plausible = {
        "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 1100), max_size=20)),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                    "content": st.one_of(st.text(max_size=30), JSON),
                }
            ),  # fmt: skip
            max_size=3,
        ),
        "max_tokens": st.integers(-2, 30),
        "max_completion_tokens": st.integers(-2, 30),
        "temperature": st.floats(-1, 3),
        "top_p": st.floats(-0.5, 1.5),
        "top_k": st.integers(-2, 50),
        "stream": st.booleans(),
        "n": st.integers(-1, 3),
        "stop": st.lists(st.text(max_size=6), max_size=5),
    }
    near_valid = st.fixed_dictionaries(
        {required: plausible[required]},
        optional={name: plausible[name] for name in fields if name in plausible and name != required},
    )
    anything = st.fixed_dictionaries(
        {}, optional={**{name: st.one_of(plausible.get(name, JSON), JSON) for name in fields}, "unknown_field": JSON}
    )
    return st.one_of(
        near_valid.map(lambda b: json.dumps(b).encode()),
        anything.map(lambda b: json.dumps(b).encode()),
        JSON.map(lambda j: json.dumps(j).encode()),
        st.binary(max_size=40),
    )


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _check_http(server, path: str, body: bytes) -> None:
    status, payload = _post(f"{server.http_url}{path}", body)
    event(str(status))
    if status == 200:
        assert payload and b'"internal_error"' not in payload  # nor an error event inside a stream
    else:
        assert 400 <= status < 500, (status, payload[:300])
        assert json.loads(payload)["error"]["message"]
    ok, _ = _post(f"{server.http_url}/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert ok == 200


@FUZZ
@given(body=_bodies(COMPLETION_FIELDS, "prompt"))
def test_any_completions_body_gets_a_result_or_a_4xx(server, body):
    _check_http(server, "/v1/completions", body)


@FUZZ
@given(body=_bodies(CHAT_FIELDS, "messages"))
def test_any_chat_body_gets_a_result_or_a_4xx(server, body):
    _check_http(server, "/v1/chat/completions", body)


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
