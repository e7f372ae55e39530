"""The orchestrator: admits requests, picks instances, hands prefilled requests to decode, streams
outputs back and cancels. It runs on an asyncio loop and talks to instances only through their
queues (``add_request``, ``add_prefilled``, ``abort_request``) and a long poll per instance, so
it is never on an instance's per-step path.

Request path (disaggregated): tokenize and validate here -> the least loaded prefill instance
-> its first token comes back with a ``PrefilledRequest`` -> the decode instance with the most
room takes it over and pulls the KV -> its tokens stream back. Colocated: one instance does both.
Instances send each step's new tokens and text (``RequestDelta``); the request's state here adds
them up into the ``RequestOutput`` its client sees.

Failures: an instance that dies (its long poll raises) is replaced by a new actor, and each request
that still needed it is aborted on the instance it shared and re-run from its prompt under a new
engine id, up to ``max_request_attempts`` runs. Every request is sampled from a seed (one is drawn
for those without), so a re-run produces the same tokens, and the client is sent only those past
what it already has. A request whose KV pull fails is re-run the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray

from distserve.cluster.config import ClusterConfig
from distserve.cluster.instance import InstanceInfo, launch_instance
from distserve.cluster.prefix_index import PrefixIndex
from distserve.core.config import EngineConfig
from distserve.core.outputs import STAGE_TIMES, RequestDelta, RequestMetrics, RequestOutput
from distserve.core.sampling_params import SamplingParams
from distserve.engine.executor import InstanceFailure
from distserve.engine.input_processor import InputProcessor
from distserve.model_executor.model_loader import load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0
# How long a request waits for a replacement when no healthy instance of the role it needs is left.
REPLACEMENT_WAIT_S = 60.0
# Starting a replacement is tried this many times, waiting twice as long after each failure.
REPLACEMENT_ATTEMPTS = 3
REPLACEMENT_BACKOFF_S = 1.0
# A prefix-cache hit wins over a less loaded instance unless its load (per KV token) is higher by more.
PREFIX_LOAD_SLACK = 0.25


@dataclass
class InstanceState:
    name: str
    role: str
    handle: Any
    info: InstanceInfo
    load_tokens: int = 0  # tokens of the requests assigned to it and not yet done with it
    failure: str | None = None
    config: EngineConfig | None = None  # what a replacement is started with


@dataclass
class RequestState:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    prefill: InstanceState | None = None  # the instance that prefills it (or does both, colocated)
    decode: InstanceState | None = None
    finished: bool = False
    cancelled: bool = False
    # What a re-run needs, and how far the client has got.
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    priority: int = 0
    engine_id: str = ""  # the id instances know this run by: request_id, then request_id.retryN
    attempts: int = 1
    delivered_tokens: int = 0
    delivered_text: int = 0  # characters
    # The current run's output, built up from the instances' deltas.
    run_token_ids: list[int] = field(default_factory=list)
    run_text: str = ""

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or self.request_id

    def add(self, delta: RequestDelta) -> RequestOutput:
        """The run's whole output so far, with ``delta`` added."""
        self.run_token_ids += delta.new_token_ids
        self.run_text += delta.new_text
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.run_token_ids),
            text=self.run_text,
            new_token_ids=delta.new_token_ids,
            new_text=delta.new_text,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            num_cached_tokens=delta.num_cached_tokens,
        )

    def unseen(self, output: RequestOutput) -> RequestOutput | None:
        """``output`` with only what the client does not have yet; None when that is nothing."""
        if len(output.output_token_ids) <= self.delivered_tokens and not output.finished:
            return None
        output = dataclasses.replace(
            output,
            request_id=self.request_id,
            new_token_ids=output.output_token_ids[self.delivered_tokens :],
            new_text=output.text[self.delivered_text :],
        )
        self.delivered_tokens = max(self.delivered_tokens, len(output.output_token_ids))
        self.delivered_text = max(self.delivered_text, len(output.text))
        return output


