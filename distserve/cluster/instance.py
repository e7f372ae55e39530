"""An instance: one TP x PP group that behaves like one engine, as a Ray actor.

The actor owns the engine (its role, scheduler, block manager, output processing) and drives
the executor's workers from its own step loop thread, so callers are never on the per-step path:
they queue requests and long-poll for deltas. A rank of one runs the model in the actor itself.
Calls from other threads reach the step loop through an inbox; only ``release_kv`` (on the side
that holds KV) answers at once, because the puller must know whether the KV it read was still held.
A role change (``change_role``) happens in the step loop between two steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distserve.cluster.instance_outputs import DEFAULT_SERVER, OutputQueues, ServerLoad
from distserve.core.config import EngineConfig
from distserve.core.errors import InstanceFailure, InstanceStalled, RequestError
from distserve.core.handover import Handover
from distserve.core.outputs import RequestDelta, coalesce
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence
from distserve.core.step_metrics import StepRecord
from distserve.engine.executor import Executor, cluster_device
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.node_groups import ray_node_ids
from distserve.engine.ray_runtime import cuda_actor_options
from distserve.kv_tier.client import TierClient
from distserve.kv_transfer.plan import KVEndpoint, KVSource
from distserve.kv_transfer.puller import RANK_PULLS, KVPuller, MigrationRecord, PullTotals
from distserve.model_executor.model_loader import resolve_model
from distserve.parallel.ranks import check_parallel_config
from distserve.scheduling.step_time import StepCost
from distserve.scheduling.swap import SwapSpace

logger = logging.getLogger(__name__)

IDLE_HEALTH_CHECK_S = 1.0  # an idle instance pings its workers this often, so a death is seen without traffic
LEASE_CHECK_S = 0.5  # how often the step loop looks for API servers past their lease
LOAD_COUNT_S = 0.1  # how often the step loop counts what each API server's requests hold
# Threads serving actor calls: long polls must not block submissions, nor the KV pulls its rank holds.
MAX_CONCURRENT_CALLS = 16 + RANK_PULLS
# Steps an instance keeps for recent_steps(): a few minutes of a loaded instance's, a few MB.
RECENT_STEPS = 8192


@dataclass
class InstanceInfo:
    name: str
    role: Role
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_held: int  # requests handed on whose KV waits for a decode instance to pull it
    num_pending: int  # decode: handed-over requests waiting for blocks or for their KV
    num_throttled_steps: int  # prefill: steps that admitted nothing because held KV passed its limit
    num_admission_waits: int  # decode: handed-over requests that had to wait for free blocks
    failure: str | None
    kv_cache_dtype: str = "auto"  # what its KV blocks store (cache.kv_cache_dtype)
    num_kv_pulls: int = 0  # decode: KV pulls done (one per hand-over, whatever its samples)
    num_kv_checksum_mismatches: int = 0  # decode: pulls failed because what arrived differed from what was sent
    num_copied_blocks: int = 0  # blocks a request's samples shared and one of them copied to write into
    # (Ray node id, pid) of its processes: the actor's, then its ranks' when they run apart from it.
    processes: tuple[tuple[str, int], ...] = ()
    kv_pulls_from: dict[str, PullTotals] = dataclasses.field(default_factory=dict)  # decode: by prefill instance
    # Preemption by swap (``cache.swap_space``): sequences in the host pool now, swaps so far each
    # way, and the seconds their copies took.
    num_swapped: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    swap_seconds: float = 0.0
    # Prompt tokens asked for since start (prefills and recomputes), those found cached (in its
    # prefix cache or the tier), and of those the tier's; blocks copied in from the tier and out to it.
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    tier_hit_tokens: int = 0
    tier_loaded_blocks: int = 0
    tier_saved_blocks: int = 0


@dataclass
class RoleChange:
    """A role change asked of the step loop, and its outcome for the caller waiting on ``done``."""

    role: Role
    asked: float  # time.monotonic() of the call
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    seconds: float = 0.0
    error: Exception | None = None


@dataclass
class AddRequest:
    """A new request to queue (``local_prefill``: a decode instance is to prefill it itself)."""

    seq: Sequence
    local_prefill: bool


@dataclass
class TakeOver:
    """A prefilled request to take over from the instance holding its KV."""

    handover: Handover


@dataclass
class GiveBack:
    """Runs (request id, attempt) to give back if their prompts have not started here."""

    runs: list[tuple[str, int]]


@dataclass
class Abort:
    """Stop a request (``attempt``: only that run)."""

    request_id: str
    attempt: int | None


# What the call threads send the step loop.
InboxMessage = AddRequest | TakeOver | RoleChange | GiveBack | Abort


class Instance:
    def __init__(self, config: EngineConfig, name: str, tier_stores: dict[str, Any] | None = None) -> None:
        """``tier_stores``: the prefix tier's store on each Ray node, by node id; this instance uses
        its own node's when ``cache.kv_tier_space`` is set."""
        self.name = name
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()
        self._outputs_ready = threading.Condition(self._lock)
        self._outputs = OutputQueues()  # each API server's deltas; under _lock
        self._next_lease_check = 0.0
        self._loads: dict[str, ServerLoad] = {}  # by API server: what its requests here hold; the step loop's
        self._next_load_count = 0.0
        self._loads_asked = False  # a server routes by ``loads()``: the step loop counts them
        self._active: dict[str, int] = {}  # request id -> attempt, of runs queued or running; under _lock
        self._failure: str | None = None
        self._stopping = False
        self._role_change: RoleChange | None = None  # asked for, not yet done; set and read by the step loop

        actor = ray.get_runtime_context().current_actor

        def make_puller(executor: Executor) -> KVPuller:
            """The engine's KV puller: pulls into ``executor``'s ranks; an answer wakes the step loop."""
            self.puller = KVPuller(name, executor.kv_endpoints(actor), config.cache.block_size, self._wakeup.set)
            return self.puller

        self.engine = LLMEngine(config, max_step_records=RECENT_STEPS, name=name, make_kv_puller=make_puller)
        self.engine.kv_source = KVSource(self.puller.endpoints, actor)  # this actor answers release_kv
        node = ray.get_runtime_context().get_node_id()
        if config.cache.kv_tier_space and (store := (tier_stores or {}).get(node)) is not None:
            self._attach_tier(store)
        # Where its processes are, known before anything can stall: what fencing it kills.
        own = (node, os.getpid())
        self._processes = (own, *self.engine.executor.worker_processes())
        self._loop = threading.Thread(target=self._run, name=f"{name}-step-loop", daemon=True)
        self._loop.start()

    def _attach_tier(self, store: Any) -> None:
        """Use the node's prefix tier; without it where its pool cannot be mapped here."""
        try:
            self.engine.attach_tier(TierClient(store, self.name))
        except (OSError, ValueError, ray.exceptions.RayError) as e:
            logger.warning("%s: serving without the KV tier: %s", self.name, e)

    # Calls from the cluster -------------------------------------------------------------------

    def ready(self) -> str:
        return self.name

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        attempt: int = 0,
        ttft_deadline: float | None = None,
        tpot_slo: float | None = None,
        validated: bool = False,
        local_prefill: bool = False,
        server: str = DEFAULT_SERVER,
    ) -> str:
        """Validate and queue a request; raises RequestError for a bad one, InstanceFailure when down.
        ``ttft_deadline``: the wall-clock time its first token is due by (the ``deadline`` policy);
        ``tpot_slo``: the seconds per output token it must average (``tpot_aware_chunking``).
        ``validated``: the orchestrator admitted it already (token ids, sampling params resolved for
        this model, checked against the smallest instance's KV cache), so it is queued as it is.
        ``local_prefill``: a decode instance is to prefill it and decode it (``cluster.local_prefill``).
        ``server``: the API server that sent it, which its outputs go to."""
        if validated:
            self._compile_grammar(params)
            seq = Sequence(prompt, params, request_id, priority=priority, attempt=attempt,
                           ttft_deadline=ttft_deadline, tpot_slo=tpot_slo)  # fmt: skip
        else:
            seq = self.engine.make_sequence(prompt, params, request_id, priority, attempt, ttft_deadline, tpot_slo)
        self._claim(seq.request_id, attempt, server)
        self._send(AddRequest(seq, local_prefill))
        return seq.request_id

    def add_handover(self, handover: Handover, server: str = DEFAULT_SERVER) -> None:
        """Decode: take a request over from the instance holding its KV once its blocks can be
        allocated. One that reaches a role that cannot take it is handed back (its delta carries it).
        One whose KV this instance holds itself (it left prefill since) decodes here without a pull.
        ``server``: the API server the request belongs to."""
        if handover.prefill_instance != self.name:  # the holder has claimed the run already
            self._compile_grammar(handover.sampling_params)
            self._claim(handover.request_id, handover.attempt, server)
        self._send(TakeOver(handover))

    def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's grammar on the call's thread (it may take seconds), so that the step
        loop finds it in the compiler's cache instead of compiling it between two steps."""
        if params.structured_outputs is not None:
            self.engine.input_processor.grammars.compile(params.structured_outputs)

    def change_role(self, role: Role | str) -> float:
        """Play ``role`` from now on, without reloading anything; returns once the engine has changed,
        with the seconds that took. Callers have stopped sending the old role's work; what the new
        role cannot serve leaves with a delta (``LLMEngine.change_role``). A decode instance first
        finishes pulling the KV it has started to take over."""
        change = RoleChange(Role.parse(role), time.monotonic())
        self._send(change)
        change.done.wait()
        if change.error is not None:
            raise change.error
        return change.seconds

    def step_line(self) -> StepCost | None:
        """The engine's step times as a line (fixed seconds, seconds per token), None while unknown:
        what the role controller forecasts layouts by. Read between the step loop's updates without
        a lock: one landing midway moves the fit by a step's weight."""
        return self.engine.step_time.line()

    def recent_steps(self, since: int = 0) -> tuple[int, list[StepRecord]]:
        """The steps run so far, counted from the first, and those from step ``since`` on that are
        still kept (the last RECENT_STEPS): what each ran (prompt or decode, sequences, tokens) and
        how long each phase of it took. Read beside the step loop without a lock: a step landing
        during the call may shift the records returned by one."""
        stats = self.engine.stats
        records = list(stats.records)
        first = stats.num_steps - len(records)
        return stats.num_steps, records[max(0, since - first) :]

    def give_back(self, runs: list[tuple[str, int]]) -> None:
        """Give back those of these runs (request id, attempt) whose prompts have not started here:
        each ends with ``finish_reason="requeue"`` and the orchestrator sends it on."""
        self._send(GiveBack(runs))

    def abort_request(self, request_id: str, attempt: int | None = None) -> None:
        """Stop a request (``attempt``: only that run) and free its blocks; its last delta says
        ``finish_reason="abort"``."""
        self._forget(request_id, attempt)
        self._send(Abort(request_id, attempt))

    def release_kv(self, request_id: str, attempt: int) -> bool:
        """Prefill: a decode instance has pulled the run's KV; its blocks can go. False when they went
        already (hold deadline, abort), maybe during the pull: what was pulled cannot be trusted."""
        released = self.engine.release_kv(request_id, attempt)
        if released:
            self._forget(request_id, attempt)
            self._wakeup.set()  # the step loop frees the blocks
        return released

    def kv(self, method: str, *args):
        """KV transfer calls to this instance's only rank, which runs in this actor."""
        return self.engine.executor.worker.kv(method, *args)

    def kv_endpoints(self) -> list[KVEndpoint]:
        return self.engine.executor.kv_endpoints(ray.get_runtime_context().current_actor)

    def forget_peer(self, name: str) -> None:
        """Instance ``name`` is gone: drop every KV channel to or from it and what the puller knows of it."""
        self.puller.forget(name)
        self.engine.executor.call_kv("drop_peer", name)

    def kv_peers(self) -> dict[str, Any]:
        """What this instance keeps for KV transfers: the puller's prefill sources, and each rank's
        channels and staging bytes."""
        return {"sources": self.puller.sources(), "ranks": self.engine.executor.call_kv("peers")}

    def migrations(self) -> dict[str, MigrationRecord]:
        """Decode: the latest KV pulls, by request id."""
        return self.puller.records()

    def get_outputs(
        self,
        timeout: float = 1.0,
        interval: float = 0.0,
        step_grace: float | None = None,
        server: str = DEFAULT_SERVER,
        lease: float | None = None,
    ) -> list[RequestDelta]:
        """What each request gained since the last call, waiting up to ``timeout`` seconds for the
        first news. Calls return at most every ``interval`` seconds unless a request has its first
        token, a hand-over or its end: a call cost the step loop about 0.6 ms on a CPU, more than
        half a small decode step (the call's thread takes the interpreter between the loop's
        kernels), so plain decode tokens come together; time to first token and ends are not delayed.
        Raises InstanceStalled when the batch on the executor has run ``step_grace`` seconds past
        twice what its tokens took at the slowest rate a step has had (``_check_step``). ``server``:
        the API server asking, which gets the outputs of its own requests only; ``lease``: the
        seconds without a call of it after which its requests here are ended (none: never)."""
        self._check_step(step_grace)
        end = time.monotonic() + timeout
        with self._outputs_ready:
            q = self._outputs.queue(server)
            q.polls += 1
            q.lease = lease
            try:
                while not (self._failure or q.urgent):
                    now = time.monotonic()
                    if now >= end or (q.deltas and now >= q.next_return):
                        break
                    # Before the interval is up only urgent news wakes this call; after it, any.
                    self._outputs_ready.wait((end if now >= q.next_return else min(q.next_return, end)) - now)
                if not q.deltas:
                    self._raise_if_failed()
                outputs, q.deltas, q.urgent = q.deltas, [], False
            finally:
                q.polls -= 1
                q.last_poll = q.next_return = time.monotonic()
            q.next_return += interval
        if not outputs:
            self._check_step(step_grace)
        return coalesce(outputs)

    def _check_step(self, grace: float | None) -> None:
        """Raise InstanceStalled when the batch on the executor has run ``grace`` seconds past twice
        what its tokens took at the slowest rate of any step. Before a step has ended nothing says
        how long one takes (the first may compile), so none is judged."""
        engine, executing = self.engine, self.engine.executing
        if grace is None or executing is None or not engine.slowest_per_token:
            return
        began, num_tokens = executing
        allowed = grace + 2 * num_tokens * engine.slowest_per_token
        ran = time.monotonic() - began
        if ran > allowed:
            raise InstanceStalled(f"{self.name}: a step of {num_tokens} tokens has run {ran:.1f} s, past the "
                                  f"{allowed:.1f} s it is allowed (liveness_timeout and its tokens at the slowest "
                                  f"rate seen, twice): its step loop is stuck")  # fmt: skip

    def info(self) -> InstanceInfo:
        engine = self.engine
        parallel = engine.config.parallel
        scheduler = engine.scheduler
        stats = engine.role.stats()
        return InstanceInfo(
            name=self.name,
            role=engine.role.role,
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            num_blocks=engine.block_manager.num_blocks,
            block_size=engine.block_manager.block_size,
            num_free_blocks=engine.block_manager.num_free_blocks,
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            num_preemptions=scheduler.num_preemptions,
            num_held=len(engine.kv_hold),
            num_pending=stats.num_pending,
            num_throttled_steps=stats.num_throttled_steps,
            num_admission_waits=stats.num_admission_waits,
            failure=self._failure,
            kv_cache_dtype=engine.config.cache.kv_cache_dtype,
            num_kv_pulls=self.puller.num_pulls,
            num_kv_checksum_mismatches=self.puller.num_checksum_mismatches,
            num_copied_blocks=engine.block_manager.num_copied_blocks,
            processes=self._processes,
            kv_pulls_from=self.puller.totals(),
            **_swap_counts(scheduler.swap),
            prompt_tokens=engine.block_manager.prefix_cache_queried_tokens,
            cached_prompt_tokens=engine.block_manager.prefix_cache_hit_tokens,
            tier_hit_tokens=engine.block_manager.tier_hit_tokens,
            tier_loaded_blocks=engine.tier.loaded_blocks if engine.tier else 0,
            tier_saved_blocks=engine.tier.saved_blocks if engine.tier else 0,
        )

    def worker_pids(self) -> list[int]:
        """Each rank's pid (this actor's own when its only rank runs here)."""
        return [pid for _, pid in self.engine.executor.worker_processes()] or [os.getpid()]

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._loop.join(timeout=30)
        self.engine.shutdown()

    # Bookkeeping of the runs queued here -----------------------------------------------------

    def _claim(self, request_id: str, attempt: int, server: str) -> None:
        """Refuse a run this instance has (or had a later one of) before it reaches the step loop;
        its outputs go to ``server``."""
        with self._lock:
            self._raise_if_failed()
            current = self._active.get(request_id)
            if current is not None and current >= attempt:
                raise RequestError(f"request id '{request_id}' is already in use")
            self._active[request_id] = attempt
            self._outputs.own(request_id, server)

    def _forget(self, request_id: str, attempt: int | None) -> None:
        with self._lock:
            if attempt is None or self._active.get(request_id) == attempt:
                self._active.pop(request_id, None)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise InstanceFailure(self._failure)

    # The step loop ---------------------------------------------------------------------------

    def _send(self, message: InboxMessage) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._take_inbox()
                self._end_requests_of_silent_servers()
                self._count_loads()
                self._publish(engine.tick())
                if self._role_change is not None and engine.role.ready_to_leave():
                    self._change_role()  # KV pulled or past its deadline (prefill), admissions (decode)
                if not engine.has_unfinished_requests():
                    if not self._wakeup.wait(IDLE_HEALTH_CHECK_S):  # a quiet second: are the workers alive?
                        engine.executor.check_health()
                    continue
                steps = engine.stats.num_steps
                deltas = engine.step()
                # No batch could run (prefill held back): wait for a release. A batch of prompt chunks
                # short of their ends runs without a delta, and the next must follow at once.
                if engine.stats.num_steps == steps:
                    self._wakeup.wait(IDLE_HEALTH_CHECK_S)
                self._publish(deltas)
        except InstanceFailure as e:
            self._fail(str(e))
        except Exception as e:  # a bug, not a worker death: fail loudly rather than hang callers
            logger.exception("%s: step loop failed", self.name)
            self._fail(f"{self.name}: step loop failed: {e!r}")

    def _take_inbox(self) -> None:
        deltas: list[RequestDelta] = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            match message:
                case AddRequest(seq, local_prefill) if not self._takes_prompt(seq, local_prefill):
                    # Sent before a change to decode: back to the orchestrator.
                    deltas.append(RequestDelta(seq.request_id, seq.attempt, [], "", True, "requeue", 0))
                case AddRequest(seq, local_prefill):
                    self.engine.add_sequence(seq, local_prefill)
                case TakeOver(handover) if self._takes_over(handover):
                    self.engine.add_handover(handover)
                case TakeOver(handover):  # sent before a role change: back to the orchestrator
                    if handover.prefill_instance != self.name:
                        self._forget(handover.request_id, handover.attempt)
                    deltas.append(RequestDelta(handover.request_id, handover.attempt, [], "", False, None, 0, handover))
                case RoleChange():
                    self._role_change = message
                case GiveBack(runs):
                    deltas += self.engine.give_back(runs)
                case Abort(request_id, attempt):
                    deltas += self.engine.abort_request(request_id, attempt)
        self._publish(deltas)

    def _takes_prompt(self, seq: Sequence, local_prefill: bool) -> bool:
        """Any role but decode takes new prompts; a decode role those it is to prefill itself."""
        role = self.engine.role
        return role.takes_prompts or (local_prefill and role.role is Role.DECODE)

    def _takes_over(self, handover: Handover) -> bool:
        """A decode role takes hand-overs; a colocated one only of the KV it holds itself."""
        role = self.engine.role
        return role.role is Role.DECODE or (role.decodes and handover.prefill_instance == self.name)

    def _change_role(self) -> None:
        change, self._role_change = self._role_change, None
        try:
            self._publish(self.engine.change_role(change.role))
        except Exception as e:
            change.error = e
        change.seconds = time.monotonic() - change.asked
        change.done.set()

    def _end_requests_of_silent_servers(self) -> None:
        """End the requests of an API server that has not polled for the lease it asked for (it
        died, or is cut off): nobody will read their outputs, and their KV is freed for the rest."""
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + LEASE_CHECK_S
        with self._lock:
            gone = {server: self._outputs.drop_server(server) for server in self._outputs.silent(now)}
        for server, requests in gone.items():
            logger.warning("%s: API server %s has not asked for its outputs past its lease: ending its %d requests",
                           self.name, server, len(requests))  # fmt: skip
            for request_id in requests:
                self._forget(request_id, None)
                self._publish(self.engine.abort_request(request_id))  # to no server: dropped

    def loads(self) -> dict[str, ServerLoad]:
        """What each API server's requests here hold, counted by the step loop at most
        ``LOAD_COUNT_S`` ago: what every server routes by, its own requests and the others'. The
        step loop counts only once some server has asked (a cluster of several servers)."""
        self._loads_asked = True
        return self._loads

    def _count_loads(self) -> None:
        now = time.monotonic()
        if not self._loads_asked or now < self._next_load_count:
            return
        self._next_load_count = now + LOAD_COUNT_S
        with self._lock:
            owners = dict(self._outputs.owners)
        loads: dict[str, ServerLoad] = {}
        for request_id, samples in self.engine.requests.items():
            seqs = list(samples.values())
            first = seqs[0]
            to_prefill = 0 if first.num_output_tokens else first.num_prompt_tokens - first.num_computed_tokens
            load = loads.setdefault(owners.get(request_id, DEFAULT_SERVER), ServerLoad())
            load.add(first.num_prompt_tokens, [seq.sampling_params.max_tokens for seq in seqs], to_prefill)
        self._loads = loads

    def _publish(self, deltas: list[RequestDelta]) -> None:
        if not deltas:
            return
        with self._outputs_ready:
            notify = False
            now = time.monotonic()
            for delta in deltas:
                run_over = delta.finished and not delta.samples_left
                if run_over and self._active.get(delta.request_id) == delta.attempt:
                    del self._active[delta.request_id]
                q = self._outputs.put(delta, run_over and self._active.get(delta.request_id) is None)
                # A wake-up takes the interpreter from this loop: only when a poll is to return.
                notify = notify or q.urgent or now >= q.next_return
            if notify:
                self._outputs_ready.notify_all()

    def _fail(self, reason: str) -> None:
        logger.error("%s", reason)
        with self._outputs_ready:
            self._failure = reason
            self._outputs_ready.notify_all()


