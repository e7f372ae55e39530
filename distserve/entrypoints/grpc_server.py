"""The gRPC server (``grpc.aio``): the ``distserve.v1.DistServe`` service in front of a
``Frontend``, plus the standard health service and server reflection."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from distserve.cluster.instance import InstanceInfo
from distserve.cluster.role_changes import RoleChangeRecord
from distserve.core.errors import RequestError
from distserve.core.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from distserve.core.request_limits import RequestLimits
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from distserve.core.slo import RequestSLO
from distserve.entrypoints.errors import InvalidRequest, ServingError, to_serving_error
from distserve.entrypoints.frontend import Frontend
from distserve.entrypoints.preflight import check_port
from distserve.entrypoints.server_config import ServerConfig
from distserve.kv_tier.store import TierInfo
from distserve.v1 import distserve_pb2 as pb
from distserve.v1 import distserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DistServe"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Calls gRPC core queues until the Python server takes them. Past its default of 1000 it cancels
# new calls with a bare CANCELLED, so a burst would lose requests before the admission limit could
# answer them RESOURCE_EXHAUSTED; each queued call costs a few KiB.
MAX_QUEUED_CALLS = 16384
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
MAX_ROLE_CHANGES = 50  # the latest role changes ClusterInfo carries
# A status message travels in a trailer, percent-encoded (up to 12 bytes a character), which clients
# refuse past 8 to 16 KiB: the call then fails RESOURCE_EXHAUSTED and its status is lost. A message
# quoting a long value (a list of 5000 bad token ids) is cut to this many characters.
MAX_DETAILS_CHARS = 500
_ROLES = {Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE, Role.COLOCATED: pb.ROLE_COLOCATED}
_OPTIONAL_PARAMS = (
    "max_tokens", "temperature", "top_k", "top_p", "seed", "skip_special_tokens", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "truncate_prompt_tokens", "n",
    "cache_salt", "beam_width", "length_penalty",
)  # fmt: skip
_EARLY_STOPPING = {pb.EARLY_STOPPING_TRUE: True, pb.EARLY_STOPPING_NEVER: "never"}


def sampling_params_from_proto(
    message: pb.SamplingParams, limits: RequestLimits, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """Set fields override ``defaults`` (the model's, ``InputProcessor.sampling_defaults``), which
    override SamplingParams' own; its checks say what is wrong, after the ``limits`` on its lists'
    sizes. Set is proto3's field presence: a field sent at its zero value (temperature 0) is set."""
    limits.check_params(message)
    options = {name: getattr(message, name) for name in _OPTIONAL_PARAMS if message.HasField(name)}
    if message.early_stopping:
        if message.early_stopping not in _EARLY_STOPPING:  # proto3 enums take any number
            raise InvalidRequest(
                f"early_stopping must be EARLY_STOPPING_FALSE, _TRUE or _NEVER, got {message.early_stopping}"
            )
        options["early_stopping"] = _EARLY_STOPPING[message.early_stopping]
    if "beam_width" not in options:  # the model's defaults pick among tokens, which beams do not
        options = {**(defaults or {}), **options}
    if message.logit_bias:
        options["logit_bias"] = dict(message.logit_bias)
    if message.allowed_token_ids:
        options["allowed_token_ids"] = list(message.allowed_token_ids)
    if message.HasField("structured_outputs"):
        options["structured_outputs"] = structured_outputs_from_proto(message.structured_outputs)
    return SamplingParams(
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        include_stop_str_in_output=message.include_stop_str_in_output,
        min_tokens=message.min_tokens,
        bad_words=list(message.bad_words),
        **options,
    )


def structured_outputs_from_proto(message: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(
            "structured_outputs is set but names no kind: set json, regex, choice, grammar or json_object"
        )
    value = getattr(message, kind)
    return StructuredOutputsParams(**{kind: list(value.choices) if kind == "choice" else value})


def logprobs_to_proto(entries: list[TokenLogprobs | None]) -> list[pb.TokenLogprobs]:
    return [
        pb.TokenLogprobs(
            token_id=e.token_id,
            logprob=e.logprob,
            rank=e.rank,
            top_token_ids=e.top_token_ids,
            top_logprobs=e.top_logprobs,
        )
        for e in entries
        if e is not None
    ]


def _details(error: BaseException) -> str:
    """The status message of ``error``, cut to ``MAX_DETAILS_CHARS``."""
    text = str(error)
    return text if len(text) <= MAX_DETAILS_CHARS else text[: MAX_DETAILS_CHARS - 3] + "..."


def _prompt_from_proto(request: pb.GenerateRequest) -> str | list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("the request has no prompt: set 'text' or 'token_ids'")
    return request.text if kind == "text" else list(request.token_ids.ids)


def _interval(start: float | None, end: float | None) -> float:
    return end - start if start is not None and end is not None else 0.0


def timeline_to_proto(m: RequestMetrics) -> pb.Timeline:
    stages = {
        "arrival": m.arrival_time, "prefill_queued": m.prefill_queued, "prefill_start": m.prefill_start,
        "prefill_end": m.prefill_end, "prefill_batch_size": m.prefill_batch_size,
        "prefill_batch_tokens": m.prefill_batch_tokens, "handover": m.handover_time,
        "decode_admitted": m.decode_admitted, "migration_start": m.migration_start,
        "migration_end": m.migration_end, "finished": m.finished_time,
    }  # fmt: skip
    starts, ends, sizes = zip(*m.steps) if m.steps else ((), (), ())
    return pb.Timeline(
        **{name: value for name, value in stages.items() if value is not None},
        step_starts=starts,
        step_ends=ends,
        step_batch_sizes=sizes,
        token_times=m.token_times,
        num_preemptions=m.num_preemptions,
        prefill_instance=m.prefill_instance or "",
        decode_instance=m.decode_instance or "",
        local_prefill=m.local_prefill,
    )


def response_from_output(
    output: RequestOutput, timeline: bool = False, cached_tokens: bool = False
) -> pb.GenerateResponse:
    """``cached_tokens``: whether its usage reports the prompt tokens found cached (else 0)."""
    response = pb.GenerateResponse(
        request_id=output.request_id, token_ids=output.new_token_ids, text=output.new_text, index=output.index
    )
    if output.new_logprobs:
        response.logprobs.extend(logprobs_to_proto(output.new_logprobs))
    if output.finished and output.beam_score is not None:
        response.cumulative_logprob, response.beam_score = output.cumulative_logprob, output.beam_score
    if output.prompt_logprobs is not None and output.num_output_tokens == len(output.new_token_ids):
        response.prompt_logprobs.extend(logprobs_to_proto(output.prompt_logprobs))  # the first message
    if output.finished and timeline:
        response.timeline.CopyFrom(timeline_to_proto(output.metrics))
    if output.finished:
        m = output.metrics
        response.finish_reason = _FINISH_REASONS.get(output.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=len(output.prompt_token_ids),
                completion_tokens=output.num_output_tokens,
                cached_prompt_tokens=output.num_cached_tokens if cached_tokens else 0,
            )
        )
        last = m.token_times[-1] if m.token_times else None
        response.timings.CopyFrom(
            pb.Timings(
                ttft=m.ttft or 0.0,
                tpot=m.tpot or 0.0,
                e2e=_interval(m.arrival_time, last),
                queue=_interval(m.arrival_time, m.prefill_start),
                prefill=_interval(m.prefill_start, m.prefill_end),
                migration=_interval(m.migration_start, m.migration_end),
            )
        )
    return response


def instance_to_proto(info: InstanceInfo) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        name=info.name,
        role=_ROLES.get(info.role, pb.ROLE_UNSPECIFIED),
        tensor_parallel_size=info.tensor_parallel_size,
        pipeline_parallel_size=info.pipeline_parallel_size,
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        num_free_blocks=info.num_free_blocks,
        kv_cache_dtype=info.kv_cache_dtype,
        num_waiting=info.num_waiting,
        num_running=info.num_running,
        num_held=info.num_held,
        num_pending=info.num_pending,
        num_preemptions=info.num_preemptions,
        failure=info.failure or "",
        node_id=info.processes[0][0] if info.processes else "",
        kv_pulls=[
            pb.KVPulls(source=source, transport=t.transport, pulls=t.pulls, bytes=t.num_bytes, seconds=t.seconds)
            for source, t in sorted(info.kv_pulls_from.items())
        ],
        num_swapped=info.num_swapped,
        num_swap_outs=info.num_swap_outs,
        num_swap_ins=info.num_swap_ins,
        num_kv_checksum_mismatches=info.num_kv_checksum_mismatches,
        swap_seconds=info.swap_seconds,
        prompt_tokens=info.prompt_tokens,
        cached_prompt_tokens=info.cached_prompt_tokens,
        tier_hit_tokens=info.tier_hit_tokens,
    )


