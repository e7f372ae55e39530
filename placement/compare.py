"""Where a simulation and a real run part ways: the same requests' timelines, aligned request by
request and compared stage by stage.

Stages (seconds, per request): ``queue`` (arrival to its prefill batch), ``prefill`` (its batch),
``handover`` (first token to a decode instance allocating its blocks: the wait for room),
``pull`` (its KV transfer), ``decode gap`` (pull end, or prefill end colocated, to its first decode
step), ``step`` (mean duration of the steps it took part in), ``between steps`` (mean idle time
between them) and the request-level ``ttft`` and ``tpot``. For each: p50 and p90 of both sides and
the median of the per-request differences (simulated minus real), so a stage the model gets wrong
shows up as a large difference there even when the totals agree by luck.

Steps are also compared one by one: a real step's (batch size, total context) rebuilt from the
requests in it, its real duration against what the latency model predicts for that shape. The
ratio tells whether the model's step times hold under load (contention, per-step overheads).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from distserve.core.latency import attainment as latency_attainment
from distserve.core.local_prefill import LocalPrefillConfig
from distserve.core.timeline import RequestTimeline
from placement.engine_sim import simulate_blocks, simulate_colocated
from placement.sim_specs import (
    ColocatedInstanceSpec,
    Contention,
    DecodeInstanceSpec,
    PrefillInstanceSpec,
    ServingDelays,
    SimRequest,
)


def _diff(a: float | None, b: float | None) -> float | None:
    return b - a if a is not None and b is not None else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _decode_begins(t: RequestTimeline) -> float | None:
    return t.migration_end if t.migration_end is not None else t.prefill_end


STAGES: dict[str, Callable[[RequestTimeline], float | None]] = {
    "queue": lambda t: _diff(t.arrival, t.prefill_start),
    "prefill": lambda t: _diff(t.prefill_start, t.prefill_end),
    "handover": lambda t: _diff(t.token_times[0] if t.token_times else None, t.decode_admitted),
    "pull": lambda t: _diff(t.migration_start, t.migration_end),
    "decode gap": lambda t: _diff(_decode_begins(t), t.steps[0][0] if t.steps else None),
    "step": lambda t: _mean([end - start for start, end, _ in t.steps]),
    "between steps": lambda t: _mean([b[0] - a[1] for a, b in zip(t.steps, t.steps[1:])]),
    "ttft": lambda t: t.ttft,
    "tpot": lambda t: t.tpot if len(t.token_times) > 1 else None,
}


@dataclass
class StageComparison:
    stage: str
    count: int  # requests with the stage on both sides
    real_p50: float
    real_p90: float
    sim_p50: float
    sim_p90: float
    median_difference: float  # simulated minus real, per request

    @property
    def p50_error(self) -> float:
        """Relative error of the simulated p50 (0.1 = 10% off)."""
        return abs(self.sim_p50 - self.real_p50) / self.real_p50 if self.real_p50 else 0.0

    @property
    def p90_error(self) -> float:
        return abs(self.sim_p90 - self.real_p90) / self.real_p90 if self.real_p90 else 0.0


Pair = tuple[RequestTimeline, RequestTimeline]


def align(real: Sequence[RequestTimeline], sim: Sequence[RequestTimeline]) -> list[Pair]:
    """Pairs of the same request: by id, which must name the same lengths on both sides."""
    by_id = {t.request_id: t for t in sim}
    pairs = []
    for t in real:
        other = by_id.get(t.request_id)
        if other is None:
            raise ValueError(f"request {t.request_id} is not in the simulation")
        if (t.prompt_len, t.output_len) != (other.prompt_len, other.output_len):
            raise ValueError(f"request {t.request_id}: lengths differ between the run and the simulation")
        pairs.append((t, other))
    return pairs


def compare_stages(real: Sequence[RequestTimeline], sim: Sequence[RequestTimeline]) -> list[StageComparison]:
    """Each stage that both sides have, over the requests that completed in the run."""
    pairs = [(r, s) for r, s in align(real, sim) if r.error is None]
    rows = []
    for stage, measure in STAGES.items():
        values = [(measure(r), measure(s)) for r, s in pairs]
        values = [(a, b) for a, b in values if a is not None and b is not None]
        if not values:
            continue
        a, b = np.array(values).T
        rows.append(StageComparison(
            stage, len(values), float(np.percentile(a, 50)), float(np.percentile(a, 90)),
            float(np.percentile(b, 50)), float(np.percentile(b, 90)), float(np.median(b - a)),
        ))  # fmt: skip
    return rows


@dataclass
class StepComparison:
    """The real run's steps against the latency model: duration over predicted, by batch size."""

    count: int
    median_ratio: float  # real duration / predicted, over all steps
    by_batch: dict[int, tuple[int, float]]  # batch size -> (steps, median ratio)


