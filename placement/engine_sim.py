"""Block mode: a discrete-event simulation that makes, for every request, the choices the real
engine makes, and records its whole ``RequestTimeline``.

Each rule is the engine's (module or function in ``distserve/`` in brackets):

* Routing (``cluster/routing.py`` ``Router``): a prompt goes to the instance of the entry pool
  with room for it in its KV cache (any, when none has) that has the fewest prompt tokens to
  prefill, counted from its routing to the end of its prefill (``Orchestrator._prefilled``); ties to
  the least loaded. A hand-over goes to the decode instance with the least load. Load is
  ``prompt_len + output_len`` (its ``max_tokens``) on every instance a request was sent to until it
  finishes (``cluster/orchestrator.py`` ``Orchestrator._assign`` / ``unassign``); ties go to the
  lowest index. Prompts are taken to share no prefix, so no prefix cache shortens a prefill's
  count. All instances of a pool have the same KV size, so load per KV token orders them as load
  does.
* Step loop (``cluster/instance.py`` ``Instance._run``): an instance runs one batch at a time (pipeline
  stages take turns, so ``stage_time`` has no place here); between batches it ticks its role, then
  schedules. Whatever reaches it during a batch waits for the batch's end.
* Scheduling (``placement.kv_blocks``, mirroring ``scheduling/``): FCFS prefill batches under the
  token budget, sequence slots and free blocks; decode steps grow sequences a block at a time and
  preempt the most recently admitted ones for recompute when no block is free.
* Prefill instances (``engine/prefill_role.py`` ``PrefillRole``, ``KVHold``): ``PrefillOnlyScheduler``
  batches (at most ``max_num_seqs``); a prefilled request keeps its blocks until its KV is pulled,
  and no prompt is scheduled while held blocks reach ``kv_hold_fraction`` of the pool. A request
  with one output token finishes there and frees its blocks at once.
* Decode instances (``engine/decode_role.py`` ``DecodeAdmission.admit``): hand-overs are admitted in
  arrival order while ``running + pulling < max_num_seqs`` and blocks for the prompt and the first
  token (``Sequence.from_handover``) can be allocated; no prefix cache. The ``Migrator``
  (``kv_transfer/migrator.py``) pulls one request at a time, in admission order, taking
  ``transfer_time(prompt_len)``; at the pull's end the prefill instance frees the KV and the request
  joins the running batch. Preempted requests are recomputed there by ``PrefillFirstScheduler``.
* Colocated instances (``engine/role.py`` ``ColocatedRole``): ``PrefillFirstScheduler`` over new and
  preempted requests, with the prefix cache; or ``ChunkedPrefillScheduler`` (``chunked_prefill``),
  whose step of decode tokens and prompt chunks takes ``step_time`` of its decode part plus
  ``batch_time`` of its chunks (the two fits' constant terms both count: an approximation), and
  whose chunks short of a prompt's end sample nothing.
* Latency: a prefill batch takes ``batch_time(tokens computed per sequence)``, a decode step
  ``step_time(batch size, sum of the sequences' tokens)``; a batch's tokens are sampled at its end.

Not modeled: the time between steps (scheduling, RPCs, detokenization: a step starts when the last
one ends, a hand-over reaches decode when its prefill ends), the first pull's channel setup, the
``sjf`` and ``priority`` policies, prompts sharing prefixes, EOS and stop strings (a request makes
exactly ``output_len`` tokens), the context limit, ``kv_hold_timeout`` and failures (no re-runs).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeVar

from placement.kv_blocks import BatchScheduler, BlockPool, ChunkedBatchScheduler, SimSeq
from placement.sim_specs import (
    ColocatedInstanceSpec,
    Contention,
    DecodeInstanceSpec,
    PrefillInstanceSpec,
    ServingDelays,
    SimRequest,
    SimResult,
)

_ARRIVAL, _STEP_DONE, _PULLED, _HANDOVER = range(4)


NO_DELAYS = ServingDelays()


def _later(time: float, delay: float) -> float:
    """``time + delay``, leaving exact times (the tests' fractions) exact when there is no delay."""
    return time + delay if delay else time


class _Engine:
    """One instance's engine as the simulation drives it; the base runs ``PrefillFirstScheduler``."""

    def __init__(
        self,
        name: str,
        scheduler: BatchScheduler,
        batch_time: Callable[[list[int]], float],
        step_time: Callable[[int, int], float] | None,
        contention: Contention,
        prefill_contention: Contention | None = None,
    ) -> None:
        self.name = name
        self.contention = contention  # of the batches it runs; of its decode steps when the next is given
        self.prefill_contention = prefill_contention or contention
        self.pulls_until = 0.0  # a KV pull into or out of this instance runs until then
        self.index = 0  # in the simulation's list of instances
        self.scheduler = scheduler
        self.pool = scheduler.pool
        self.batch_time = batch_time
        self.step_time = step_time  # None: never decodes (prefill instances)
        self.busy = False
        self.load_tokens = 0  # the router's load
        self.prefill_tokens = 0  # prompt tokens routed here and not yet prefilled

    def next_batch(self) -> tuple[list[SimSeq], list[int] | None, list[SimSeq]]:
        return self.scheduler.schedule()

    def finish(self, seq: SimSeq) -> None:
        self.scheduler.finish(seq)


class _Prefill(_Engine):
    def __init__(self, name: str, scheduler: BatchScheduler, spec: PrefillInstanceSpec) -> None:
        super().__init__(name, scheduler, spec.batch_time, None, spec.contention)
        self.held: dict[int, SimSeq] = {}
        self.held_blocks = 0
        self.hold_limit = max(1, int(spec.kv_hold_fraction * self.pool.num_blocks))

    def next_batch(self) -> tuple[list[SimSeq], list[int] | None, list[SimSeq]]:
        if self.held_blocks >= self.hold_limit:
            return [], None, []
        batch, computed = self.scheduler.schedule_prefill(self.scheduler.max_num_seqs)
        return batch, computed, []

    def finish(self, seq: SimSeq) -> None:
        self.pool.release(seq)  # ``PrefillOnlyScheduler`` keeps no running batch, only the blocks


class _Decode(_Engine):
    def __init__(
        self,
        name: str,
        scheduler: BatchScheduler,
        batch_time: Callable[[list[int]], float],
        step_time: Callable[[int, int], float],
        contention: Contention,
    ) -> None:
        super().__init__(name, scheduler, batch_time, step_time, contention)
        self.pending: deque[tuple[SimSeq, _Prefill]] = deque()  # hand-overs, with where their KV is held
        self.pulling = 0
        self.puller_free = 0.0  # when the migrator's thread is done with the pulls it was given


@dataclass
class _Step:
    start: float
    batch: list[SimSeq]
    computed: list[int] | None  # tokens each sequence computes in a prefill batch; None for a decode step


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
    ) -> None:
        self.reqs = requests
        self.delays = delays
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
            if kind == _ARRIVAL:
                self.arrive(now, payload)
            elif kind == _STEP_DONE:
                self.step_done(now, self.instances[inst], payload)
            elif kind == _HANDOVER:
                self.hand_over(*payload)
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
        capacity = self.entry[0].pool.num_blocks * self.entry[0].pool.block_size
        roomy = [e for e in self.entry if e.load_tokens + req.prompt_len + req.output_len <= capacity] or self.entry
        inst = self.assign(min(roomy, key=lambda e: (e.prefill_tokens + req.prompt_len, e.load_tokens)), r)
        inst.prefill_tokens += req.prompt_len
        inst.scheduler.waiting.append(SimSeq(r, self.reqs[r].prompt_len))
        self.timelines[r].prefill_queued = now
        self.timelines[r].prefill_instance = inst.name

    def iterate(self, now: float, inst: _Engine) -> None:
        """One turn of the instance's step loop, if it is not in a batch: tick, then schedule."""
        if inst.busy:
            return
        if isinstance(inst, _Decode):
            self.admit(now, inst)
        batch, computed, preempted = inst.next_batch()
        for seq in preempted:
            self.timelines[seq.request].num_preemptions += 1
        if not batch:
            return
        chunks = computed
        if computed is None:
            duration = inst.step_time(len(batch), sum(map(_num_tokens, batch)))
        elif isinstance(inst.scheduler, ChunkedBatchScheduler):
            num_decode = len(batch) - len(inst.scheduler.chunks)  # packed first, as the engine does
            chunks = computed[num_decode:] or None
            context = sum(map(_num_tokens, batch[:num_decode]))
            duration = inst.step_time(num_decode, context) if num_decode else 0
            duration += inst.batch_time(chunks) if chunks else 0
        else:
            duration = inst.batch_time(computed)
        inst.busy = True
        factor = self.contention_factor(now, inst, inst.contention if chunks is None else inst.prefill_contention)
        if factor != 1:  # (exact latencies, such as the tests' fractions, stay exact without contention)
            duration *= factor
        # The instance's turn ends a step gap after the batch: its outputs are processed, then it schedules.
        self.push(_later(now + duration, self.delays.step_gap), _STEP_DONE, inst.index, _Step(now, batch, computed))

    def contention_factor(self, now: float, inst: _Engine, contention: Contention) -> float:
        """What else runs as ``inst`` starts a batch (``inst.busy`` is already set, so it is not counted)."""
        if inst.pulls_until > now:
            return contention.during_pull
        if any(other.busy for other in self.instances if other is not inst):
            return contention.beside_batch
        return contention.alone

    def admit(self, now: float, inst: _Decode) -> None:
        scheduler, pool = inst.scheduler, inst.pool
        while inst.pending:
            seq, prefill = inst.pending[0]
            if len(scheduler.running) + inst.pulling >= scheduler.max_num_seqs or not pool.can_allocate(seq):
                return
            inst.pending.popleft()
            pool.allocate(seq, [])
            inst.pulling += 1
            timeline = self.timelines[seq.request]
            timeline.decode_admitted = now
            timeline.migration_start = start = max(now, inst.puller_free)
            inst.puller_free = end = start + self.transfer_time(self.reqs[seq.request].prompt_len)
            inst.pulls_until = prefill.pulls_until = end  # pulls run in admission order: the latest ends last
            self.push(end, _PULLED, inst.index, (seq, prefill))

    def step_done(self, turn_end: float, inst: _Engine, step: _Step) -> None:
        inst.busy = False
        self.dirty.add(inst.index)
        size = len(step.batch)
        sampled = turn_end - self.delays.step_gap if self.delays.step_gap else turn_end
        delivered = _later(sampled, self.delays.delivery)  # when the orchestrator has the token
        # Hoisted out of the loop below, which runs once per sequence per step: the simulator's hottest.
        chunked = isinstance(inst.scheduler, ChunkedBatchScheduler)
        hands_over = isinstance(inst, _Prefill)
        computed, start = step.computed, step.start
        decode_step = (start, sampled, size)  # one tuple shared by every timeline this step decodes
        reqs, timelines = self.reqs, self.timelines
        for i, seq in enumerate(step.batch):
            r = seq.request
            req, timeline = reqs[r], timelines[r]
            if chunked:
                seq.num_computed += computed[i]
                if timeline.prefill_start is None:
                    timeline.prefill_start = start
                if seq.num_computed < seq.num_tokens:  # a chunk short of the prompt's end
                    continue
                seq.num_computed = seq.num_tokens
            seq.num_tokens += 1
            timeline.token_times.append(delivered)
            if computed is not None and timeline.prefill_end is None:
                inst.prefill_tokens -= req.prompt_len
                if timeline.prefill_start is None or not chunked:
                    timeline.prefill_start = start
                timeline.prefill_end = sampled
                timeline.prefill_batch_size, timeline.prefill_batch_tokens = size, sum(computed)
            else:
                timeline.steps.append(decode_step)
            if seq.num_tokens - req.prompt_len >= req.output_len:
                inst.finish(seq)
                timeline.finish = delivered
                for e in self.assigned[r]:
                    e.load_tokens -= req.prompt_len + req.output_len
            elif hands_over:
                inst.held[r] = seq
                inst.held_blocks += len(seq.blocks)
                timeline.handover = delivered
                handover = (r, inst, seq.num_tokens)
                if self.delays.delivery or self.delays.dispatch:  # the orchestrator relays it to a decode instance
                    self.push(_later(delivered, self.delays.dispatch), _HANDOVER, 0, handover)
                else:
                    self.hand_over(*handover)

    def hand_over(self, r: int, prefill: _Prefill, num_tokens: int) -> None:
        decode = self.route(self.decodes, r)
        decode.pending.append((SimSeq(r, num_tokens), prefill))
        self.timelines[r].decode_instance = decode.name

    def pulled(self, now: float, inst: _Decode, seq: SimSeq, prefill: _Prefill) -> None:
        held = prefill.held.pop(seq.request)
        prefill.held_blocks -= len(held.blocks)
        prefill.pool.release(held)
        self.dirty.add(prefill.index)
        inst.pulling -= 1
        inst.scheduler.running[seq.request] = seq
        self.timelines[seq.request].migration_end = now
        self.dirty.add(inst.index)