class Orchestrator:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.instances: list[InstanceState] = []
        self.requests: dict[str, RequestState] = {}
        self._pollers: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # hand-overs and aborts in flight, kept from the GC
        self._closed = False
        self._replacing: dict[str, int] = {}  # role -> replacements under way
        self._pool_changed = asyncio.Condition()  # notified when a replacement comes up or gives up
        self._generation = 0  # numbers replacement actors' names
        self.prefix_index = PrefixIndex(config.engine.cache.block_size)

    async def start(self) -> None:
        """Launch every instance (in parallel) and start polling them."""
        resolved = resolve_model(self.config.engine.model)
        tokenizer = load_tokenizer(resolved)
        loop = asyncio.get_running_loop()
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
            self.instances.append(InstanceState(name, config.scheduler.scheduler, handle, info, config=config))
        # A request must fit the smallest instance it may be sent to.
        smallest = min(self.instances, key=lambda s: s.info.num_blocks * s.info.block_size)
        self.input_processor = InputProcessor(
            tokenizer,
            resolved.hf_config.vocab_size,
            resolved.max_model_len,
            smallest.info.num_blocks,
            smallest.info.block_size,
        )
        self._pollers = [asyncio.create_task(self._poll(state)) for state in self.instances]

    async def shutdown(self) -> None:
        self._closed = True
        for task in [*self._pollers, *self._background]:
            task.cancel()
        await asyncio.gather(*self._pollers, *self._background, return_exceptions=True)
        await asyncio.gather(*(s.handle.shutdown.remote() for s in self.instances), return_exceptions=True)
        for state in self.instances:
            ray.kill(state.handle)

    # Requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; closing the iterator early cancels the request."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        seq = self.input_processor.process(prompt, params, request_id, priority)
        if params.seed is None and params.temperature > 0:
            # Seeded sampling does not depend on the batch, so a re-run after a failure repeats the tokens.
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        if role := self._unavailable_role():
            raise InstanceFailure(f"no {role} instance is available to serve the request")
        state = RequestState(
            request_id,
            seq.num_prompt_tokens,
            params.max_tokens,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            params=params,
            priority=priority,
        )
        state.metrics.arrival_time = time.time()
        self.requests[request_id] = state
        try:
            await self._submit(state)
            while True:
                output = await state.queue.get()
                if isinstance(output, BaseException):
                    raise output
                output = state.unseen(output)
                if output is None:
                    continue
                yield output
                if output.finished:
                    return
        finally:
            if not state.finished:
                await self._cancel(state)
            self._forget(state)

    async def _submit(self, state: RequestState) -> None:
        """Send the request (its current run) to a prefill instance, waiting for a replacement when
        none is healthy."""
        pool = await self._healthy("colocated" if not self.config.disaggregated else "prefill")
        entry = self._pick_prefill(pool, state.prompt_token_ids)
        state.prefill = entry
        entry.load_tokens += self._load(state)
        try:
            await entry.handle.add_request.remote(state.prompt_token_ids, state.params, state.engine_id, state.priority)
        except ValueError:
            raise
        except Exception as e:  # the instance died under the call
            self._spawn(self._rerun(state, InstanceFailure(f"instance {entry.name} failed: {e}")))

    async def _healthy(self, role: str) -> list[InstanceState]:
        """The healthy instances of ``role``; while there are none but a replacement is starting, wait
        for it (up to REPLACEMENT_WAIT_S)."""
        pool = self._pool(role)
        if pool or not self._replacing.get(role):
            return pool
        async with self._pool_changed:
            try:
                await asyncio.wait_for(
                    self._pool_changed.wait_for(lambda: self._pool(role) or not self._replacing.get(role)),
                    REPLACEMENT_WAIT_S,
                )
            except TimeoutError:
                pass
        return self._pool(role)

    def _unavailable_role(self) -> str | None:
        """A role the cluster needs with no healthy instance and no replacement starting."""
        roles = ("prefill", "decode") if self.config.disaggregated else ("colocated",)
        return next((r for r in roles if not self._pool(r) and not self._replacing.get(r)), None)

    def _pool(self, role: str) -> list[InstanceState]:
        return [s for s in self.instances if s.role == role and s.failure is None]

    def _load(self, state: RequestState) -> int:
        return state.num_prompt_tokens + state.max_tokens

    def _load_ratio(self, entry: InstanceState) -> float:
        return entry.load_tokens / (entry.info.num_blocks * entry.info.block_size)

    def _pick(self, pool: list[InstanceState]) -> InstanceState:
        """The instance with the least load per KV token it can hold."""
        if not pool:
            raise InstanceFailure("no instance is available to serve the request")
        return min(pool, key=self._load_ratio)

    def _pick_prefill(self, pool: list[InstanceState], token_ids: list[int]) -> InstanceState:
        """The instance of ``pool`` that was sent the longest prefix of this prompt, unless it is much
        busier than the least loaded one, which gets the request otherwise."""
        least = self._pick(pool)
        hashes = self.prefix_index.block_hashes(token_ids)
        matched = {s.name: self.prefix_index.matched_blocks(s.name, hashes) for s in pool}
        best = max(pool, key=lambda s: (matched[s.name], -self._load_ratio(s)))
        hit = matched[best.name] > 0
        entry = best if hit and self._load_ratio(best) <= self._load_ratio(least) + PREFIX_LOAD_SLACK else least
        self.prefix_index.add(entry.name, hashes)
        return entry

    async def _cancel(self, state: RequestState) -> None:
        """Abort wherever the request may be: both instances free its blocks."""
        state.cancelled = True
        await self._abort_run([s for s in (state.prefill, state.decode) if s is not None], state.engine_id)

    async def _abort_run(self, targets: list[InstanceState], engine_id: str) -> None:
        """Abort a run on the instances it was on: each frees its blocks."""
        await asyncio.gather(*(s.handle.abort_request.remote(engine_id) for s in targets), return_exceptions=True)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_on(self, entry: InstanceState, request_id: str) -> None:
        try:
            await entry.handle.abort_request.remote(request_id)
        except Exception as e:  # the instance is gone: so are the request's blocks there
            logger.warning("could not abort %s on %s: %s", request_id, entry.name, e)

    def _forget(self, state: RequestState) -> None:
        for entry in (state.prefill, state.decode):
            if entry is not None:
                entry.load_tokens -= self._load(state)
        state.prefill = state.decode = None
        self.requests.pop(state.engine_id, None)

    # Outputs --------------------------------------------------------------------------------

    async def _poll(self, entry: InstanceState) -> None:
        while not self._closed:
            try:
                outputs = await entry.handle.get_outputs.remote(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the instance failed or died: its requests cannot go on there
                entry.failure = str(e)
                logger.error("instance %s failed: %s", entry.name, e)
                if self.config.replace_failed_instances and not self._closed:
                    self._replacing[entry.role] = self._replacing.get(entry.role, 0) + 1
                    self._spawn(self._replace(entry))
                self._fail_requests_on(entry, e)
                return
            for output in outputs:
                self._route(entry, output)

    def _route(self, entry: InstanceState, delta: RequestDelta) -> None:
        state = self.requests.get(delta.request_id)
        if state is None or state.cancelled:
            if not delta.finished:
                # Calls to an instance may run out of order: an abort can overtake the request it
                # cancels, which then starts after all. Stop it wherever it shows up.
                self._spawn(self._abort_on(entry, delta.request_id))
            return
        output = state.add(delta)
        now = time.time()
        # A re-run repeats tokens the request already has: time only the ones past them.
        state.metrics.token_times.extend([now] * (len(output.output_token_ids) - len(state.metrics.token_times)))
        for name, value in zip(STAGE_TIMES, delta.stage_times):
            if value is not None:
                setattr(state.metrics, name, value)
        if delta.prefilled is not None and not state.cancelled:
            self._spawn(self._hand_over(state, delta.prefilled))
        if delta.finished and delta.finish_reason == "error":
            # The run could not go on there (its KV pull failed, say): re-run it elsewhere.
            self._spawn(self._rerun(state, InstanceFailure(f"request {state.request_id} failed on {entry.name}")))
            return
        if delta.finished:
            state.finished = True
            state.metrics.finished_time = now
        output.metrics = dataclasses.replace(state.metrics, token_times=list(state.metrics.token_times))
        state.queue.put_nowait(output)

    async def _hand_over(self, state: RequestState, prefilled) -> None:
        """Give a prefilled request to the decode instance with the most room."""
        try:
            entry = self._pick(await self._healthy("decode"))
            state.decode = entry
            entry.load_tokens += self._load(state)
            await entry.handle.add_prefilled.remote(prefilled)
            if state.cancelled:  # cancelled while the hand-over was on its way
                await entry.handle.abort_request.remote(state.engine_id)
        except ValueError as e:  # refused: the request itself is at fault
            await self._cancel(state)
            state.queue.put_nowait(e)
        except Exception as e:  # no decode instance, or it died taking the request: run it again
            await self._rerun(state, e if isinstance(e, InstanceFailure) else InstanceFailure(str(e)))

    def _fail_requests_on(self, entry: InstanceState, error: Exception) -> None:
        """Re-run (or fail) every request that still needed ``entry``."""
        for state in list(self.requests.values()):
            if state.finished or entry not in (state.prefill, state.decode):
                continue
            if entry is state.prefill and entry is not state.decode and state.metrics.migration_end is not None:
                continue  # its KV is on the decode instance already: it no longer needs the prefill side
            self._spawn(self._rerun(state, InstanceFailure(f"instance {entry.name} failed: {error}")))

    async def _rerun(self, state: RequestState, error: InstanceFailure) -> None:
        """Free the failed run's blocks on the instances still up, then run the request again from its
        prompt under a new engine id, so outputs of the old run still in flight are not taken for it."""
        if state.finished or state.cancelled or self.requests.get(state.engine_id) is not state:
            return  # done, cancelled, or another failure of the same run got here first
        targets, engine_id = [s for s in (state.prefill, state.decode) if s is not None], state.engine_id
        self._forget(state)
        await self._abort_run(targets, engine_id)
        if state.attempts >= self.config.max_request_attempts:
            state.queue.put_nowait(error)
            return
        if role := self._unavailable_role():
            state.queue.put_nowait(InstanceFailure(f"{error}; no {role} instance is left to run it again"))
            return
        state.attempts += 1
        state.engine_id = f"{state.request_id}.retry{state.attempts - 1}"
        state.run_token_ids, state.run_text = [], ""
        self.requests[state.engine_id] = state
        logger.warning("%s; re-running %s (run %d)", error, state.request_id, state.attempts)
        try:
            await self._submit(state)
        except Exception as e:
            state.queue.put_nowait(e)

    async def _replace(self, failed: InstanceState) -> None:
        """Start a new instance in place of ``failed``, under a new actor name (peers cache their pair
        communicators by name), and poll it once its model is loaded. After the last failed try the
        dead instance stays listed, with why it was not replaced."""
        try:
            try:
                ray.kill(failed.handle)  # a failed worker may leave the actor itself up
            except Exception:
                pass
            entry = await self._launch_replacement(failed)
            if entry is None:
                return
            if self._closed:
                ray.kill(entry.handle)
                return
            self.instances[self.instances.index(failed)] = entry
            self._pollers.append(asyncio.create_task(self._poll(entry)))
            logger.info("%s replaces %s", entry.name, failed.name)
        finally:
            self._replacing[failed.role] -= 1
            async with self._pool_changed:
                self._pool_changed.notify_all()

    async def _launch_replacement(self, failed: InstanceState) -> InstanceState | None:
        loop = asyncio.get_running_loop()
        for attempt in range(REPLACEMENT_ATTEMPTS):
            if attempt:
                await asyncio.sleep(REPLACEMENT_BACKOFF_S * 2 ** (attempt - 1))
            if self._closed:
                return None
            self._generation += 1
            name = f"{self.config.name}-{failed.role}-r{self._generation}"
            try:
                handle = await loop.run_in_executor(None, launch_instance, failed.config, name)
                return InstanceState(name, failed.role, handle, await handle.info.remote(), config=failed.config)
            except Exception as e:
                logger.error("could not replace %s (try %d of %d): %s", failed.name, attempt + 1,
                             REPLACEMENT_ATTEMPTS, e)  # fmt: skip
                error = e
        failed.failure = f"{failed.failure}; not replaced after {REPLACEMENT_ATTEMPTS} tries: {error}"
        return None

    async def info(self) -> list[InstanceInfo]:
        """Each instance's current state (queues, KV use, failure)."""
        infos = await asyncio.gather(*(s.handle.info.remote() for s in self.instances), return_exceptions=True)
        for state, info in zip(self.instances, infos):
            if not isinstance(info, BaseException):
                state.info = info
        # A dead actor cannot answer: its last info, with why it failed.
        return [dataclasses.replace(s.info, failure=s.failure) if s.failure else s.info for s in self.instances]