@dataclass(frozen=True)
class RealStep:
    instance: str
    start: float
    end: float
    batch_size: int
    context: int  # tokens of all its sequences as it began


def real_steps(timelines: Sequence[RequestTimeline]) -> list[RealStep]:
    """Each distinct step of a run, its context rebuilt from the requests that took part (prompt plus
    tokens so far). Steps whose members are not all in the run's timelines are left out."""
    contexts: dict[tuple[str, float, float, int], list[int]] = defaultdict(list)
    for t in timelines:
        instance = t.decode_instance or t.prefill_instance or ""
        for k, (start, end, batch) in enumerate(t.steps):
            contexts[(instance, start, end, batch)].append(t.prompt_len + 1 + k)
    return [RealStep(*key, sum(c)) for key, c in sorted(contexts.items()) if len(c) == key[3]]


def compare_steps(real: Sequence[RequestTimeline], step_time: Callable[[int, int], float]) -> StepComparison:
    ratios: dict[int, list[float]] = defaultdict(list)
    for step in real_steps(real):
        ratios[step.batch_size].append((step.end - step.start) / step_time(step.batch_size, step.context))
    every = [r for values in ratios.values() for r in values]
    return StepComparison(
        len(every),
        float(np.median(every)) if every else float("nan"),
        {batch: (len(values), float(np.median(values))) for batch, values in sorted(ratios.items())},
    )


class _Spans:
    """Time spans (possibly overlapping) that answer "does one cover this instant?" in O(log n)."""

    def __init__(self, spans: Iterable[tuple[float, float]]) -> None:
        ordered = sorted(spans)
        self.starts = [a for a, _ in ordered]
        self.reach = list(itertools.accumulate((b for _, b in ordered), max))  # latest end so far

    def cover(self, time: float) -> bool:
        i = bisect.bisect_right(self.starts, time) - 1
        return i >= 0 and self.reach[i] > time


StepTime = Callable[[int, int], float]
BatchTime = Callable[[list[int]], float]
LABELS = {"alone": "alone", "beside_batch": "during another instance's batch", "during_pull": "during a KV pull"}


Run = Sequence[RequestTimeline]


def slowdowns(real: Run, batch_time: BatchTime, step_time: StepTime) -> dict[tuple[str, str], list[float]]:
    """Real over predicted duration of a run's prefill batches ("prefill") and steps after the first
    token ("step"), by what else ran as each began (as the simulator's ``Contention`` decides): a KV
    pull into or out of its instance ("during_pull"), a batch of another instance ("beside_batch",
    which shares the machine's cores and memory on CPU), or nothing ("alone"). Tells whether a
    profile taken alone holds under load."""
    prefills: dict[tuple[str, float, float], list[int]] = defaultdict(list)
    busy: dict[str, set[tuple[float, float]]] = defaultdict(set)
    pulls: dict[str, set[tuple[float, float]]] = defaultdict(set)
    for t in real:
        if t.prefill_start is not None:
            prefills[(t.prefill_instance or "", t.prefill_start, t.prefill_end)].append(t.prompt_len)
            busy[t.prefill_instance or ""].add((t.prefill_start, t.prefill_end))
        if t.migration_start is not None:
            for instance in (t.decode_instance or "", t.prefill_instance or ""):
                pulls[instance].add((t.migration_start, t.migration_end))
    steps = real_steps(real)
    for step in steps:
        busy[step.instance].add((step.start, step.end))
    batches = [("prefill", *key, batch_time(lengths)) for key, lengths in prefills.items()]
    batches += [("step", s.instance, s.start, s.end, step_time(s.batch_size, s.context)) for s in steps]
    pulling = {name: _Spans(spans) for name, spans in pulls.items()}
    batching = {name: _Spans(spans) for name, spans in busy.items()}
    ratios: dict[tuple[str, str], list[float]] = defaultdict(list)
    for kind, instance, start, end, predicted in batches:
        if end <= start:
            continue
        if instance in pulling and pulling[instance].cover(start):
            label = "during_pull"
        elif any(spans.cover(start) for name, spans in batching.items() if name != instance):
            label = "beside_batch"
        else:
            label = "alone"
        ratios[(kind, label)].append((end - start) / predicted)
    return ratios