def tier_to_proto(tier: TierInfo) -> pb.KVTier:
    return pb.KVTier(
        node_id=tier.node_id,
        capacity_blocks=tier.capacity_blocks,
        entries=tier.num_entries,
        bytes_per_block=tier.bytes_per_block,
        queried_blocks=tier.queried_blocks,
        hit_blocks=tier.hit_blocks,
        remote_hit_blocks=tier.remote_hit_blocks,
        written_blocks=tier.written_blocks,
        evicted_blocks=tier.evicted_blocks,
    )


def role_change_to_proto(record: RoleChangeRecord) -> pb.RoleChange:
    return pb.RoleChange(
        instance=record.instance,
        old_role=_ROLES[record.old_role],
        new_role=_ROLES[record.new_role],
        started=record.started,
        seconds=record.seconds,
        reason=record.reason,
        error=record.error or "",
    )


class DistServeServicer(pb_grpc.DistServeServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def _authenticate(self, context: grpc.aio.ServicerContext, admin: bool = False) -> None:
        """The call's key must be the API key, or with ``admin`` (a call that changes the cluster) the admin key."""
        metadata = dict(context.invocation_metadata() or ())
        try:
            check = self.frontend.authenticate_admin if admin else self.frontend.authenticate
            check(metadata.get("authorization"))
        except ServingError as e:
            await context.abort(e.grpc_code, _details(e))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._authenticate(context)
        try:
            prompt = _prompt_from_proto(request)
            params = sampling_params_from_proto(
                request.sampling_params, self.frontend.limits, self.frontend.sampling_defaults
            )
            slo = RequestSLO(*(getattr(request, f) if request.HasField(f) else None for f in ("slo_ttft", "slo_tpot")))
        except Exception as e:
            error = to_serving_error(e)
            await context.abort(error.grpc_code, _details(error))
        outputs = self.frontend.generate(prompt, params, request.request_id or None, request.priority, slo=slo)
        cached_tokens = self.frontend.config.enable_prompt_tokens_details
        # aclosing: a cancelled call closes the stream at once, which cancels the request.
        async with contextlib.aclosing(outputs):
            try:
                async for output in outputs:
                    yield response_from_output(output, request.timeline, cached_tokens)
            except ServingError as e:
                await context.abort(e.grpc_code, _details(e))

    async def GetClusterInfo(self, request: pb.GetClusterInfoRequest, context: grpc.aio.ServicerContext):
        await self._authenticate(context)
        infos = await self.frontend.info()
        return pb.ClusterInfo(
            model=self.frontend.model_name,
            instances=[instance_to_proto(info) for info in infos],
            num_pending_requests=self.frontend.num_pending,
            max_pending_requests=self.frontend.config.max_pending_requests,
            max_model_len=self.frontend.max_model_len,
            draining=self.frontend.draining,
            vocab_size=self.frontend.vocab_size,
            role_changes=[role_change_to_proto(r) for r in self.frontend.cluster.role_changes[-MAX_ROLE_CHANGES:]],
            role_control=self.frontend.role_control,
            kv_tiers=[tier_to_proto(tier) for tier in await self.frontend.cluster.tier_info()],
            default_sampling_params=pb.SamplingParams(**self.frontend.sampling_defaults),
            api_servers=[pb.ApiServer(**dataclasses.asdict(s)) for s in await self.frontend.server_statuses()],
        )

    async def SetRoles(self, request: pb.SetRolesRequest, context: grpc.aio.ServicerContext):
        await self._authenticate(context, admin=True)
        by_proto = {value: role for role, value in _ROLES.items()}
        unknown = {name: value for name, value in request.roles.items() if value not in by_proto}
        role_control = request.role_control if request.HasField("role_control") else None
        if unknown or not (request.roles or role_control):
            message = (
                f"no role given for {', '.join(unknown)}" if unknown else "name an instance or a role control mode"
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            roles = {name: by_proto[value] for name, value in request.roles.items()}
            records = await self.frontend.set_roles(roles, role_control)
        except ServingError as e:
            await context.abort(e.grpc_code, _details(e))
        return pb.SetRolesResponse(changes=[role_change_to_proto(r) for r in records])

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):
        await self._authenticate(context)
        try:
            self.frontend.limits.check_prompt(request.text)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = await self.frontend.off_loop(
            self.frontend.tokenizer.encode, request.text, add_special_tokens=request.add_special_tokens
        )
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext):
        await self._authenticate(context)
        try:
            ids, skip = request.token_ids, request.skip_special_tokens
            text = await self.frontend.off_loop(lambda: self.frontend.detokenize(list(ids), skip))
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(e))
        return pb.DetokenizeResponse(text=text)


