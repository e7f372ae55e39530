"""What the simulators take (requests, instance specs) and give (per-request results).

Latencies come in as plain callables, so an analytic roofline or a model fitted from profiles plugs
in unchanged. A disaggregated spec runs in one of two modes:

* token mode (``block_size`` None): KV counted in tokens, a decode request reserved whole up front;
  the fast model of ``simulator`` that the placement search runs.
* block mode (``block_size`` set): the engine's rules, block by block (``engine_sim``); KV is
  ``kv_capacity_tokens // block_size`` blocks, as the engine sizes its cache in whole blocks.

The block-mode fields default to the engine's ``SchedulerConfig`` defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from distserve.core.timeline import RequestTimeline

# ``step_time`` of several decode steps at once: (batch size, the first step's total context, steps)
# -> each step's time, a step's context ``batch size`` tokens more than the step before's. Given the
# same floats ``step_time`` gives one by one, it lets block mode pass a steady stretch of decode
# steps at once (``RooflineModel.decode_times``, ``FittedLatency.decode_times``).
StepTimes = Callable[[int, int, int], np.ndarray]


@dataclass(frozen=True)
class Contention:
    """How much longer than its profiled time a batch takes, by what else runs as it starts. Where
    instances share a machine's cores (CPU serving), they and the serving path take turns on them;
    a KV pull is work on the receiving instance's own cores. Measured from a loaded run's timelines
    (``placement.compare.fit_contention``); 1.0 everywhere when each instance has its own device."""

    alone: float = 1.0
    beside_batch: float = 1.0  # another instance is in a batch
    during_pull: float = 1.0  # a KV pull into (decode) or out of (prefill) this instance is under way


@dataclass(frozen=True)
class ServingDelays:
    """Time the serving path adds around an engine's batches (block mode), measured from a run's
    timelines (``placement.compare.fit_delays``); zero by default."""

    dispatch: float = 0.0  # the orchestrator's call: a request (or hand-over) reaches an instance's queue
    delivery: float = 0.0  # a sampled token reaches the orchestrator (instance outputs, the long poll)
    step_gap: float = 0.0  # an instance's turn between two batches (output processing, scheduling)


@dataclass
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    request_id: str | None = None  # its timeline's id; its index in the request list when None
    # Block mode: what the engine's scheduling policies read of a request (``Sequence``'s fields).
    priority: int = 0
    ttft_slo: float | None = None  # its TTFT deadline is its arrival plus this
    tpot_slo: float | None = None

    def new_timeline(self, index: int) -> RequestTimeline:
        """An empty timeline of this request, ``index``-th of its list."""
        request_id = str(index) if self.request_id is None else self.request_id
        return RequestTimeline(request_id, self.prompt_len, self.output_len, self.arrival)


@dataclass
class PrefillInstanceSpec:
    count: int
    batch_time: Callable[[list[int]], float]
    stage_time: Callable[[list[int]], float] | None
    max_batch_tokens: int
    kv_capacity_tokens: int
    block_size: int | None = None
    max_batch_size: int = 256  # block mode: max_num_seqs, which caps a prefill batch too
    kv_hold_fraction: float = 0.5  # block mode: no prompt is scheduled while held KV passes this share
    contention: Contention = Contention()  # block mode
    policy: str = "fcfs"  # block mode: the order prompts are taken in (``SchedulerConfig.policy``)


@dataclass
class DecodeInstanceSpec:
    count: int
    step_time: Callable[[int, int], float]
    stage_time: Callable[[int, int], float] | None
    max_batch_size: int
    kv_capacity_tokens: int
    block_size: int | None = None
    # Block mode: token budget of the prefill batches that recompute preempted requests (and prefill
    # local prompts, ``local_prefill``), or of a step's chunks with ``chunked_prefill``.
    max_batch_tokens: int = 4096
    # Block mode: latency of those batches; None takes the prefill instances' (same model, same parallelism).
    batch_time: Callable[[list[int]], float] | None = None
    contention: Contention = Contention()  # block mode
    step_times: StepTimes | None = None  # block mode: step_time over a steady stretch, when known
    chunked_prefill: bool = False  # block mode: the prompts it runs go in chunks beside its decode tokens


@dataclass
class ColocatedInstanceSpec:
    """Instances running both phases (the engine's scheduler in ``PREFILL_FIRST`` or ``CHUNKED``
    mode), always in block mode."""

    count: int
    batch_time: Callable[[list[int]], float]
    step_time: Callable[[int, int], float]
    max_batch_tokens: int
    max_batch_size: int
    block_size: int
    num_blocks: int
    prefix_caching: bool = True  # the engine's default: a recompute finds its blocks while they stay cached
    # ``StepMode.CHUNKED``: each step runs the decoding sequences' tokens, then prompt chunks up to
    # max_batch_tokens; it takes step_time of the decode part plus batch_time of the chunks.
    chunked_prefill: bool = False
    contention: Contention = Contention()  # of its decode steps
    prefill_contention: Contention | None = None  # of its prefill batches; None: the steps'
    policy: str = "fcfs"  # the order prompts are taken in (``SchedulerConfig.policy``)
    tpot_aware_chunking: bool = False  # ``SchedulerConfig.tpot_aware_chunking``, with chunked_prefill
    step_times: StepTimes | None = None  # step_time over a steady stretch, when known


@dataclass
class SimResult:
    ttft: float
    tpot: float
    finish: float
    token_times: list[float]
    timeline: RequestTimeline | None = None
