"""Clients of the gRPC API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=16, temperature=0):
            print(chunk.text, end="")

``generate`` yields ``distserve.v1.GenerateResponse`` messages (the new tokens and text of each
step; the last one has finish_reason, usage and timings); ``complete`` joins them into a
``Completion``. Leaving the iteration early cancels the request on the server. A failed call
raises ``CallError``: its ``code()`` is the gRPC status code and ``details()`` the server's message.

The API key is ``api_key`` or else ``$DISTSERVE_API_KEY``; role changes (``set_roles``) send the
admin key instead, ``admin_key`` or else ``$DISTSERVE_ADMIN_KEY``. An address without a port means
the default gRPC port, 50051.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve.entrypoints.server_config import ADMIN_KEY_ENV, API_KEY_ENV, ServerConfig
from distserve.v1 import distserve_pb2 as pb
from distserve.v1 import distserve_pb2_grpc as pb_grpc

DEFAULT_PORT = ServerConfig.grpc_port  # the field's default: where `distserve launch` listens

# How gRPC's messages begin when no connection could be made (as opposed to a server's answer).
_CONNECT_FAILURES = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed")


class CallError(grpc.aio.AioRpcError):
    """A call that failed: refused by the server or never connected. ``code()`` is the gRPC status
    code and ``details()`` the server's message; ``str()`` is one sentence naming the server. It is
    a ``grpc.RpcError`` (and ``grpc.aio.AioRpcError``) too, so code that catches those still works."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(code, details=details)
        self.address = address

    def __str__(self) -> str:
        details = self.details() or ""
        if self.code() == grpc.StatusCode.UNAVAILABLE and details.startswith(_CONNECT_FAILURES):
            # gRPC's text ends with the cause: "...: Connection refused", "...: Domain name not found]"
            cause = details.rsplit(": ", 1)[-1].strip("[]")
            return f"cannot reach a server at {self.address}: {cause[:1].lower()}{cause[1:]}"
        if self.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"{self.address} did not answer within the timeout"
        return f"{self.address} answered {self.code().name}: {details}"

    def __reduce__(self):
        return type(self), (self.address, self.code(), self.details())


def _roles_request(roles: dict[str, int | str], role_control: str | None) -> pb.SetRolesRequest:
    """``roles`` by name: a ``pb.Role`` value or a role's name ("decode")."""
    return pb.SetRolesRequest(
        roles={name: getattr(pb, f"ROLE_{r.upper()}") if isinstance(r, str) else r for name, r in roles.items()},
        role_control=role_control,
    )


def grpc_target(address: str) -> str:
    """``address`` with the default port when it names none (gRPC alone would try 443):
    ``HOST`` -> ``HOST:50051``, ``::1`` or ``[::1]`` -> ``[::1]:50051``; ``HOST:PORT``,
    ``[::1]:PORT`` and gRPC URIs (``unix:PATH``, ``dns:///HOST:PORT``) stay as they are."""
    if address.startswith("unix:") or "://" in address:
        return address
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    colons = address.count(":")
    if colons == 0:
        return f"{address}:{DEFAULT_PORT}"
    return f"[{address}]:{DEFAULT_PORT}" if colons > 1 else address


