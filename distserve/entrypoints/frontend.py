"""What the gRPC and HTTP servers share in front of the cluster: authentication, the admission
limit, draining, error mapping and metrics. A server only translates its wire format to and
from ``Frontend.generate``."""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

from distserve.cluster.api import AsyncCluster
from distserve.cluster.instance import InstanceInfo
from distserve.cluster.role_changes import RoleChangeRecord
from distserve.core.outputs import RequestOutput
from distserve.core.request_limits import RequestLimits
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.core.slo import RequestSLO
from distserve.entrypoints.api_servers import ApiServerStatus, process_cpu_seconds
from distserve.entrypoints.errors import (
    InvalidRequest,
    Overloaded,
    PermissionDenied,
    ServingError,
    Unauthenticated,
    Unavailable,
    to_serving_error,
)
from distserve.entrypoints.prometheus import ServingMetrics
from distserve.entrypoints.server_config import ServerConfig

T = TypeVar("T")


class Frontend:
    def __init__(self, cluster: AsyncCluster, config: ServerConfig) -> None:
        self.cluster = cluster
        self.config = config
        self.model_name = config.served_model_name or cluster.config.engine.model.model
        self.metrics = ServingMetrics()
        self.num_pending = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.started = time.time()
        self.server_index = 0  # of the cluster's API servers; 0 manages it
        self.restarts = 0  # times this server was started again

    def server_status(self) -> ApiServerStatus:
        return ApiServerStatus(self.server_index, self.cluster.orchestrator.server_id, os.getpid(), self.num_pending,
                               process_cpu_seconds(), self.restarts)  # fmt: skip

    async def server_statuses(self) -> list[ApiServerStatus]:
        """Every API server of the cluster, by index: this one as it is now, the others as they
        last reported to the directory."""
        own = self.server_status()
        directory = self.cluster.orchestrator.directory
        others = [] if directory is None else await directory.statuses.remote()
        return sorted([own, *(s for s in others if s.index != own.index)], key=lambda s: s.index)

    @property
    def tokenizer(self):
        return self.cluster.orchestrator.input_processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.cluster.orchestrator.input_processor.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.cluster.orchestrator.input_processor.vocab_size

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """What a request's sampling fields default to when it leaves them out (the model's
        generation config; none under ``generation_config: vllm``)."""
        return self.cluster.orchestrator.input_processor.sampling_defaults

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for (the cluster's ``limits``, the model's context filled in)."""
        return self.cluster.orchestrator.limits

    @property
    def max_request_tokens(self) -> int:
        """The longest a request (prompt and output) may grow: the context, or less when the
        smallest instance's KV cache holds less."""
        processor = self.cluster.orchestrator.input_processor
        return min(processor.max_model_len, processor.num_kv_blocks * processor.block_size)

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the cluster's input workers: tokenizing, chat templates, parsing
        a body of megabytes, which must not hold the loop every stream is served from."""
        return await self.cluster.orchestrator.input_workers.run(fn, *args, **kwargs)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; InvalidRequest for an id outside the tokenizer. CPU work of
        the request's size: run it ``off_loop``."""
        vocab_size = len(self.tokenizer)
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must be in [0, {vocab_size}), got {bad[:5]}")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def authenticate(self, authorization: str | None) -> None:
        """Check an ``authorization: Bearer KEY`` value against the server's key, if it has one; the
        admin key is taken too (an operator may do what a client may)."""
        expected = self.config.api_key
        if expected is None:
            return
        if not authorization:
            raise Unauthenticated("this server needs an API key: send 'authorization: Bearer <key>'")
        if not (_is_key(authorization, expected) or _is_key(authorization, self.config.admin_key)):
            raise Unauthenticated("the API key is wrong")

    def authenticate_admin(self, authorization: str | None) -> None:
        """Check the key of a call that changes the cluster (role changes): only the admin key
        passes, and without one configured nothing does, whatever the network the call came from."""
        admin_key = self.config.admin_key
        if admin_key is None:
            raise PermissionDenied(
                "changing the cluster needs the server's admin key, and this server has none: start it with "
                "--admin-key or $DISTSERVE_ADMIN_KEY"
            )
        if _is_key(authorization, admin_key):
            return
        if not authorization:
            raise Unauthenticated("this call changes the cluster: send 'authorization: Bearer <admin key>'")
        if self.config.api_key is not None and _is_key(authorization, self.config.api_key):
            raise PermissionDenied("the API key does not allow changing the cluster: send the admin key")
        raise Unauthenticated("the admin key is wrong")

    @contextmanager
    def admission(self, count: int = 1) -> Iterator[None]:
        """Count ``count`` requests in for the block: all of them or none, so a batch is never
        partly started before it is refused. Unavailable while draining, Overloaded when full."""
        limit = self.config.max_pending_requests
        try:
            if self.draining:
                raise Unavailable("the server is shutting down and admits no new requests")
            if count > limit:
                raise InvalidRequest(
                    f"the request asks for {count} generations, more than the server runs at once ({limit})"
                )
            if self.num_pending + count > limit:
                raise Overloaded(f"the server has {self.num_pending} requests in flight, its limit: retry later")
        except ServingError as e:
            self.metrics.observe_error(e.grpc_code.name)
            raise
        self.num_pending += count
        self._idle.clear()
        try:
            yield
        finally:
            self.num_pending -= count
            if self.num_pending == 0:
                self._idle.set()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        admitted: bool = False,
        slo: RequestSLO | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; every failure is raised as a ``ServingError``. ``admitted``: the
        caller holds an ``admission`` for it already. Its samples are admitted as that many requests,
        once it is known to be within the limits (so too many samples is refused naming ``n``'s)."""
        try:
            self.cluster.orchestrator.check_request(prompt, params, priority)
        except Exception as e:
            raise self._client_error(e) from e
        with nullcontext() if admitted else self.admission(params.n):
            try:
                async for output in self.cluster.generate(prompt, params, request_id, priority, slo):
                    if output.finished and output.index == 0:  # a request of n samples counts once
                        self.metrics.observe_finished(output)
                    yield output
            except Exception as e:
                raise self._client_error(e) from e

    def _client_error(self, error: Exception) -> ServingError:
        """The client-facing form of a request's failure, counted."""
        error = to_serving_error(error)
        self.metrics.observe_error(error.grpc_code.name)
        return error

    async def info(self) -> list[InstanceInfo]:
        infos = await self.cluster.info()
        tiers = await self.cluster.tier_info()
        self.metrics.update_instances(
            infos, self.num_pending, self.cluster.role_changes, self.cluster.role_verdicts, tiers
        )
        self.metrics.update_api_servers(await self.server_statuses())
        return infos

    async def set_roles(self, roles: dict[str, Role | str], role_control: str | None = None) -> list[RoleChangeRecord]:
        try:
            return await self.cluster.set_roles(roles, role_control)
        except Exception as e:
            raise to_serving_error(e) from e

    @property
    def role_control(self) -> str:
        return self.cluster.config.role_control.mode

    def end_drain(self) -> None:
        """Stop waiting for in-flight requests (they are cancelled when the servers stop)."""
        self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to ``timeout`` seconds for those in flight; True if all ended."""
        self.draining = True
        if self.num_pending == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def _is_key(authorization: str | None, key: str | None) -> bool:
    """Whether an ``authorization`` value is ``Bearer <key>`` (compared in constant time)."""
    if not authorization or key is None:
        return False
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
