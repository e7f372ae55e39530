"""The orchestrator: admits requests, sends them to instances, hands prefilled requests to decode,
streams outputs back and cancels. It runs on an asyncio loop and talks to instances only through
their queues (``add_request``, ``add_handover``, ``abort_request``) and one long poll per instance,
so it is never on an instance's per-step path.

Request path (disaggregated): tokenize and validate here -> a prefill instance (``Router``) ->
its first token comes back with a ``Handover`` -> the decode instance with the most room takes
it over and pulls the KV -> its tokens stream back. Colocated: one instance does both. Roles may
change while serving (``RoleChanger``), so a cluster can mix prefill, decode and colocated
instances: new prompts go to prefill and colocated ones, hand-overs to decode ones, and a request
an instance hands on or gives back when it changes role moves on the same way. Instances
send each step's deltas; a request's ``OutputBuilder`` adds them up into what its client sees.
A request keeps its client's id everywhere; each run of it (``attempt``) is told apart, so a
re-run after an instance failure (``Failover``) never takes an old run's output for its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import ray

from distserve.cluster.config import ClusterConfig
from distserve.cluster.core_plan import plan_cores
from distserve.cluster.failover import Failover
from distserve.cluster.instance import InstanceInfo, launch_instance
from distserve.cluster.role_changes import RoleChanger, RoleChangeRecord
from distserve.cluster.role_control.controller import RoleController
from distserve.cluster.role_control.request_records import Arrival, FinishedRequest, InFlight
from distserve.cluster.routing import InstanceState, Router, spread_prompts
from distserve.core.cpu_cores import available_cores
from distserve.core.errors import InstanceFailure, RequestError
from distserve.core.handover import Handover
from distserve.core.outputs import OutputBuilder, RequestDelta, RequestMetrics, RequestOutput
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.core.slo import RequestSLO
from distserve.engine.executor import cluster_device
from distserve.engine.input_processor import InputProcessor
from distserve.model_executor.model_loader import eos_token_ids, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0
# What tells the orchestrator that an instance is gone: its actor died, or it reported its workers failed.
INSTANCE_GONE = (ray.exceptions.RayActorError, InstanceFailure)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    slo: RequestSLO = RequestSLO()
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    prefill: InstanceState | None = None  # the instance that prefills it (or does both, colocated)
    decode: InstanceState | None = None
    source: InstanceState | None = None  # an instance holding its KV for the next decode instance
    move_to: InstanceState | None = None  # where its prompt goes if given back to even out the queues
    to_prefill: int = 0  # prompt tokens its prefill instance counts on computing, until its first token
    finished: bool = False
    cancelled: bool = False
    attempt: int = 0  # the current run: 0, then one more per re-run
    failed_runs: int = 0  # runs ended by a failure (not by a role change giving the request back)
    rerunning: bool = False
    samples: list[SampleStream] = field(init=False)  # one per sample (SamplingParams.n)

    def __post_init__(self) -> None:
        self.samples = [SampleStream() for _ in range(self.params.n)]
        self.new_attempt(0)

    @property
    def load(self) -> int:
        """Tokens it may occupy on an instance: the prompt and the most it may generate."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    def instances(self) -> list[InstanceState]:
        """Where its current run may have blocks."""
        found = [s for s in (self.prefill, self.decode, self.source) if s is not None]
        return [s for i, s in enumerate(found) if s not in found[:i]]

    def new_attempt(self, attempt: int | None = None) -> None:
        """Start run ``attempt`` (the next by default): its samples' outputs start again."""
        self.attempt = self.attempt + 1 if attempt is None else attempt
        for index, sample in enumerate(self.samples):
            sample.run = OutputBuilder(self.request_id, self.prompt, self.prompt_token_ids, self.metrics, index)

    @property
    def has_output(self) -> bool:
        """Whether the current run has given any sample a token."""
        return any(sample.run.output_token_ids for sample in self.samples)

    @property
    def delivered(self) -> bool:
        """Whether the client has every sample's end."""
        return all(sample.delivered_end for sample in self.samples)