def make_request(
    prompt: str | list[int],
    request_id: str = "",
    priority: int = 0,
    timeline: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    **sampling: Any,
):
    """A GenerateRequest; ``sampling`` takes the SamplingParams fields (max_tokens, temperature, ...);
    ``timeline`` asks for the request's stage-by-stage Timeline on its last message; ``slo_ttft``
    and ``slo_tpot`` are the request's own latency objectives (seconds) for adaptive role control."""
    if sampling.get("logit_bias"):  # JSON's keys are strings; the message's are token ids
        sampling["logit_bias"] = {int(token): value for token, value in sampling["logit_bias"].items()}
    structured = sampling.pop("structured_outputs", None)
    if isinstance(structured, dict):  # {"json": schema}, {"choice": [...]}, ... as SamplingParams takes it
        ((kind, value),) = structured.items()
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value)
        structured = pb.StructuredOutputs(**{kind: pb.ChoiceList(choices=value) if kind == "choice" else value})
    request = pb.GenerateRequest(
        request_id=request_id,
        priority=priority,
        timeline=timeline,
        sampling_params=pb.SamplingParams(**sampling, structured_outputs=structured),
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


@dataclass
class Completion:
    """A finished request (one sample of it), joined from its stream."""

    request_id: str = ""
    index: int = 0  # which of the request's n samples
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" or "length"
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None
    timeline: pb.Timeline | None = None  # when asked for (``timeline=True``)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # when asked for, one per token
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # one per prompt token after the first
    # A beam search's result: its tokens' summed logprob, and its score under the length penalty.
    cumulative_logprob: float | None = None
    beam_score: float | None = None

    def add(self, chunk: pb.GenerateResponse) -> None:
        self.request_id, self.index = chunk.request_id, chunk.index
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
            self.usage, self.timings = chunk.usage, chunk.timings
            if chunk.HasField("timeline"):
                self.timeline = chunk.timeline
            if chunk.HasField("beam_score"):
                self.cumulative_logprob, self.beam_score = chunk.cumulative_logprob, chunk.beam_score

    @classmethod
    def from_chunks(cls, chunks: Iterable[pb.GenerateResponse]) -> Completion:
        completion = cls()
        for chunk in chunks:
            completion.add(chunk)
        return completion


def samples_from_chunks(chunks: Iterable[pb.GenerateResponse]) -> list[Completion]:
    """A request's samples, each joined from its messages in the stream, in index order."""
    samples: dict[int, Completion] = {}
    for chunk in chunks:
        samples.setdefault(chunk.index, Completion()).add(chunk)
    return [samples[i] for i in sorted(samples)]


# Each client its own connection (gRPC shares one per address in a process by default), so the
# clients of one process spread over a cluster's API servers, which share the port.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


def _one_sample(request: dict[str, Any]) -> None:
    if request.get("n", 1) != 1:
        raise ValueError("complete() joins one sample: use complete_samples() for n > 1")


class _Base:
    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool | None = None,
        admin_key: str | None = None,
    ) -> None:
        """``root_certificates`` (PEM) or ``tls=True`` (system roots) connect over TLS; ``api_key``
        None reads ``$DISTSERVE_API_KEY``, ``admin_key`` None ``$DISTSERVE_ADMIN_KEY``."""
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        if admin_key is None:
            admin_key = os.environ.get(ADMIN_KEY_ENV) or None
        self.address = grpc_target(address)
        self.options = {"api_key": api_key, "root_certificates": root_certificates, "tls": tls, "admin_key": admin_key}
        # The server takes the admin key for every call: an operator's client may hold it alone.
        key = api_key or admin_key
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.admin_metadata = (("authorization", f"Bearer {admin_key}"),) if admin_key else self.metadata
        self.credentials = (
            grpc.ssl_channel_credentials(root_certificates) if tls or root_certificates is not None else None
        )

    def _stubs(self, channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.DistServeStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """A failed call inside raises ``CallError`` (the raw gRPC error's text is gRPC's, not ours)."""
        try:
            yield
        except grpc.RpcError as e:
            raise CallError(self.address, e.code(), e.details()) from None


class Client(_Base):
    def __init__(self, address: str, **options: Any) -> None:
        super().__init__(address, **options)
        if self.credentials is None:
            self._stubs(grpc.insecure_channel(self.address, CHANNEL_OPTIONS))
        else:
            self._stubs(grpc.secure_channel(self.address, self.credentials, CHANNEL_OPTIONS))

    def generate(
        self, prompt: str | list[int], timeout: float | None = None, **request: Any
    ) -> Iterator[pb.GenerateResponse]:
        call = self.stub.Generate(make_request(prompt, **request), metadata=self.metadata, timeout=timeout)
        try:
            with self._errors():
                yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended; cancels the request if left early

    def complete(self, prompt: str | list[int], **request: Any) -> Completion:
        _one_sample(request)
        return Completion.from_chunks(self.generate(prompt, **request))

    def complete_samples(self, prompt: str | list[int], n: int, **request: Any) -> list[Completion]:
        """The ``n`` samples of a prompt, generated sharing its KV."""
        return samples_from_chunks(self.generate(prompt, n=n, **request))

    def cluster_info(self, timeout: float | None = None) -> pb.ClusterInfo:
        with self._errors():
            return self.stub.GetClusterInfo(pb.GetClusterInfoRequest(), metadata=self.metadata, timeout=timeout)

    def set_roles(
        self, roles: dict[str, int | str], timeout: float | None = None, role_control: str | None = None
    ) -> pb.SetRolesResponse:
        """Give instances new roles (``pb.ROLE_DECODE`` or ``"decode"``); returns once they serve them.
        ``role_control``: "fixed" takes roles back from the controller, "adaptive" hands them to it."""
        with self._errors():
            request = _roles_request(roles, role_control)
            return self.stub.SetRoles(request, metadata=self.admin_metadata, timeout=timeout)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        with self._errors():
            return list(self.stub.Tokenize(request, metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        with self._errors():
            return self.stub.Detokenize(request, metadata=self.metadata).text

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The health service's status name: SERVING, NOT_SERVING, ..."""
        with self._errors():
            response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    def __init__(self, address: str, **options: Any) -> None:
        super().__init__(address, **options)
        if self.credentials is None:
            self._stubs(grpc.aio.insecure_channel(self.address, CHANNEL_OPTIONS))
        else:
            self._stubs(grpc.aio.secure_channel(self.address, self.credentials, CHANNEL_OPTIONS))

    async def generate(
        self, prompt: str | list[int], timeout: float | None = None, **request: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(make_request(prompt, **request), metadata=self.metadata, timeout=timeout)
        try:
            with self._errors():
                async for chunk in call:
                    yield chunk
        finally:
            call.cancel()

    async def complete(self, prompt: str | list[int], **request: Any) -> Completion:
        _one_sample(request)
        return Completion.from_chunks([chunk async for chunk in self.generate(prompt, **request)])

    async def complete_samples(self, prompt: str | list[int], n: int, **request: Any) -> list[Completion]:
        """The ``n`` samples of a prompt, generated sharing its KV."""
        return samples_from_chunks([chunk async for chunk in self.generate(prompt, n=n, **request)])

    async def cluster_info(self, timeout: float | None = None) -> pb.ClusterInfo:
        with self._errors():
            return await self.stub.GetClusterInfo(pb.GetClusterInfoRequest(), metadata=self.metadata, timeout=timeout)

    async def set_roles(
        self, roles: dict[str, int | str], timeout: float | None = None, role_control: str | None = None
    ) -> pb.SetRolesResponse:
        with self._errors():
            request = _roles_request(roles, role_control)
            return await self.stub.SetRoles(request, metadata=self.admin_metadata, timeout=timeout)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        with self._errors():
            return list((await self.stub.Tokenize(request, metadata=self.metadata)).token_ids)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        with self._errors():
            return (await self.stub.Detokenize(request, metadata=self.metadata)).text

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        with self._errors():
            response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