def _check_fits(requests: Sequence[SimRequest], pools: list[BlockPool]) -> None:
    """The orchestrator's ``InputProcessor`` check against the smallest instance: a request that may grow
    past its KV is refused (here the whole run is, as the request could never be admitted)."""
    smallest = min(pools, key=lambda p: p.num_blocks * p.block_size)
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
) -> list[SimResult]:
    """Disaggregated deployment in block mode; results (with timelines) in request order."""
    if prefill.block_size is None or decode.block_size is None:
        raise ValueError("block mode needs block_size on both the prefill and the decode spec")
    if prefill.stage_time is not None or decode.stage_time is not None:
        raise ValueError("block mode follows the engine, which keeps one batch in flight: stage_time must be None")
    if prefill.count < 1 or decode.count < 1:
        raise ValueError("need at least one prefill and one decode instance")
    prefills: list[_Engine] = []
    for i in range(prefill.count):
        # No prompt is seen twice on a prefill instance, so its prefix cache would never hit.
        pool = BlockPool(prefill.kv_capacity_tokens // prefill.block_size, prefill.block_size, False)
        scheduler = BatchScheduler(pool, prefill.max_batch_tokens, prefill.max_batch_size)
        prefills.append(_Prefill(f"prefill-{i}", scheduler, prefill))
    recompute_time = decode.batch_time or prefill.batch_time
    decodes = []
    for i in range(decode.count):
        pool = BlockPool(decode.kv_capacity_tokens // decode.block_size, decode.block_size, False)
        scheduler = BatchScheduler(pool, decode.max_batch_tokens, decode.max_batch_size)
        decodes.append(_Decode(f"decode-{i}", scheduler, recompute_time, decode.step_time, decode.contention))
    _check_fits(requests, [e.pool for e in (*prefills, *decodes)])
    return _EngineSim(requests, prefills, decodes, transfer_time, delays).run()


def simulate_colocated(
    requests: Sequence[SimRequest], spec: ColocatedInstanceSpec, delays: ServingDelays = NO_DELAYS
) -> list[SimResult]:
    """Colocated instances (``PrefillFirstScheduler``); results (with timelines) in request order."""
    if spec.count < 1:
        raise ValueError("need at least one colocated instance")
    instances: list[_Engine] = []
    for i in range(spec.count):
        pool = BlockPool(spec.num_blocks, spec.block_size, spec.prefix_caching)
        scheduler_class = ChunkedBatchScheduler if spec.chunked_prefill else BatchScheduler
        scheduler = scheduler_class(pool, spec.max_batch_tokens, spec.max_batch_size)
        instances.append(_Engine(f"colocated-{i}", scheduler, spec.batch_time, spec.step_time, spec.contention,
                                 spec.prefill_contention))  # fmt: skip
    _check_fits(requests, [e.pool for e in instances])
    return _EngineSim(requests, instances, [], lambda tokens: 0.0, delays).run()