def step_slowdown(real: Sequence[RequestTimeline], step_time: StepTime) -> dict[str, tuple[int, float]]:
    """Median real/predicted duration of a run's steps after the first token, by what ran beside them."""
    ratios = slowdowns(real, lambda lengths: 1.0, step_time)
    steps = {label: v for (kind, label), v in sorted(ratios.items()) if kind == "step"}
    return {LABELS[label]: (len(v), float(np.median(v))) for label, v in steps.items()}


MIN_SAMPLES = 10  # fewer batches than this in a situation say too little: it takes the next one's factor


def _typical_mean(values: Sequence[float]) -> float:
    """The mean without the slowest 1%: a mean, because a request's TPOT adds its steps' times up,
    but not one that a stray pause of the machine can move."""
    values = np.sort(np.asarray(values, dtype=float))
    return float(values[: max(1, int(np.ceil(len(values) * 0.99)))].mean())


def fit_contention(real: Run, batch_time: BatchTime, step_time: StepTime) -> dict[str, Contention]:
    """The ``Contention`` of prefill batches and of steps that a loaded run shows: the mean slowdown
    in each situation (``_typical_mean``). A situation with too few batches takes the factor of the next more common one
    (a pull, then another instance's batch, then alone), and 1.0 when the run has none at all."""
    ratios = slowdowns(real, batch_time, step_time)
    fitted = {}
    for kind in ("prefill", "step"):
        factors, fallback = {}, 1.0
        for label in ("alone", "beside_batch", "during_pull"):
            values = ratios.get((kind, label), [])
            factors[label] = fallback = _typical_mean(values) if len(values) >= MIN_SAMPLES else fallback
        fitted[kind] = Contention(**factors)
    return fitted


def fit_delays(real: Run) -> ServingDelays:
    """What a run's serving path adds around the batches: medians of a request's call to its first
    instance, of a sampled token's way to the orchestrator, and of an instance's turn between batches.
    The call is timed on requests that found their instance idle: one that arrives mid-batch is taken
    in after the batch, a wait the simulator makes by itself."""
    batches: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in real:
        if t.prefill_start is not None:
            batches[t.prefill_instance or ""].append((t.prefill_start, t.prefill_end))
        batches[t.decode_instance or t.prefill_instance or ""].extend((start, end) for start, end, _ in t.steps)
    busy = {name: _Spans(spans) for name, spans in batches.items()}
    dispatch = [
        t.prefill_queued - t.arrival
        for t in real
        if t.prefill_queued is not None and not busy.get(t.prefill_instance or "", _Spans(())).cover(t.arrival)
    ]
    delivery = [t.token_times[0] - t.prefill_end for t in real if t.prefill_end is not None and t.token_times]
    delivery += [time - end for t in real for (_, end, _), time in zip(t.steps, t.token_times[1:])]
    gaps = [b[0] - a[1] for t in real for a, b in zip(t.steps, t.steps[1:])]
    median = lambda values: max(0.0, float(np.median(values))) if values else 0.0  # noqa: E731
    return ServingDelays(median(dispatch), median(delivery), median(gaps))


def fit_transfer(real: Run) -> tuple[float, float]:
    """(fixed seconds, seconds per prompt token) of a run's KV pulls: the line through the medians of
    the shorter and the longer half of the prompts, so a few pulls that waited on a busy core do not
    tilt it; both terms >= 0."""
    pulls = sorted((t.prompt_len, t.migration_end - t.migration_start) for t in real if t.migration_start is not None)
    if not pulls:
        return 0.0, 0.0
    half = len(pulls) // 2
    if half == 0 or pulls[0][0] == pulls[-1][0]:
        return float(np.median([s for _, s in pulls])), 0.0
    (x0, y0), (x1, y1) = (np.median(np.array(part, dtype=float), axis=0) for part in (pulls[:half], pulls[half:]))
    per_token = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
    fixed = max(0.0, y0 - per_token * x0)
    return float(fixed), float(per_token)