@dataclass
class SampleStream:
    """One sample of a request, as the client gets it: the current run's output, and how far the
    client has got, which a re-run (repeating the tokens, as sampling is seeded) does not repeat."""

    run: OutputBuilder | None = None
    delivered_tokens: int = 0
    delivered_text: int = 0  # characters
    delivered_end: bool = False

    def unseen(self, output: RequestOutput) -> RequestOutput | None:
        """``output`` with only what the client does not have yet; None when that is nothing."""
        if self.delivered_end or (len(output.output_token_ids) <= self.delivered_tokens and not output.finished):
            return None
        output = dataclasses.replace(
            output,
            new_token_ids=output.output_token_ids[self.delivered_tokens :],
            new_text=output.text[self.delivered_text :],
            new_logprobs=None if output.logprobs is None else output.logprobs[self.delivered_tokens :],
        )
        self.delivered_tokens = max(self.delivered_tokens, len(output.output_token_ids))
        self.delivered_text = max(self.delivered_text, len(output.text))
        self.delivered_end = output.finished
        return output


def _arrival(state: RequestState) -> Arrival:
    """What the role controller knows of a request when it arrives."""
    return Arrival(state.metrics.arrival_time, len(state.prompt_token_ids), state.params.max_tokens, state.slo)


class Orchestrator:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.instances: list[InstanceState] = []
        self.requests: dict[str, RequestState] = {}  # by the client's request id
        self.router = Router(config.engine.cache.block_size)
        self.failover = Failover(self)
        self.roles = RoleChanger(self)
        self.controller = RoleController(self, config.role_control)
        self.closed = False
        self._pollers: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # hand-overs and aborts in flight, kept from the GC

    async def start(self) -> None:
        """Launch every instance (in parallel) and start polling them."""
        resolved = resolve_model(self.config.engine.model)
        tokenizer = load_tokenizer(resolved)
        loop = asyncio.get_running_loop()
        # Cores are planned from this machine's: on a Ray cluster of several nodes, instances stay unbound.
        on_cpu = cluster_device(self.config.engine) == "cpu" and sum(n["Alive"] for n in ray.nodes()) == 1
        plan = plan_cores(self.config, available_cores(), cpu=on_cpu)  # `distserve launch` planned already
        if plan.config is not self.config and on_cpu:
            for line in plan.instance_lines():
                logger.info("cores: %s", line)
        self.config = plan.config
        configs = self.config.instance_configs()
        handles = await asyncio.gather(
            *(loop.run_in_executor(None, launch_instance, config, name) for name, config in configs),
            return_exceptions=True,
        )
        failures = [h for h in handles if isinstance(h, BaseException)]
        if failures:  # all or nothing: stop the instances that did start
            for handle in handles:
                if not isinstance(handle, BaseException):
                    ray.kill(handle)
            raise failures[0]
        infos = await asyncio.gather(*(h.info.remote() for h in handles))
        for (name, config), handle, info in zip(configs, handles, infos):
            self.add_instance(InstanceState(name, config.scheduler.role, handle, info, config))
        # A request must fit the smallest instance it may be sent to.
        smallest = min(self.instances, key=lambda s: s.info.num_blocks * s.info.block_size)
        self.input_processor = InputProcessor(
            tokenizer,
            resolved.shape.vocab_size,
            resolved.max_model_len,
            smallest.info.num_blocks,
            smallest.info.block_size,
            eos_token_ids(resolved, tokenizer),
        )
        self._pollers.append(asyncio.create_task(self.controller.run()))  # it decides while adaptive

    async def shutdown(self) -> None:
        self.closed = True
        for task in [*self._pollers, *self._background]:
            task.cancel()
        await asyncio.gather(*self._pollers, *self._background, return_exceptions=True)
        await asyncio.gather(*(s.handle.shutdown.remote() for s in self.instances), return_exceptions=True)
        for state in self.instances:
            ray.kill(state.handle)

    async def set_roles(self, roles: dict[str, Role | str], role_control: str | None = None) -> list[RoleChangeRecord]:
        """Give instances new roles (see ``RoleChanger.set_roles``), and with ``role_control`` take
        roles back from the controller ("fixed", first, so that it does not undo them) or hand
        them to it ("adaptive", once they are set). Raises RequestError, changing nothing, for a
        mode that is not one or adaptive control without SLOs."""
        control = self.config.role_control
        previous = control.mode
        if role_control is not None:
            try:
                dataclasses.replace(control, mode=role_control)  # its checks
            except ValueError as e:
                raise RequestError(str(e)) from None
        if role_control == "fixed":
            control.mode = role_control
        try:
            records = await self.roles.set_roles(roles) if roles else []
        except BaseException:
            control.mode = previous
            raise
        control.mode = role_control or previous
        return records

    async def change_roles(self, roles: dict[str, Role], reason: str) -> None:
        """The role controller's changes (its ``ClusterView``): ``RoleChanger.set_roles`` with what it saw."""
        await self.roles.set_roles(roles, reason)

    def add_instance(self, entry: InstanceState, replacing: InstanceState | None = None) -> None:
        """Serve from ``entry`` (in place of ``replacing``) and start polling it."""
        if replacing is None:
            self.instances.append(entry)
        else:
            self.instances[self.instances.index(replacing)] = entry
        self._pollers.append(asyncio.create_task(self._poll(entry)))

    def pool(self, role: Role) -> list[InstanceState]:
        """The healthy instances of ``role`` that take new work (none is changing role)."""
        return [s for s in self.instances if s.role == role and s.failure is None and s.changing_to is None]

    def entry_pool(self) -> list[InstanceState]:
        """Where new prompts may go: colocated instances, and prefill ones while a decode instance is
        there (or becoming one) to take their requests over."""
        live = [s for s in self.instances if s.failure is None]
        decode = any(Role.DECODE in (s.role, s.changing_to) for s in live)
        return self.pool(Role.COLOCATED) + (self.pool(Role.PREFILL) if decode else [])

    # Requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        slo: RequestSLO | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come, of each of its ``params.n`` samples (told apart by
        ``RequestOutput.index``) until every one has ended; closing the iterator early cancels the
        request. ``slo``: its own latency objectives, for the role controller."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id '{request_id}' is already in use")
        seq = self.input_processor.process(prompt, params, request_id, priority)
        params = seq.sampling_params
        if params.seed is None and params.temperature > 0:
            # Seeded sampling does not depend on the batch, so a re-run after a failure repeats the tokens.
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        if role := self.failover.unavailable_role():
            raise InstanceFailure(f"no {role} instance is available to serve the request")
        state = RequestState(request_id, seq.prompt, seq.prompt_token_ids, params, priority, slo or RequestSLO())
        state.metrics.arrival_time = time.time()
        self.requests[request_id] = state
        self.controller.observe_arrival(_arrival(state))
        try:
            await self.submit(state)
            while True:
                output = await state.queue.get()
                if isinstance(output, BaseException):
                    raise output
                output = state.samples[output.index].unseen(output)
                if output is None:
                    continue
                yield output
                if state.delivered:
                    return
        finally:
            if not state.finished:
                await self._cancel(state)
            self.forget(state)

    async def submit(self, state: RequestState) -> None:
        """Send the request's current run to a prefill (or colocated) instance, waiting for a
        replacement when none is healthy."""
        pool = await self.failover.healthy(self.entry_pool)
        entry, state.to_prefill = self.router.pick_prefill(pool, state.prompt_token_ids, state.load, state.move_to)
        state.move_to = None
        self._assign(state, entry, "prefill")
        entry.prefill_tokens += state.to_prefill
        attempt, slo = state.attempt, self.slo(state)
        ttft_deadline = state.metrics.arrival_time + slo.ttft if slo.ttft else None  # a re-run keeps the first's
        try:
            await entry.handle.add_request.remote(
                state.prompt_token_ids, state.params, state.request_id, state.priority, attempt,
                ttft_deadline, slo.tpot,
            )  # fmt: skip
        except INSTANCE_GONE as e:  # the instance died under the call
            self.spawn(self.failover.rerun(state, attempt, InstanceFailure(f"instance {entry.name} failed: {e}")))

    def slo(self, state: RequestState) -> RequestSLO:
        """The request's SLOs: each its own, else the cluster's (``role_control``); None without either."""
        cluster = self.controller.cluster_slo
        return RequestSLO(state.slo.ttft or cluster.ttft, state.slo.tpot or cluster.tpot)

    def spread_prompts(self) -> None:
        """Even out the prompts waiting for their first token over the instances that take new ones:
        after a role change adds such an instance, the queues at the others would still wait there
        while it has room. An instance gives back only prompts it has not started."""
        queues: dict[InstanceState, list[tuple[RequestState, int]]] = {entry: [] for entry in self.entry_pool()}
        for state in self.requests.values():  # in order of arrival
            if state.prefill in queues and state.decode is None and not state.has_output:
                queues[state.prefill].append((state, len(state.prompt_token_ids)))
        runs: dict[InstanceState, list[tuple[str, int]]] = {}
        for state, source, target in spread_prompts(queues):
            state.move_to = target
            runs.setdefault(source, []).append((state.request_id, state.attempt))
        for source, given in runs.items():
            logger.info("%s gives back %d queued prompts to even out the queues", source.name, len(given))
            self.spawn(self._give_back(source, given))

    async def _give_back(self, entry: InstanceState, runs: list[tuple[str, int]]) -> None:
        try:
            await entry.handle.give_back.remote(runs)
        except INSTANCE_GONE as e:  # its requests are re-run by the failover
            logger.warning("%s could not give back queued prompts: %s", entry.name, e)

    def _assign(self, state: RequestState, entry: InstanceState, phase: str) -> None:
        setattr(state, phase, entry)
        setattr(state.metrics, f"{phase}_instance", entry.name)
        entry.load_tokens += state.load

    def in_flight(self) -> list[InFlight]:
        """Each request in flight, in order of arrival, with the times of its first and latest
        tokens: what the role controller sees before requests finish."""
        in_flight = []
        for state in self.requests.values():
            times = state.metrics.token_times
            in_flight.append(InFlight(_arrival(state), times[0], times[-1]) if times else InFlight(_arrival(state)))
        return in_flight

    def forget(self, state: RequestState) -> None:
        """The request is over: it no longer counts anywhere."""
        self.unassign(state)
        if self.requests.get(state.request_id) is state:
            del self.requests[state.request_id]

    def unassign(self, state: RequestState) -> None:
        """The request no longer counts towards its instances' load."""
        self._prefilled(state)
        for entry in (state.prefill, state.decode):
            if entry is not None:
                entry.load_tokens -= state.load
        state.prefill = state.decode = state.source = None

    @staticmethod
    def _prefilled(state: RequestState) -> None:
        """Its prompt is no longer work its prefill instance has before it."""
        if state.prefill is not None:
            state.prefill.prefill_tokens -= state.to_prefill
        state.to_prefill = 0

    async def _cancel(self, state: RequestState) -> None:
        """Abort wherever the request may be: both instances free its blocks."""
        state.cancelled = True
        await self.abort_run(state.instances(), state.request_id)

    async def abort_run(self, targets: list[InstanceState], request_id: str, attempt: int | None = None) -> None:
        """Abort a request (``attempt``: only that run) on the instances it was on: each frees its blocks."""
        await asyncio.gather(
            *(s.handle.abort_request.remote(request_id, attempt) for s in targets), return_exceptions=True
        )

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_on(self, entry: InstanceState, request_id: str, attempt: int) -> None:
        try:
            await entry.handle.abort_request.remote(request_id, attempt)
        except INSTANCE_GONE as e:  # so are the request's blocks there
            logger.warning("could not abort %s on %s: %s", request_id, entry.name, e)

    # Outputs --------------------------------------------------------------------------------

    async def _poll(self, entry: InstanceState) -> None:
        while not self.closed:
            try:
                deltas = await entry.handle.get_outputs.remote(POLL_TIMEOUT_S, self.config.stream_interval)
            except INSTANCE_GONE as e:  # its requests cannot go on there
                self.failover.instance_failed(entry, e)
                return
            except Exception:  # a bug in the call, not a death: report it and keep serving
                logger.exception("polling %s failed", entry.name)
                await asyncio.sleep(POLL_TIMEOUT_S)
                continue
            for delta in deltas:
                self._route(entry, delta)

    def _route(self, entry: InstanceState, delta: RequestDelta) -> None:
        state = self.requests.get(delta.request_id)
        # While a run is being abandoned (``rerunning``), its aborts' final deltas are on their way:
        # none of them may end the request.
        if state is None or state.cancelled or state.rerunning or delta.attempt != state.attempt:
            if not delta.finished:
                # Calls to an instance may run out of order: an abort can overtake the run it cancels,
                # which then starts after all; a failed-over run may still be going. Stop it there.
                self.spawn(self._abort_on(entry, delta.request_id, delta.attempt))
            return
        if delta.finished and delta.finish_reason == "error":
            # The run could not go on there (its KV pull failed, say): run it again elsewhere.
            failure = InstanceFailure(f"request {state.request_id} failed on {entry.name}")
            self.spawn(self.failover.rerun(state, delta.attempt, failure))
            return
        if delta.finished and delta.finish_reason == "requeue":  # given back by a role change
            self.spawn(self.failover.rerun(state, delta.attempt, None))
            return
        if delta.first:  # prefilled where it was: a plan to move its prompt is void
            state.move_to = None
            self._prefilled(state)
        now = time.time()
        # A re-run repeats tokens the request already has: time only the ones past them. With
        # several samples, the times are those of the longest.
        run = state.samples[delta.index].run
        num_tokens = len(run.output_token_ids) + len(delta.new_token_ids)
        state.metrics.token_times.extend([now] * (num_tokens - len(state.metrics.token_times)))
        if delta.finished and all(sample.run.finished or sample.run is run for sample in state.samples):
            state.finished = True  # its last sample's end
            state.metrics.finished_time = now
            self._observe(state)
        output = run.add(delta)
        if delta.handover is not None:
            self.spawn(self._hand_over(state, delta.handover, entry))
        state.queue.put_nowait(output)

    def _observe(self, state: RequestState) -> None:
        """A request's latencies, for the role controller."""
        m = state.metrics
        if m.token_times:
            self.controller.observe(FinishedRequest(**vars(_arrival(state)), finished=m.token_times[-1], ttft=m.ttft,
                                                    tpot=m.tpot))  # fmt: skip

    async def _hand_over(self, state: RequestState, handover: Handover, sender: InstanceState) -> None:
        """Give a prefilled request to the decode instance with the most room; or a request that
        ``sender`` hands on (it left decode) or back (it could not take it over) to another one."""
        if state.decode is not None:  # it moves on from a decode instance
            state.decode.load_tokens -= state.load
            state.decode = None
        state.source = self._named(handover.prefill_instance) or sender
        try:
            entry = self.router.pick_decode(await self.failover.healthy(lambda: self._decoders(state.source)))
            self._assign(state, entry, "decode")
            state.metrics.handover_time = time.time()
            await entry.handle.add_handover.remote(handover)
            if state.cancelled:  # cancelled while the hand-over was on its way
                await entry.handle.abort_request.remote(state.request_id, handover.attempt)
        except INSTANCE_GONE as e:  # no decode instance, or it died taking the request: run it again
            failure = e if isinstance(e, InstanceFailure) else InstanceFailure(str(e))
            await self.failover.rerun(state, handover.attempt, failure)
        except Exception as e:  # refused (RequestError) or a bug: the request cannot go on
            await self._cancel(state)
            state.queue.put_nowait(e)

    def _decoders(self, source: InstanceState) -> list[InstanceState]:
        """Where a hand-over may go: the decode instances; with none, the instance holding the KV
        when it decodes now itself (it left prefill for colocated while the hand-over was on its way)."""
        pool = self.pool(Role.DECODE)
        if pool or source.failure is not None or source.changing_to is not None:
            return pool
        return [source] if source.role is Role.COLOCATED else []

    def _named(self, name: str) -> InstanceState | None:
        return next((s for s in self.instances if s.name == name), None)

    async def info(self) -> list[InstanceInfo]:
        """Each instance's current state (queues, KV use, failure)."""
        infos = await asyncio.gather(*(s.handle.info.remote() for s in self.instances), return_exceptions=True)
        for state, info in zip(self.instances, infos):
            if not isinstance(info, BaseException):
                state.info = info
        # A dead actor cannot answer: its last info, with why it failed.
        return [dataclasses.replace(s.info, failure=s.failure) if s.failure else s.info for s in self.instances]
