"""Block mode: a discrete-event simulation that runs the engine's own scheduler for every instance
and records each request's whole ``RequestTimeline``.

Each instance owns a ``distserve.scheduling`` ``BlockManager`` and the engine's ``Scheduler`` in the
step mode its role sets (``PREFILL_ONLY``, ``PREFILL_FIRST`` or ``CHUNKED``) under the spec's
``SchedulerConfig``, every policy included; requests are ``SimSequence``s (``Sequence``s whose
tokens are counted, not held); the scheduler's clock is the simulated time and its step times
those simulated. Around it, each rule is the engine's (module or function in
``distserve/`` in brackets):

* Routing (``cluster/routing.py`` ``Router``): a prompt goes to the instance of the entry pool
  with room for it in its KV cache (any, when none has) that has the fewest prompt tokens to
  prefill, counted from its routing to the end of its prefill (``Orchestrator._prefilled``); ties to
  the least loaded. A hand-over goes to the decode instance with the least load. Load is
  ``prompt_len + output_len`` (its ``max_tokens``) on every instance a request was sent to until it
  finishes (``cluster/orchestrator.py`` ``Orchestrator._assign`` / ``unassign``); ties go to the
  lowest index. Prompts are taken to share no prefix, so no prefix cache shortens a prefill's
  count. All instances of a pool have the same KV size, so load per KV token orders them as load
  does.
* Step loop (``cluster/instance.py`` ``Instance._run``; ``engine/llm_engine.py`` ``LLMEngine.step``):
  an instance runs one batch at a time (pipeline stages take turns, so ``stage_time`` has no place
  here); between batches it ticks its role, then schedules. Whatever reaches it during a batch waits
  for the batch's end. After a batch each sequence takes its token, or the chunk it ran when that
  falls short of its prompt's end, and the instance's ``StepTimeModel`` sees the batch's tokens and time.
* Prefill instances (``engine/prefill_role.py`` ``PrefillRole``, ``KVHold``): a prefilled request
  keeps its blocks until its KV is pulled, and no prompt is scheduled while held blocks reach
  ``kv_hold_fraction`` of the pool. A request with one output token finishes there and frees its
  blocks at once.
* Decode instances (``engine/decode_role.py`` ``DecodeAdmission.admit``): hand-overs are admitted in
  arrival order while ``running + pulling < max_num_seqs`` and blocks for the prompt and the first
  token (``Sequence.from_handover``) can be allocated; no prefix cache. The ``KVPuller``
  (``kv_transfer/puller.py``) starts every admitted pull at once, but a channel moves one at a time
  (a rank's transfers take turns), so the link moves them one after another, in admission order,
  each taking ``transfer_time(prompt_len)``; at the pull's end the prefill instance frees the KV and
  the request joins the running batch. Preempted requests are recomputed there (``PREFILL_FIRST``, or
  ``CHUNKED`` with ``chunked_prefill``).
* Per-request disaggregation (``core/local_prefill.py``, ``Router.pick_local_prefill``): with
  ``local_prefill`` on, an arriving request the rule keeps local goes to the least loaded decode
  instance with room, which prefills it (its own step mode, its ``batch_time``) and decodes it:
  no hold, no hand-over, no pull. The rule sees the prompt's whole length (no prefix is cached).
* Colocated instances (``engine/role.py`` ``ColocatedRole``): ``PREFILL_FIRST``, or ``CHUNKED``
  (``chunked_prefill``), whose step of decode tokens and prompt chunks takes ``step_time`` of its
  decode part plus ``batch_time`` of its chunks (the two fits' constant terms both count: an
  approximation).
* Latency: a prefill batch takes ``batch_time(tokens computed per sequence)``, a decode step
  ``step_time(batch size, sum of the sequences' tokens)``; a batch's tokens are sampled at its end.

Steady stretches of decode steps (``decode_stretch``) pass at once, with the result of stepping:
when a decode step ends with nothing else due at the instance before the step after it would
begin, the step is drawn out into the stretch it starts, to its first step that ends at or after
the next event, a finish, or a block that is not free. Events at one time are taken in the order
they were made, as stepping makes them. An instance slowed by contention, or with a step gap,
steps one step at a time.

Not modeled: the time between steps (scheduling, RPCs, detokenization: a step starts when the last
one ends, a hand-over reaches decode when its prefill ends), the first pull's channel setup, prompts
sharing prefixes, EOS and stop strings (a request makes exactly ``output_len`` tokens), the context
limit, ``kv_hold_timeout`` and failures (no re-runs).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeVar

from distserve.core.config import SchedulerConfig
from distserve.core.local_prefill import LocalPrefillConfig, prefill_locally
from distserve.core.sequence import SequenceStatus
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.scheduler import ScheduledBatch, Scheduler, StepMode
from distserve.scheduling.step_time import StepTimeModel
from placement.decode_stretch import grow_blocks, step_ends, steps_with_free_blocks
from placement.sim_sequence import SimSequence
from placement.sim_specs import (
    ColocatedInstanceSpec,
    Contention,
    DecodeInstanceSpec,
    PrefillInstanceSpec,
    ServingDelays,
    SimRequest,
    SimResult,
    StepTimes,
)

_ARRIVAL, _STEP_DONE, _PULLED, _HANDOVER = range(4)


NO_DELAYS = ServingDelays()
NO_CONTENTION = Contention()
NO_LOCAL_PREFILL = LocalPrefillConfig()


def _later(time: float, delay: float) -> float:
    """``time + delay``, leaving exact times (the tests' fractions) exact when there is no delay."""
    return time + delay if delay else time


class _Clock:
    """The simulated time, which the schedulers read as the engine's read the wall clock."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Latency:
    batch_time: Callable[[list[int]], float]
    step_time: Callable[[int, int], float] | None  # None: never decodes (prefill instances)
    step_times: StepTimes | None = None


class _Engine:
    """One instance's engine as the simulation drives it: its block manager and scheduler, in its role's
    step mode (both phases, as configured; a subclass's ``step_mode`` for its role)."""

    def __init__(
        self,
        name: str,
        config: SchedulerConfig,
        manager: BlockManager,
        latency: _Latency,
        contention: Contention,
        prefill_contention: Contention | None,
        clock: _Clock,
    ) -> None:
        self.name = name
        self.manager = manager
        # The engine's step times, only where its scheduler reads them: the cut of chunks to a TPOT
        # SLO and the ``deadline-feasible`` policy.
        reads_step_times = config.policy == "deadline-feasible" or (
            config.enable_chunked_prefill and config.tpot_aware_chunking
        )
        self.step_model = StepTimeModel() if reads_step_times else None
        self.scheduler = Scheduler(config, manager, self.step_model, clock, self.step_mode(config))
        self.latency = latency
        self.contention = contention  # of the batches it runs; of its decode steps when the next is given
        self.prefill_contention = prefill_contention or contention
        self.pulls_until = 0.0  # a KV pull into or out of this instance runs until then
        self.index = 0  # in the simulation's list of instances
        self.busy = False
        self.load_tokens = 0  # the router's load
        self.prefill_tokens = 0  # prompt tokens routed here and not yet prefilled
        # The steps every decoding sequence takes part in (all with chunked prefill; decode steps
        # otherwise) and their tokens' times, kept once here rather than on every timeline: a
        # decoding sequence's timeline gets the ones since it joined (``decoding``) when it leaves.
        self.logged_steps: list[tuple[float, float, int]] = []
        self.logged_tokens: list[float] = []
        self.decoding: dict[SimSequence, int] = {}  # by where its steps begin in the logs

    @staticmethod
    def step_mode(config: SchedulerConfig) -> StepMode:
        return StepMode.both_phases(config)

    def may_schedule(self) -> bool:
        return True


class _Prefill(_Engine):
    def __init__(self, name: str, config: SchedulerConfig, manager: BlockManager, spec: PrefillInstanceSpec,
                 clock: _Clock) -> None:  # fmt: skip
        super().__init__(name, config, manager, _Latency(spec.batch_time, None), spec.contention, None, clock)
        self.held: dict[int, SimSequence] = {}
        self.held_blocks = 0
        self.hold_limit = max(1, int(config.kv_hold_fraction * manager.num_blocks))

    @staticmethod
    def step_mode(config: SchedulerConfig) -> StepMode:
        return StepMode.PREFILL_ONLY

    def may_schedule(self) -> bool:
        return self.held_blocks < self.hold_limit  # ``KVHold.full`` stops ``PrefillRole.may_schedule``


class _Decode(_Engine):
    def __init__(self, name: str, config: SchedulerConfig, manager: BlockManager, latency: _Latency,
                 contention: Contention, clock: _Clock) -> None:  # fmt: skip
        super().__init__(name, config, manager, latency, contention, None, clock)
        self.pending: deque[tuple[SimSequence, _Prefill]] = deque()  # hand-overs, with where their KV is held
        self.pulling = 0
        self.puller_free = 0.0  # when the link is done with the pulls it was given


@dataclass
class _Step:
    """A batch in flight; a decode step drawn out into a steady stretch stands for all its steps."""

    batch: ScheduledBatch
    computed: list[int] | None  # tokens each sequence computes; None for decode steps
    starts: list[float]  # of each step
    ends: list[float]  # of each step, where its tokens are sampled

    @property
    def stretched(self) -> bool:
        return len(self.starts) > 1


_E = TypeVar("_E", bound=_Engine)
_num_tokens = attrgetter("num_tokens")


class _EngineSim:
    def __init__(
        self,
        requests: Sequence[SimRequest],
        entry: list[_Engine],
        decodes: list[_Decode],
        transfer_time: Callable[[int], float],
        delays: ServingDelays,
        clock: _Clock,
        local_prefill: LocalPrefillConfig = NO_LOCAL_PREFILL,
    ) -> None:
        self.reqs = requests
        self.local_prefill = local_prefill
        self.delays = delays
        self.clock = clock
        self.entry, self.decodes, self.transfer_time = entry, decodes, transfer_time
        self.instances: list[_Engine] = [*entry, *decodes]
        for i, inst in enumerate(self.instances):
            inst.index = i
        self.timelines = [r.new_timeline(i) for i, r in enumerate(requests)]
        self.assigned: list[list[_Engine]] = [[] for _ in requests]
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.dirty: set[int] = set()

    def push(self, time: float, kind: int, inst: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, kind, inst, payload))

    def run(self) -> list[SimResult]:
        heap = self.heap
        # Negative sequence numbers put arrivals before other events at the same time, in request order.
        n = len(self.reqs)
        heap.extend((_later(r.arrival, self.delays.dispatch), i - n, _ARRIVAL, 0, i) for i, r in enumerate(self.reqs))
        heapq.heapify(heap)
        while heap:
            now, _, kind, inst, payload = heapq.heappop(heap)
            self.clock.now = now
            if kind == _ARRIVAL:
                self.arrive(now, payload)
            elif kind == _STEP_DONE:
                if not self.stretch(self.instances[inst], payload):
                    self.step_done(self.instances[inst], payload)
            elif kind == _HANDOVER:
                self.hand_over(now, *payload)
            else:
                self.pulled(now, self.instances[inst], *payload)
            # Everything that happens at one instant reaches the instances before any of them goes on.
            if heap and heap[0][0] <= now:
                continue
            dirty = sorted(self.dirty)
            self.dirty.clear()
            for i in dirty:
                self.iterate(now, self.instances[i])
        for t in self.timelines:
            if t.finish is None:
                raise RuntimeError(f"request {t.request_id} never finished: the simulation stalled")
        return [SimResult(t.ttft, t.tpot, t.finish, t.token_times, t) for t in self.timelines]

    def route(self, pool: list[_E], r: int) -> _E:
        inst = min(pool, key=lambda e: e.load_tokens)
        return self.assign(inst, r)

    def assign(self, inst: _E, r: int) -> _E:
        inst.load_tokens += self.reqs[r].prompt_len + self.reqs[r].output_len
        self.assigned[r].append(inst)
        self.dirty.add(inst.index)
        return inst

    def arrive(self, now: float, r: int) -> None:
        req = self.reqs[r]
        prefill = min(self.roomy(self.entry, req), key=lambda e: (e.prefill_tokens + req.prompt_len, e.load_tokens))
        inst = self.local_decode(req, prefill) or prefill
        self.assign(inst, r)
        inst.prefill_tokens += req.prompt_len
        deadline = None if req.ttft_slo is None else req.arrival + req.ttft_slo
        seq = SimSequence(r, req.prompt_len, req.prompt_len, req.output_len, inst.manager.block_size, now,
                          req.priority, deadline, req.tpot_slo)  # fmt: skip
        inst.scheduler.add(seq)
        timeline = self.timelines[r]
        timeline.prefill_queued = now
        timeline.prefill_instance = inst.name
        if inst is not prefill:
            timeline.decode_instance, timeline.local_prefill = inst.name, True

    @staticmethod
    def roomy(pool: list[_E], req: SimRequest) -> list[_E]:
        """The instances of ``pool`` with room for the request in their KV (all, when none has)."""
        capacity = pool[0].manager.num_blocks * pool[0].manager.block_size
        return [e for e in pool if e.load_tokens + req.prompt_len + req.output_len <= capacity] or pool

    def local_decode(self, req: SimRequest, prefill: _Engine) -> _Decode | None:
        """The decode instance that prefills ``req`` itself by the router's rule (``Router.pick_local_prefill``;
        prompts share no prefix here), or None: ``prefill`` does."""
        if self.local_prefill.mode == "off" or not self.decodes:
            return None
        decode = min(self.roomy(self.decodes, req), key=attrgetter("load_tokens"))
        queued = prefill.prefill_tokens + req.prompt_len
        return decode if prefill_locally(self.local_prefill, req.prompt_len, decode.prefill_tokens, queued) else None

    def iterate(self, now: float, inst: _Engine) -> None:
        """One turn of the instance's step loop, if it is not in a batch: tick, then schedule."""
        if inst.busy:
            return
        if isinstance(inst, _Decode):
            self.admit(now, inst)
        if not inst.may_schedule():
            return
        preemptions = inst.scheduler.num_preemptions
        batch = inst.scheduler.schedule()
        if inst.scheduler.num_preemptions != preemptions:  # they left the running batch
            for seq in [seq for seq in inst.decoding if seq.status is SequenceStatus.WAITING]:
                self.leave(inst, seq)
        if not batch.seqs:
            return
        seqs, latency = batch.seqs, inst.latency
        chunks = None
        if not batch.is_prefill:
            computed = None
            duration = latency.step_time(len(seqs), sum(map(_num_tokens, seqs)))
        elif batch.num_new_tokens is None:  # a prefill batch of whole prompts (their uncached tokens)
            computed = chunks = [seq.num_tokens - seq.num_computed_tokens for seq in seqs]
            duration = latency.batch_time(computed)
        else:  # decode tokens, then prompt chunks
            computed, num_decode = batch.num_new_tokens, batch.num_decode
            chunks = computed[num_decode:]
            context = sum(map(_num_tokens, seqs[:num_decode]))
            duration = latency.step_time(num_decode, context) if num_decode else 0
            duration += latency.batch_time(chunks)
        inst.busy = True
        factor = self.contention_factor(now, inst, inst.contention if chunks is None else inst.prefill_contention)
        if factor != 1:  # (exact latencies, such as the tests' fractions, stay exact without contention)
            duration *= factor
        # The instance's turn ends a step gap after the batch: its outputs are processed, then it schedules.
        end = now + duration
        self.push(_later(end, self.delays.step_gap), _STEP_DONE, inst.index, _Step(batch, computed, [now], [end]))

    def contention_factor(self, now: float, inst: _Engine, contention: Contention) -> float:
        """What else runs as ``inst`` starts a batch (``inst.busy`` is already set, so it is not counted)."""
        if inst.pulls_until > now:
            return contention.during_pull
        if any(other.busy for other in self.instances if other is not inst):
            return contention.beside_batch
        return contention.alone

    def admit(self, now: float, inst: _Decode) -> None:
        scheduler, manager = inst.scheduler, inst.manager
        while inst.pending:
            seq, prefill = inst.pending[0]
            if scheduler.num_running + inst.pulling >= scheduler.running.max_num_seqs or not manager.can_allocate(seq):
                return
            inst.pending.popleft()
            manager.allocate(seq)
            seq.num_computed_tokens = seq.num_tokens - 1  # what the pull brings
            inst.pulling += 1
            timeline = self.timelines[seq.index]
            timeline.decode_admitted = now
            timeline.migration_start = start = max(now, inst.puller_free)
            inst.puller_free = end = start + self.transfer_time(self.reqs[seq.index].prompt_len)
            inst.pulls_until = prefill.pulls_until = end  # pulls run in admission order: the latest ends last
            self.push(end, _PULLED, inst.index, (seq, prefill))

    def stretch(self, inst: _Engine, step: _Step) -> bool:
        """Draw a decode step that ends now out into the steady stretch it starts (``decode_stretch``);
        whether it was (its end is then the stretch's, the step to come back at)."""
        if step.computed is not None or step.stretched or self.delays.step_gap:
            return False
        scheduler, seqs = inst.scheduler, step.batch.seqs
        if inst.contention != NO_CONTENTION or len(scheduler.waiting) or scheduler.num_running != len(seqs):
            return False
        if isinstance(inst, _Decode) and inst.pending:
            return False
        # Steps to the first finish: a sequence of n tokens at the first step has n + j after step j.
        max_steps = min(seq.final_num_tokens - seq.num_tokens for seq in seqs)
        if max_steps < 2:
            return False
        until = self.heap[0][0] if self.heap else float("inf")
        latency = inst.latency
        ends = step_ends(latency.step_time, latency.step_times, len(seqs), sum(map(_num_tokens, seqs)),
                         step.ends[0], max_steps, until)  # fmt: skip
        steps = steps_with_free_blocks(seqs, inst.manager.block_size, inst.manager.num_free_blocks, len(ends))
        if steps < 2:
            return False
        grow_blocks(inst.manager, seqs, steps)
        step.ends = ends[:steps]
        step.starts += step.ends[:-1]
        self.push(step.ends[-1], _STEP_DONE, inst.index, step)
        return True

    def step_done(self, inst: _Engine, step: _Step) -> None:
        inst.busy = False
        self.dirty.add(inst.index)
        batch, computed = step.batch, step.computed
        seqs, size = batch.seqs, len(batch.seqs)
        tokens = size if computed is None else sum(computed)  # the batch's, each step
        if inst.step_model is not None:  # the engine's own record of its steps
            for start, end in zip(step.starts, step.ends):
                inst.step_model.observe(tokens, end - start)
        delivered = [_later(end, self.delays.delivery) for end in step.ends]  # when the orchestrator has the token
        num_steps = len(delivered)
        decode_steps = [(s, e, size) for s, e in zip(step.starts, step.ends)]
        if computed is None or batch.num_new_tokens is not None:  # every decoding sequence is in it
            inst.logged_steps += decode_steps
            inst.logged_tokens += delivered
        decoding = inst.decoding
        # This loop runs once per sequence per batch (a stretch: per stretch), the simulation's hottest.
        for i, seq in enumerate(seqs):
            if computed is not None and seq.num_computed_tokens + computed[i] < seq.num_tokens:
                seq.num_computed_tokens += computed[i]  # a chunk short of the prompt's end samples nothing
                timeline = self.timelines[seq.index]
                if timeline.prefill_start is None:
                    timeline.prefill_start = step.starts[0]
                continue
            seq.num_tokens += num_steps
            seq.num_computed_tokens = seq.num_tokens - 1
            if seq.num_tokens < seq.final_num_tokens and seq in decoding:
                continue  # it decodes on, its tokens in the logs
            joins = seq not in decoding
            if joins:  # its first token, or its first since a recompute or a pull: onto its own timeline
                self.record(inst, seq, step, delivered, decode_steps, tokens)
            if seq.num_tokens >= seq.final_num_tokens:
                self.finish(inst, seq, delivered[-1])
            elif isinstance(inst, _Prefill):
                self.hold(inst, seq, delivered[0])
            else:
                decoding[seq] = len(inst.logged_tokens)

    def record(self, inst: _Engine, seq: SimSequence, step: _Step, delivered: list[float],
               decode_steps: list[tuple[float, float, int]], tokens: int) -> None:  # fmt: skip
        """The tokens ``seq`` took in ``step`` onto its timeline."""
        timeline = self.timelines[seq.index]
        if step.computed is not None and timeline.prefill_start is None:
            timeline.prefill_start = step.starts[0]
        timeline.token_times += delivered
        if timeline.prefill_end is None:  # its first token (a prompt's last may run as a decode token)
            inst.prefill_tokens -= seq.num_prompt_tokens
            timeline.prefill_end = step.ends[0]
            timeline.prefill_batch_size, timeline.prefill_batch_tokens = len(step.batch.seqs), tokens
            timeline.steps += decode_steps[1:]
        else:
            timeline.steps += decode_steps

    def leave(self, inst: _Engine, seq: SimSequence) -> None:
        """``seq`` decodes no more on ``inst`` (for now): the logged steps it took part in onto its timeline."""
        start = inst.decoding.pop(seq, None)
        if start is not None:
            timeline = self.timelines[seq.index]
            timeline.steps += inst.logged_steps[start:]
            timeline.token_times += inst.logged_tokens[start:]

    def finish(self, inst: _Engine, seq: SimSequence, now: float) -> None:
        self.leave(inst, seq)
        inst.scheduler.finish(seq)
        timeline = self.timelines[seq.index]
        timeline.finish = now
        timeline.num_preemptions = seq.num_preemptions
        for e in self.assigned[seq.index]:
            e.load_tokens -= seq.final_num_tokens

    def hold(self, inst: _Prefill, seq: SimSequence, now: float) -> None:
        """Keep a prefilled request's KV for decode, and hand the request over."""
        inst.held[seq.index] = seq
        inst.held_blocks += len(seq.block_table)
        self.timelines[seq.index].handover = now
        handover = (seq.index, inst, seq.num_tokens)
        if self.delays.delivery or self.delays.dispatch:  # the orchestrator relays it to a decode instance
            self.push(_later(now, self.delays.dispatch), _HANDOVER, 0, handover)
        else:
            self.hand_over(now, *handover)

    def hand_over(self, now: float, r: int, prefill: _Prefill, num_tokens: int) -> None:
        decode = self.route(self.decodes, r)
        req = self.reqs[r]
        seq = SimSequence(r, num_tokens, req.prompt_len, req.output_len, decode.manager.block_size, now,
                          req.priority, None, req.tpot_slo)  # fmt: skip
        decode.pending.append((seq, prefill))
        self.timelines[r].decode_instance = decode.name

    def pulled(self, now: float, inst: _Decode, seq: SimSequence, prefill: _Prefill) -> None:
        held = prefill.held.pop(seq.index)
        prefill.held_blocks -= len(held.block_table)
        prefill.manager.free(held)
        self.dirty.add(prefill.index)
        inst.pulling -= 1
        inst.scheduler.running.add(seq)
        self.timelines[seq.index].migration_end = now
        self.dirty.add(inst.index)


def _check_fits(requests: Sequence[SimRequest], managers: list[BlockManager]) -> None:
    """The orchestrator's ``InputProcessor`` check against the smallest instance: a request that may grow
    past its KV is refused (here the whole run is, as the request could never be admitted)."""
    smallest = min(managers, key=lambda m: m.num_blocks * m.block_size)
    for r in requests:
        if r.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {r.output_len}")
        if smallest.blocks_needed(r.prompt_len + r.output_len) > smallest.num_blocks:
            raise ValueError(f"request of {r.prompt_len + r.output_len} tokens exceeds the smallest instance's "
                             f"{smallest.num_blocks} blocks of {smallest.block_size} tokens")  # fmt: skip


def simulate_blocks(
    requests: Sequence[SimRequest],
    prefill: PrefillInstanceSpec,
    decode: DecodeInstanceSpec,
    transfer_time: Callable[[int], float],
    delays: ServingDelays = NO_DELAYS,
    local_prefill: LocalPrefillConfig = NO_LOCAL_PREFILL,
) -> list[SimResult]:
    """Disaggregated deployment in block mode, with per-request disaggregation by ``local_prefill``;
    results (with timelines) in request order."""
    if prefill.block_size is None or decode.block_size is None:
        raise ValueError("block mode needs block_size on both the prefill and the decode spec")
    if prefill.stage_time is not None or decode.stage_time is not None:
        raise ValueError("block mode follows the engine, which keeps one batch in flight: stage_time must be None")
    if prefill.count < 1 or decode.count < 1:
        raise ValueError("need at least one prefill and one decode instance")
    clock = _Clock()
    prefill_config = SchedulerConfig(
        policy=prefill.policy,
        max_num_batched_tokens=prefill.max_batch_tokens,
        max_num_seqs=prefill.max_batch_size,
        kv_hold_fraction=prefill.kv_hold_fraction,
    )
    # No prompt is seen twice on a prefill instance, so its prefix cache would never hit; a decode
    # instance has none (``DecodeRole.prefix_caching``).
    prefills = [_Prefill(f"prefill-{i}", prefill_config, BlockManager(prefill.kv_capacity_tokens // prefill.block_size,
                                                                     prefill.block_size, False), prefill, clock)
                for i in range(prefill.count)]  # fmt: skip
    decode_config = SchedulerConfig(max_num_batched_tokens=decode.max_batch_tokens, max_num_seqs=decode.max_batch_size,
                                    enable_chunked_prefill=decode.chunked_prefill)  # fmt: skip
    latency = _Latency(decode.batch_time or prefill.batch_time, decode.step_time, decode.step_times)
    decodes = [_Decode(f"decode-{i}", decode_config,
                       BlockManager(decode.kv_capacity_tokens // decode.block_size, decode.block_size, False),
                       latency, decode.contention, clock)
               for i in range(decode.count)]  # fmt: skip
    _check_fits(requests, [e.manager for e in (*prefills, *decodes)])
    return _EngineSim(requests, prefills, decodes, transfer_time, delays, clock, local_prefill).run()


def simulate_colocated(
    requests: Sequence[SimRequest], spec: ColocatedInstanceSpec, delays: ServingDelays = NO_DELAYS
) -> list[SimResult]:
    """Colocated instances (``PREFILL_FIRST`` or ``CHUNKED`` steps); results (with timelines) in
    request order."""
    if spec.count < 1:
        raise ValueError("need at least one colocated instance")
    clock = _Clock()
    config = SchedulerConfig(policy=spec.policy, max_num_batched_tokens=spec.max_batch_tokens,
                             max_num_seqs=spec.max_batch_size, enable_chunked_prefill=spec.chunked_prefill,
                             tpot_aware_chunking=spec.tpot_aware_chunking)  # fmt: skip
    latency = _Latency(spec.batch_time, spec.step_time, spec.step_times)
    instances = [_Engine(f"colocated-{i}", config, BlockManager(spec.num_blocks, spec.block_size, spec.prefix_caching),
                         latency, spec.contention, spec.prefill_contention, clock)
                 for i in range(spec.count)]  # fmt: skip
    _check_fits(requests, [e.manager for e in instances])
    return _EngineSim(requests, instances, [], lambda tokens: 0.0, delays, clock).run()