def attainment(timelines: Sequence[RequestTimeline], ttft_slo: float, tpot_slo: float) -> float:
    """Share of requests meeting both SLOs; a failed request meets neither."""
    latencies = ((t.ttft, t.tpot) if t.error is None else (None, None) for t in timelines)
    return latency_attainment(latencies, ttft_slo, tpot_slo).both


def format_stages(rows: Sequence[StageComparison]) -> str:
    lines = [f"{'stage':<14} {'n':>5} {'real p50':>10} {'sim p50':>10} {'real p90':>10} {'sim p90':>10} "
             f"{'sim-real':>10}  (ms)"]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r.stage:<14} {r.count:>5} {r.real_p50 * 1e3:>10.2f} {r.sim_p50 * 1e3:>10.2f} {r.real_p90 * 1e3:>10.2f} "
            f"{r.sim_p90 * 1e3:>10.2f} {r.median_difference * 1e3:>+10.2f}"
        )
    return "\n".join(lines)


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class RunSetup:
    """The engine settings of the deployment a run was made on, as the simulator needs them."""

    prefill_instances: int = _setting(1, "prefill instances")
    decode_instances: int = _setting(1, "decode instances")
    colocated_instances: int = _setting(0, "colocated instances; more than 0 means a colocated deployment")
    num_kv_blocks: int = _setting(1024, "KV blocks per instance")
    block_size: int = _setting(16, "tokens per KV block")
    max_num_batched_tokens: int = _setting(4096, "prefill token budget (with chunked prefill: every step's)")
    enable_chunked_prefill: bool = _setting(False, "chunked prefill (colocated, and the prompts decode ran)")
    max_num_seqs: int = _setting(256, "most requests an instance runs at once")
    kv_hold_fraction: float = _setting(0.5, "share of a prefill pool that KV held for decode may fill")
    transfer_fixed: float = _setting(0.0, "seconds per KV pull, whatever its size")
    transfer_per_token: float = _setting(0.0, "seconds per prompt token pulled")
    local_prefill: str = _setting("off", "per-request disaggregation the run had: off, on or auto")
    local_prefill_max_tokens: int = _setting(LocalPrefillConfig.max_tokens, "its max_tokens")


def simulate_like(
    run: Sequence[RequestTimeline],
    setup: RunSetup,
    batch_time: BatchTime,
    step_time: StepTime,
    contention: dict[str, Contention] | None = None,
    delays: ServingDelays | None = None,
) -> list[RequestTimeline]:
    """The simulated timelines of a run's requests: same ids, lengths and arrivals; ``contention``
    (``fit_contention``) stretches prefill batches and steps and ``delays`` (``fit_delays``) adds the
    serving path's time, as measured."""
    delays = delays or ServingDelays()
    requests = [SimRequest(t.arrival, t.prompt_len, t.output_len, t.request_id) for t in run]
    d = setup
    contention = contention or {}
    prefill_contention, step_contention = contention.get("prefill", Contention()), contention.get("step", Contention())
    kv_tokens = d.num_kv_blocks * d.block_size
    if d.colocated_instances:
        spec = ColocatedInstanceSpec(d.colocated_instances, batch_time, step_time, d.max_num_batched_tokens,
                                     d.max_num_seqs, d.block_size, d.num_kv_blocks,
                                     contention=step_contention, prefill_contention=prefill_contention,
                                     chunked_prefill=d.enable_chunked_prefill)  # fmt: skip
        results = simulate_colocated(requests, spec, delays)
    else:
        prefill = PrefillInstanceSpec(d.prefill_instances, batch_time, None, d.max_num_batched_tokens, kv_tokens,
                                      d.block_size, d.max_num_seqs, d.kv_hold_fraction,
                                      contention=prefill_contention)  # fmt: skip
        decode = DecodeInstanceSpec(d.decode_instances, step_time, None, d.max_num_seqs, kv_tokens, d.block_size,
                                    d.max_num_batched_tokens, contention=step_contention,
                                    chunked_prefill=d.enable_chunked_prefill)  # fmt: skip
        transfer = lambda n: d.transfer_fixed + d.transfer_per_token * n  # noqa: E731
        local_prefill = LocalPrefillConfig(d.local_prefill, d.local_prefill_max_tokens)
        results = simulate_blocks(requests, prefill, decode, transfer, delays, local_prefill)
    return [r.timeline for r in results]