def launch_instance(config: EngineConfig, name: str, tier_stores: dict[str, Any] | None = None) -> Any:
    """Start an instance actor named ``name`` (with the prefix tier's ``tier_stores``, by node id)
    and wait until its model is loaded; returns the handle.

    Raises ValueError for a bad configuration or a name in use, InstanceFailure when a worker fails.
    """
    resolved = resolve_model(config.model)
    check_parallel_config(resolved.hf_config, resolved.shape, config.parallel)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=cluster_device(config)))
    # A single rank runs in the instance actor, which then needs the GPU; otherwise its workers do.
    gpus = 1 if config.parallel.world_size == 1 and config.model.device == "cuda" else 0
    try:
        ray.get_actor(name)
    except ValueError:
        pass
    else:
        raise ValueError(f"an actor named '{name}' already exists in this Ray cluster: instance names must be unique")
    options = cuda_actor_options("cuda" if gpus else "cpu")
    if config.parallel.nodes:  # on the node of its first stage, where its only rank runs when it has one
        node = config.parallel.nodes[0]
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray_node_ids([node])[node], soft=False)
    handle = (
        ray.remote(Instance)
        .options(name=name, num_cpus=0, num_gpus=gpus, max_concurrency=MAX_CONCURRENT_CALLS, **options)
        .remote(config, name, tier_stores)
    )
    try:
        ray.get(handle.ready.remote())
    except ray.exceptions.RayActorError as e:
        ray.kill(handle)
        raise InstanceFailure(f"{name}: the instance failed to start: {e}") from None
    return handle


def _swap_counts(swap: SwapSpace | None) -> dict[str, Any]:
    """``InstanceInfo``'s swap fields."""
    if swap is None:
        return {}
    return {
        "num_swapped": len(swap),
        "num_swap_outs": swap.num_swap_outs,
        "num_swap_ins": swap.num_swap_ins,
        "swap_seconds": swap.copy_seconds,
    }
