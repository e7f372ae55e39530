"""The orchestrator: admits requests, sends them to instances, hands prefilled requests to decode,
streams outputs back and cancels. It runs on an asyncio loop and talks to instances only through
their queues (``add_request``, ``add_handover``, ``abort_request``) and one long poll per instance,
so it is never on an instance's per-step path.

Request path (disaggregated): tokenize and validate (on the ``InputWorkers``' threads: the loop
only awaits them) -> a prefill instance (``Router``) ->
its first token comes back with a ``Handover`` -> the decode instance with the most room takes
it over and pulls the KV -> its tokens stream back. Colocated: one instance does both. Roles may
change while serving (``RoleChanger``), so a cluster can mix prefill, decode and colocated
instances: new prompts go to prefill and colocated ones, hand-overs to decode ones, and a request
an instance hands on or gives back when it changes role moves on the same way. Instances
send each step's deltas; a request's ``OutputBuilder`` adds them up into what its client sees.
A request is checked against the cluster's ``RequestLimits`` before any work is done for it. It
is known to instances by an id of its own, the client's with a unique suffix, so a client that
reuses an id (right after cancelling it, say) never gets the old request's output; its outputs
carry the client's id. Each run of it (``attempt``) is told apart too, so a re-run after an
instance failure (``Failover``) never takes an old run's output for its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import ray
import torch

from distserve.cluster.config import ClusterConfig
from distserve.cluster.core_plan import plan_cores
from distserve.cluster.directory import ClusterDirectory, ClusterView, InstanceView
from distserve.cluster.failover import Failover
from distserve.cluster.fencing import fence
from distserve.cluster.input_workers import InputWorkers
from distserve.cluster.instance import InstanceInfo, launch_instance
from distserve.cluster.instance_outputs import DEFAULT_SERVER
from distserve.cluster.instance_pool import InstancePool
from distserve.cluster.loop_lag import LoopLag
from distserve.cluster.request_table import RequestState, RequestTable
from distserve.cluster.role_changes import RoleChanger, RoleChangeRecord
from distserve.cluster.role_control.controller import RoleController
from distserve.cluster.role_control.request_records import Arrival, FinishedRequest, InFlight
from distserve.cluster.routing import InstanceState, Router, spread_prompts
from distserve.core.config import EngineConfig
from distserve.core.cpu_cores import available_cores
from distserve.core.errors import InstanceFailure, InstanceStalled, RequestError
from distserve.core.handover import Handover
from distserve.core.outputs import RequestDelta, RequestOutput
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.core.slo import RequestSLO
from distserve.engine.executor import cluster_device
from distserve.engine.input_processor import InputProcessor
from distserve.engine.node_groups import check_nodes_hold
from distserve.kv_tier.store import TierInfo, start_tier_stores, tier_blocks
from distserve.kv_transfer.plan import KVCacheShape
from distserve.model_executor.model_loader import (
    ResolvedModel,
    default_sampling_params,
    eos_token_ids,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0
VIEW_PUBLISH_S = 0.2  # how often the managing server looks for changes to publish to the others
JOIN_TIMEOUT_S = 60.0  # how long a server waits for the managing one's first view
LOAD_READ_S = 0.2  # how often a server of several reads what the others' requests hold on each instance
RUN_ID_SUFFIX = 12  # hex digits of the suffix that makes a request's own id unique
# What tells the orchestrator that an instance is gone: its actor died, or it reported its workers failed.
INSTANCE_GONE = (ray.exceptions.RayActorError, InstanceFailure)


def _arrival(state: RequestState) -> Arrival:
    """What the role controller knows of a request when it arrives."""
    return Arrival(state.metrics.arrival_time, len(state.prompt_token_ids), state.params.max_tokens, state.slo)


class Orchestrator:
    """``server_id``: the API server it serves, which instances send its requests' outputs to;
    ``directory``: that of a cluster whose first server manages it (``None`` for the first itself,
    which starts the instances and makes the directory when ``api_servers`` > 1)."""

    def __init__(self, config: ClusterConfig, server_id: str = DEFAULT_SERVER, directory: Any = None) -> None:
        self.config = config
        self.server_id = server_id
        self.directory = directory
        self.manages = directory is None  # starts, replaces and re-roles instances; else follows the view
        self._replaces: dict[str, str] = {}  # a replacement's name -> the failed instance's
        self.instance_pool = InstancePool()
        self.requests = RequestTable()
        self.router = Router(config.engine.cache.block_size)
        self.tier_stores: dict[str, Any] = {}  # the prefix tier's store on each node, by node id
        self.failover = Failover(
            config.name, config.replace_failed_instances, self.instance_pool, self.spawn, self._replaced,
            self.tier_stores, manages=self.manages,
        )  # fmt: skip
        self.roles = RoleChanger(self.instance_pool, self._leaving_layout, self._roles_changed)
        self.controller = RoleController(self, config.role_control)
        self.input_workers = InputWorkers(config.input_workers)
        self.loop_lag = LoopLag()  # liveness deadlines leave out the time this loop did not run
        self._pollers: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # hand-overs and aborts in flight, kept from the GC

    async def start(self) -> None:
        """Launch every instance (in parallel) and start polling them; a server that does not
        manage the cluster joins the instances its directory lists instead."""
        self._pollers.append(asyncio.create_task(self.loop_lag.run()))  # before any poll is timed
        resolved = resolve_model(self.config.engine.model)
        if not self.manages:
            await self._join(resolved)
            return
        loop = asyncio.get_running_loop()
        # Cores are planned from this machine's: on a Ray cluster of several nodes, instances stay unbound.
        on_cpu = cluster_device(self.config.engine) == "cpu" and sum(n["Alive"] for n in ray.nodes()) == 1
        plan = plan_cores(self.config, available_cores(), cpu=on_cpu)  # `distserve launch` planned already
        if plan.config is not self.config and on_cpu:
            for line in plan.instance_lines():
                logger.info("cores: %s", line)
        self.config = plan.config
        configs = self.config.instance_configs()
        check_nodes_hold(configs)  # a plan's node groups: refused before anything starts
        self._start_tier(resolved, [config for _, config in configs])
        handles = await asyncio.gather(
            *(loop.run_in_executor(None, launch_instance, config, name, self.tier_stores) for name, config in configs),
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
        self._prepare_inputs(resolved)
        self._pollers.append(asyncio.create_task(self.controller.run()))  # it decides while adaptive
        if self.config.api_servers > 1:
            self.directory = ClusterDirectory.options(name=f"{self.config.name}-directory").remote()
            await self.directory.publish.remote(self.view())
            self._pollers.append(asyncio.create_task(self._publish_views()))
            self._pollers.append(asyncio.create_task(self._serve_role_requests()))
            self._pollers.append(asyncio.create_task(self._read_loads()))

    def _prepare_inputs(self, resolved: ResolvedModel) -> None:
        """What admits requests: the limits, the input processor (a request must fit the smallest
        instance it may be sent to), whether priorities order any queue."""
        tokenizer = load_tokenizer(resolved)
        sampling_defaults = default_sampling_params(resolved, self.config.engine.model.generation_config)
        if sampling_defaults and self.manages:  # as vLLM warns: a request's sampling changes with the model directory
            logger.warning(
                "requests that leave them out sample with the model's generation_config.json defaults %s "
                "(--generation-config vllm ignores them)",
                sampling_defaults,
            )
        smallest = min(self.instances, key=lambda s: s.info.num_blocks * s.info.block_size)
        self.limits = self.config.limits.resolve(resolved.max_model_len)
        # Priorities order the queues only where the priority policy runs: elsewhere one is refused, not ignored.
        self.priority_policy = any(s.config.scheduler.policy == "priority" for s in self.instances)
        self.input_processor = InputProcessor(
            tokenizer,
            resolved.shape.vocab_size,
            resolved.max_model_len,
            smallest.info.num_blocks,
            smallest.info.block_size,
            eos_token_ids(resolved, tokenizer),
            sampling_defaults,
        )

    # Several API servers ------------------------------------------------------------------------

    def view(self) -> ClusterView:
        """The instances as this (managing) server sees them, for the others."""
        instances = tuple(
            InstanceView(
                s.name, s.role, s.handle, s.info, s.config, s.failure, s.changing_to, self._replaces.get(s.name)
            )
            for s in self.instances
        )
        pool = self.instance_pool
        return ClusterView(instances, dict(pool.replacing), pool.changing_roles)

    async def _publish_views(self) -> None:
        """Publish the view whenever what the other servers act on changes."""
        published = self.view().key
        while not self.closed:
            await asyncio.sleep(VIEW_PUBLISH_S)
            view = self.view()
            if view.key != published:
                await self.directory.publish.remote(view)
                published = view.key

    async def _serve_role_requests(self) -> None:
        """Make the role changes other servers were asked for, and give them the answer."""
        while not self.closed:
            request = await self.directory.next_role_request.remote(POLL_TIMEOUT_S)
            if request is None:
                continue
            try:
                answer: Any = await self.set_roles(request.roles, request.role_control)
            except Exception as e:
                answer = e
            await self.directory.answer.remote(request.id, answer)

    async def _read_loads(self) -> None:
        """Route by what the other servers' requests hold on each instance too, as the instances
        count it, so that servers that each spread their own requests do not pile onto one."""
        while not self.closed:
            await asyncio.sleep(LOAD_READ_S)
            live = self.instance_pool.live()
            answers = await asyncio.gather(*(s.handle.loads.remote() for s in live), return_exceptions=True)
            for entry, loads in zip(live, answers):
                if isinstance(loads, BaseException):  # its poll tells a death apart
                    continue
                others = [load for server, load in loads.items() if server != self.server_id]
                entry.others_load_tokens = sum(load.load_tokens for load in others)
                entry.others_prefill_tokens = sum(load.prefill_tokens for load in others)

    async def _join(self, resolved: ResolvedModel) -> None:
        """Serve the instances of a cluster another server manages, and follow its changes."""
        version, view = await self.directory.watch.remote(0, JOIN_TIMEOUT_S)
        if view is None:
            raise InstanceFailure(f"the cluster's first server published no instances in {JOIN_TIMEOUT_S:g} s")
        self._follow_view(view)
        self._prepare_inputs(resolved)
        self._pollers.append(asyncio.create_task(self._follow(version)))
        self._pollers.append(asyncio.create_task(self._read_loads()))

    async def _follow(self, version: int) -> None:
        while not self.closed:
            try:
                version, view = await self.directory.watch.remote(version, POLL_TIMEOUT_S * 5)
            except ray.exceptions.RayActorError:  # the managing server is gone, and its instances with it
                logger.error("the cluster's directory is gone: this server can follow no changes")
                return
            self._follow_view(view)
            await self.instance_pool.changed()

    def _follow_view(self, view: ClusterView) -> None:
        """Take the managing server's view: new instances polled, roles and failures as it says
        (a failure it saw first re-runs this server's requests there), replacements under way."""
        known = {s.name: s for s in self.instances}
        added = False
        for v in view.instances:
            entry = known.get(v.name)
            if entry is None:
                entry = InstanceState(v.name, v.role, v.handle, v.info, v.config, failure=v.failure)
                replaced = known.get(v.replaces) if v.replaces else None
                if v.failure is None:
                    self.add_instance(entry, replacing=replaced)
                    added = True
                else:
                    self.instance_pool.add(entry, replaced)
                continue
            added = added or (entry.role, entry.changing_to) != (v.role, v.changing_to)
            entry.role, entry.changing_to = v.role, v.changing_to
            if v.failure is not None and entry.failure is None:
                self._instance_failed(entry, InstanceFailure(v.failure))
        self.instance_pool.replacing = dict(view.replacing)
        self.instance_pool.changing_roles = view.changing_roles
        if added:
            self.spread_prompts()

    def _start_tier(self, resolved: ResolvedModel, configs: list[EngineConfig]) -> None:
        """A prefix tier store on every node, sized by the largest ``kv_tier_space`` of any instance."""
        space = max(config.cache.kv_tier_space for config in configs)
        if not space:
            return
        engine = configs[0]
        shape = resolved.shape
        dtype = resolve_dtype(engine.model.dtype, resolved.hf_config, torch.device(cluster_device(engine)))
        geometry = KVCacheShape(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, engine.cache.block_size, dtype,
            engine.cache.kv_cache_dtype,
        )  # fmt: skip
        blocks = tier_blocks(space, geometry)
        if blocks < 1:
            raise ValueError(f"kv_tier_space {space} GiB holds no block of {geometry.bytes_per_block} bytes")
        self.tier_stores.update(start_tier_stores(self.config.name, geometry, blocks))
        self.router.use_tier(blocks)

    async def tier_info(self) -> list[TierInfo]:
        """Each node's prefix tier store, its state and counts; none without a tier."""
        return list(await asyncio.gather(*(store.info.remote() for store in self.tier_stores.values())))

    @property
    def instances(self) -> list[InstanceState]:
        return self.instance_pool.instances

    @property
    def closed(self) -> bool:
        return self.instance_pool.closed

    async def shutdown(self) -> None:
        self.instance_pool.closed = True
        self.input_workers.shutdown()
        for task in [*self._pollers, *self._background]:
            task.cancel()
        await asyncio.gather(*self._pollers, *self._background, return_exceptions=True)
        if not self.manages:  # the instances serve on, for the other servers
            return
        await asyncio.gather(*(s.handle.shutdown.remote() for s in self.instances), return_exceptions=True)
        for state in self.instances:
            ray.kill(state.handle)
        for store in self.tier_stores.values():
            ray.kill(store)
        if self.directory is not None:
            ray.kill(self.directory)

    async def set_roles(self, roles: dict[str, Role | str], role_control: str | None = None) -> list[RoleChangeRecord]:
        """Give instances new roles (see ``RoleChanger.set_roles``), and with ``role_control`` take
        roles back from the controller ("fixed", first, so that it does not undo them) or hand
        them to it ("adaptive", once they are set). Raises RequestError, changing nothing, for a
        mode that is not one or adaptive control without SLOs. A server that does not manage the
        cluster asks the one that does."""
        if not self.manages:
            answer = await self.directory.set_roles.remote({k: str(v) for k, v in roles.items()}, role_control)
            if isinstance(answer, BaseException):
                raise answer
            return answer
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
        self.instance_pool.add(entry, replacing)
        self._pollers.append(asyncio.create_task(self._poll(entry)))

    def _replaced(self, entry: InstanceState, failed: InstanceState) -> None:
        self._replaces[entry.name] = failed.name
        self.add_instance(entry, replacing=failed)
        self.spread_prompts()  # the failed one's prompts went to the others meanwhile

    def _leaving_layout(self, layout: dict[str, Role]) -> None:
        """Role changes start: the controller remembers what the layout being left served."""
        self.controller.record_left(layout, time.time())

    def _roles_changed(self) -> None:
        """By an operator too: the controller lets the new layout settle, and queued prompts spread."""
        self.controller.layout_changed(time.time())
        self.spread_prompts()

    def pool(self, role: Role) -> list[InstanceState]:
        return self.instance_pool.pool(role)

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
        request. ``slo``: its own latency objectives, for the role controller. ``request_id``: the id its
        outputs carry (default: a new one); it need not be unique."""
        self.check_request(prompt, params, priority)
        client_id = request_id or uuid.uuid4().hex
        request_id = f"{client_id}-{uuid.uuid4().hex[:RUN_ID_SUFFIX]}"
        # Tokenizing, bad words and the grammar compile may take seconds: not on this loop.
        seq = await self.input_workers.run(self.input_processor.process, prompt, params, request_id, priority)
        params = seq.sampling_params
        if params.seed is None and params.temperature > 0:
            # Seeded sampling does not depend on the batch, so a re-run after a failure repeats the tokens.
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        if role := self.instance_pool.unavailable_role():
            raise InstanceFailure(f"no {role} instance is available to serve the request")
        state = RequestState(
            request_id, seq.prompt, seq.prompt_token_ids, params, priority, slo or RequestSLO(), client_id=client_id
        )
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
                if output.finished and state.delivered:
                    return
        finally:
            if not state.finished:
                await self._cancel(state)
            self.requests.forget(state)

    def check_request(self, prompt: str | list[int], params: SamplingParams, priority: int = 0) -> None:
        """Refuse (RequestError) a request over the cluster's limits, or with a priority no queue
        orders by, before any work is done for it."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        self.limits.check(prompt, params)
        if priority and not self.priority_policy:
            raise RequestError(
                f"priority {priority} is used only under the priority scheduling policy, which this cluster does "
                "not run: leave it 0, or start the cluster with scheduler.policy priority (--policy priority)"
            )

    async def submit(self, state: RequestState) -> None:
        """Send the request's current run to a prefill (or colocated) instance, waiting for a
        replacement when none is healthy."""
        pool = await self.instance_pool.healthy(self.instance_pool.entry_pool)
        local = None if state.move_to else self._local_prefill(state, pool)
        if local is None:
            entry, to_prefill = self.router.pick_prefill(
                pool, state.prompt_token_ids, state.load, state.move_to, state.params.cache_salt
            )
        else:
            entry, to_prefill = local
        state.routed(entry, to_prefill, local=local is not None)
        attempt, slo = state.attempt, self.slo(state)
        ttft_deadline = state.metrics.arrival_time + slo.ttft if slo.ttft else None  # a re-run keeps the first's
        try:
            await entry.handle.add_request.remote(
                state.prompt_token_ids, state.params, state.request_id, state.priority, attempt,
                ttft_deadline, slo.tpot, validated=True, local_prefill=local is not None, server=self.server_id,
            )  # fmt: skip
        except INSTANCE_GONE as e:  # the instance died under the call
            self.spawn(self.rerun(state, attempt, InstanceFailure(f"instance {entry.name} failed: {e}")))

    def _local_prefill(self, state: RequestState, entry_pool: list[InstanceState]) -> tuple[InstanceState, int] | None:
        """The decode instance that prefills the request itself (``cluster.local_prefill``), with the
        prompt tokens it is expected to compute; None: a prefill instance does."""
        prefills = [s for s in entry_pool if s.role is Role.PREFILL]
        return self.router.pick_local_prefill(self.config.local_prefill, self.pool(Role.DECODE), prefills,
                                              state.prompt_token_ids, state.load, state.params.cache_salt)  # fmt: skip

    def slo(self, state: RequestState) -> RequestSLO:
        """The request's SLOs: each its own, else the cluster's (``role_control``); None without either."""
        cluster = self.controller.cluster_slo
        return RequestSLO(state.slo.ttft or cluster.ttft, state.slo.tpot or cluster.tpot)

    def spread_prompts(self) -> None:
        """Even out the prompts waiting for their first token over the instances that take new ones:
        after a role change adds such an instance, the queues at the others would still wait there
        while it has room. An instance gives back only prompts it has not started."""
        queues: dict[InstanceState, list[tuple[RequestState, int]]] = {e: [] for e in self.instance_pool.entry_pool()}
        for state in self.requests.values():  # in order of arrival
            if state.prefill in queues and state.decode is None and not state.has_output:
                queues[state.prefill].append((state, len(state.prompt_token_ids)))
        runs: dict[InstanceState, list[tuple[str, int]]] = {}
        for state, source, target in spread_prompts(queues):
            state.moving_to(target)
            runs.setdefault(source, []).append((state.request_id, state.attempt))
        for source, given in runs.items():
            logger.info("%s gives back %d queued prompts to even out the queues", source.name, len(given))
            self.spawn(self._give_back(source, given))

    async def _give_back(self, entry: InstanceState, runs: list[tuple[str, int]]) -> None:
        try:
            await entry.handle.give_back.remote(runs)
        except INSTANCE_GONE as e:  # its requests are re-run by the failover
            logger.warning("%s could not give back queued prompts: %s", entry.name, e)

    def in_flight(self) -> list[InFlight]:
        """Each request in flight, in order of arrival, with the times of its first and latest
        tokens: what the role controller sees before requests finish."""
        in_flight = []
        for state in self.requests.values():
            times = state.metrics.token_times
            in_flight.append(InFlight(_arrival(state), times[0], times[-1]) if times else InFlight(_arrival(state)))
        return in_flight

    async def rerun(self, state: RequestState, attempt: int, error: InstanceFailure | None) -> None:
        """Free the failed run's (``attempt``'s) blocks on the instances still up, then run the request
        again from its prompt as its next attempt, so outputs of the old run still in flight are told
        apart. Another failure of the same run, reported while or after this one re-runs it, is ignored.
        ``error`` None: the run was given back by a role change, which counts as no failure."""
        if state.finished or state.cancelled or state.attempt != attempt or state.rerunning:
            return
        targets = state.instances()
        state.begin_rerun(failed=error is not None)
        try:
            await self.abort_run(targets, state.request_id, attempt)
            final = None
            if state.failed_runs >= self.config.max_request_attempts:
                final = error
            elif role := self.instance_pool.unavailable_role():
                final = InstanceFailure(f"{error or 'given back'}; no {role} instance is left to run it again")
            if final is not None:  # no run left: the request ends with the failure
                self.requests.forget(state)
                state.queue.put_nowait(final)
                return
            state.new_attempt()
            logger.log(logging.WARNING if error else logging.DEBUG, "%s; re-running %s (run %d)",
                       error or "given back by a role change", state.request_id, state.attempt + 1)  # fmt: skip
        finally:
            state.end_rerun()
        try:
            await self.submit(state)
        except Exception as e:
            state.queue.put_nowait(e)

    async def _cancel(self, state: RequestState) -> None:
        """Abort wherever the request may be: both instances free its blocks."""
        state.cancel()
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
            liveness = self.config.liveness_timeout
            poll = entry.handle.get_outputs.remote(
                POLL_TIMEOUT_S, self.config.stream_interval, liveness, self.server_id, self._lease
            )
            try:
                deltas = await self._answer(poll, POLL_TIMEOUT_S + liveness)
            except (*INSTANCE_GONE, asyncio.TimeoutError) as e:  # its requests cannot go on there
                if isinstance(e, asyncio.TimeoutError):
                    e = InstanceStalled(f"{entry.name} left its outputs unanswered for {liveness:g} s "
                                        f"(liveness_timeout)")  # fmt: skip
                if isinstance(e, InstanceStalled) and self.manages:  # alive or not, it must not act again
                    e = InstanceFailure(f"{e}: fenced")
                    self.spawn(fence(entry.handle, entry.info.processes))
                if entry.failure is None:
                    self._instance_failed(entry, e)
                return
            except Exception:  # a bug in the call, not a death: report it and keep serving
                logger.exception("polling %s failed", entry.name)
                await asyncio.sleep(POLL_TIMEOUT_S)
                continue
            for delta in deltas:
                self._route(entry, delta)

    @property
    def _lease(self) -> float | None:
        """The seconds an instance keeps this server's requests once it stops polling: the first
        server's never end (the instances die with it)."""
        return None if self.manages else self.config.server_lease

    def _instance_failed(self, entry: InstanceState, error: BaseException) -> None:
        """``entry`` is gone: this server's requests that needed it run again (``Failover``)."""
        for state, failure in self.failover.instance_failed(entry, error, list(self.requests.values())):
            self.spawn(self.rerun(state, state.attempt, failure))

    async def _answer(self, poll: ray.ObjectRef, seconds: float) -> list[RequestDelta]:
        """The poll's answer, waited for until this loop has run ``seconds`` (``LoopLag``: a stall
        of the loop is no time the instance failed to answer in), else TimeoutError. An answer
        that has come is taken, however late its handling."""
        answer = poll.as_future()
        running = self.loop_lag.stopwatch()
        try:
            while not answer.done() and (left := seconds - running()) > 0:
                await asyncio.wait([answer], timeout=left)
        finally:
            if not answer.done():
                answer.cancel()
        if answer.cancelled():
            raise asyncio.TimeoutError
        return answer.result()

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
        if delta.fault is not None:
            self._end_with_fault(state, entry, delta)
            return
        if delta.finished and delta.finish_reason == "error":
            # The run could not go on there (its KV pull failed, say): run it again elsewhere.
            failure = InstanceFailure(f"request {state.request_id} failed on {entry.name}")
            self.spawn(self.rerun(state, delta.attempt, failure))
            return
        if delta.finished and delta.finish_reason == "requeue":  # given back by a role change
            self.spawn(self.rerun(state, delta.attempt, None))
            return
        if delta.first:
            state.first_token()
        now = time.time()
        # A re-run repeats tokens the request already has: time only the ones past them. With
        # several samples, the times are those of the longest.
        run = state.samples[delta.index].run
        num_tokens = len(run.output_token_ids) + len(delta.new_token_ids)
        state.metrics.token_times.extend([now] * (num_tokens - len(state.metrics.token_times)))
        if delta.finished and all(sample.run.finished or sample.run is run for sample in state.samples):
            state.finish(now)
            self._observe(state)
            # The KV of its tokens (but the last, never computed) stays in that instance's prefix cache.
            self._remember(entry, state, [*state.prompt_token_ids, *run.output_token_ids, *delta.new_token_ids][:-1])
        output = run.add(delta)
        if delta.handover is not None:
            self.spawn(self._hand_over(state, delta.handover, entry))
        state.queue.put_nowait(output)

    def _end_with_fault(self, state: RequestState, entry: InstanceState, delta: RequestDelta) -> None:
        """The request's own part of a step failed on ``entry`` (its sampling, its grammar...): it
        ends with that error and is not run again, since it would fail the same way anywhere; the
        instance goes on. Its run stops wherever else it is (other samples, KV held for decode)."""
        logger.warning("%s (on %s): the request ends with this error", delta.fault, entry.name)
        state.cancel()  # the run's later deltas are dropped, and nothing runs it again
        self.spawn(self.abort_run(state.instances(), state.request_id, delta.attempt))
        state.queue.put_nowait(delta.fault.of_request(state.client_id).error())

    def _remember(self, entry: InstanceState, state: RequestState, token_ids: list[int]) -> None:
        """Tell the router ``entry`` holds the KV of ``token_ids`` of ``state`` (under its cache salt),
        where routing reads it: a colocated instance's prefixes pick where prompts go, a decode
        instance's only which it prefills itself, and with a prefix tier every instance's are in the
        tier. Hashing every request's tokens on this loop is not done for nothing."""
        local_prefill = entry.role is Role.DECODE and self.config.local_prefill.mode != "off"
        if entry.role is Role.COLOCATED or local_prefill or self.router.tier_index is not None:
            self.router.remember(entry, token_ids, state.params.cache_salt)

    def _observe(self, state: RequestState) -> None:
        """A request's latencies, for the role controller."""
        m = state.metrics
        if m.token_times:
            self.controller.observe(FinishedRequest(**vars(_arrival(state)), finished=m.token_times[-1], ttft=m.ttft,
                                                    tpot=m.tpot))  # fmt: skip

    async def _hand_over(self, state: RequestState, handover: Handover, sender: InstanceState) -> None:
        """Give a prefilled request to the decode instance with the most room; or a request that
        ``sender`` hands on (it left decode) or back (it could not take it over) to another one."""
        state.handed_on(self.instance_pool.named(handover.prefill_instance) or sender)
        try:
            entry = self.router.pick_decode(await self.instance_pool.healthy(lambda: self._decoders(state.source)))
            state.handed_to(entry, time.time())
            self._remember(entry, state, state.prompt_token_ids)  # its KV is pulled into that prefix cache
            await entry.handle.add_handover.remote(handover, self.server_id)
            if state.cancelled:  # cancelled while the hand-over was on its way
                await entry.handle.abort_request.remote(state.request_id, handover.attempt)
        except INSTANCE_GONE as e:  # no decode instance, or it died taking the request: run it again
            failure = e if isinstance(e, InstanceFailure) else InstanceFailure(str(e))
            await self.rerun(state, handover.attempt, failure)
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

    async def info(self) -> list[InstanceInfo]:
        """Each instance's current state (queues, KV use, failure)."""
        infos = await asyncio.gather(*(s.handle.info.remote() for s in self.instances), return_exceptions=True)
        for state, info in zip(self.instances, infos):
            if not isinstance(info, BaseException):
                state.info = info
        # A dead actor cannot answer: its last info, with why it failed.
        return [dataclasses.replace(s.info, failure=s.failure) if s.failure else s.info for s in self.instances]