class GrpcServer:
    """The gRPC server of a frontend; ``port`` is the bound one (the config's may be 0)."""

    def __init__(self, frontend: Frontend, config: ServerConfig, shared_port: bool = False) -> None:
        """``shared_port``: the API servers of one cluster listen on the same port (SO_REUSEPORT),
        the kernel spreading connections over them."""
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.server.max_pending_requests", MAX_QUEUED_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_QUEUED_CALLS),
            # gRPC sets SO_REUSEPORT by default: a second server would then share a busy port silently.
            ("grpc.so_reuseport", int(shared_port)),
        ]
        self.server = grpc.aio.server(options=options)
        self.health = health.aio.HealthServicer()
        pb_grpc.add_DistServeServicer_to_server(DistServeServicer(frontend), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"{config.host}:{config.grpc_port}"
        try:
            if config.tls:
                cert, key = config.read_tls()
                self.port = self.server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc's way of saying the bind failed (older versions return port 0)
            self.port = 0
        if not self.port:
            if config.grpc_port:
                check_port("gRPC", config.host, config.grpc_port)  # names a busy port as such
            raise OSError(f"the gRPC server cannot listen on {address}")

    async def start(self) -> None:
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        """Health answers NOT_SERVING, so load balancers stop sending while in-flight calls end."""
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)
