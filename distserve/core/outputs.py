"""What a request produces: per-step deltas inside the system, whole outputs for callers.

An engine emits one ``RequestDelta`` per request per step: the new tokens and text only, so a
message stays the same size however long the request grows. Whoever hands results to a caller
(the offline ``LLM``, the orchestrator) adds the deltas up into ``RequestOutput``s with an
``OutputBuilder``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from distserve.core.errors import RequestFault
from distserve.core.handover import Handover
from distserve.core.latency import time_per_output_token


@dataclass
class RequestMetrics:
    """A request's timeline: wall-clock times (``time.time()``) of its stages, None where it has not
    got there (or never goes: a colocated request has no hand-over), and the batches it ran in.
    Cheap enough to keep for every request: a step adds one shared tuple to each of its requests."""

    arrival_time: float | None = None  # the orchestrator accepted it
    prefill_queued: float | None = None  # its prefill (or colocated) instance queued it
    prefill_start: float | None = None  # its prefill batch began
    prefill_end: float | None = None  # its first token was sampled
    prefill_batch_size: int | None = None  # requests in that batch
    prefill_batch_tokens: int | None = None  # tokens the batch computed
    handover_time: float | None = None  # the orchestrator gave it to a decode instance
    decode_admitted: float | None = None  # the decode instance allocated its blocks (its pull may start)
    migration_start: float | None = None  # the decode instance began pulling its KV
    migration_end: float | None = None
    # (start, end, batch size) of every step after its prefill that gave it a token, on the
    # instance that decoded it (a recompute after preemption is one of them).
    steps: list[tuple[float, float, int]] = field(default_factory=list)
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)  # each output token reached the orchestrator
    finished_time: float | None = None
    prefill_instance: str | None = None
    decode_instance: str | None = None
    local_prefill: bool = False  # prefilled by the decode instance that decoded it (``cluster.local_prefill``)

    @property
    def ttft(self) -> float | None:
        if self.arrival_time is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """``time_per_output_token`` of the request's tokens: 0.0 for one, None for none."""
        return time_per_output_token(self.token_times)


@dataclass
class TokenLogprobs:
    """Logprobs at one position: of the token there (sampled, or the prompt's), its rank in the
    distribution (1: the likeliest), and the ``top`` likeliest tokens', likeliest first. Values are
    log-softmax of the model's logits, before penalties, biases, bans and temperature."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestOutput:
    """A request's output so far, as a caller sees it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far
    new_token_ids: list[int]  # tokens added since the previous output
    new_text: str  # text added since the previous output
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" (cancelled) or "error" (could not go on) once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # With SamplingParams.logprobs: one per output token so far, and those of new_token_ids.
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    index: int = 0  # which of the request's n samples (SamplingParams.n) this output is
    error: str | None = None  # with finish_reason "error": what failed in its step, naming the request
    # Beam search (SamplingParams.beam_width), once finished: the hypothesis' summed token logprobs,
    # and its score, that over its length to the length_penalty (transformers' sequences_scores).
    cumulative_logprob: float | None = None
    beam_score: float | None = None

    @property
    def num_output_tokens(self) -> int:
        """``len(output_token_ids)``, without reading them (``StreamedOutput`` builds them when read)."""
        return len(self.output_token_ids)


# The RequestMetrics fields an engine stamps; a delta carries them as a tuple, which pickles in
# about half the time of a dataclass.
STAGE_FIELDS = (
    "prefill_queued", "prefill_start", "prefill_end", "prefill_batch_size", "prefill_batch_tokens",
    "decode_admitted", "migration_start", "migration_end",
)  # fmt: skip


@dataclass
class RequestDelta:
    """What one step adds to one run of a request, as an engine emits it."""

    request_id: str
    attempt: int  # the run it belongs to: deltas of an abandoned run are told apart by it
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    handover: Handover | None = None  # from a prefill instance, with the first token: for the decode side
    stage_times: tuple[float | int | None, ...] = (None,) * len(STAGE_FIELDS)
    # The final delta only: the steps that gave the run its tokens after prefill, and its preemptions.
    steps: list[tuple[float, float, int]] | None = None
    num_preemptions: int = 0
    first: bool = False  # the token sampled at its prompt's end: a caller waits for it most
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asks
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when the request asks
    index: int = 0  # the sample it belongs to (``finished``: that sample's end)
    samples_left: int = 0  # final deltas: the run's other samples still going on the instance that sent it
    # With finish_reason "error": the request's own step failed (it ends, not re-run); None: the run
    # could not go on there for the instance's or a transfer's fault (it runs again elsewhere).
    fault: RequestFault | None = None
    cumulative_logprob: float | None = None  # a beam search's hypothesis, with its final delta
    beam_score: float | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        """The stream it belongs to: run and sample."""
        return self.request_id, self.attempt, self.index

    def joins(self, later: RequestDelta) -> bool:
        """Whether ``later`` can be added to this delta as one: the same run's, both plain steps of
        it (no hand-over), this one not its end, nor ``later`` a failure that gives the run up."""
        return (
            later.key == self.key
            and not self.finished
            and self.handover is None
            and later.handover is None
            and later.finish_reason not in ("error", "requeue")
        )

    def join(self, later: RequestDelta) -> RequestDelta:
        """This delta and ``later`` as one: both steps' tokens and text, ``later``'s state."""
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            first=self.first or later.first,
            logprobs=None if self.logprobs is None else self.logprobs + (later.logprobs or []),
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


def coalesce(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """Each sample's consecutive plain deltas joined into one, in the order of their first: fewer
    messages to route and stream. Deltas of different samples are independent of each other's order."""
    joined: list[RequestDelta] = []
    latest: dict[tuple[str, int, int], int] = {}  # sample -> index of its latest delta in ``joined``
    for delta in deltas:
        i = latest.get(delta.key)
        if i is not None and joined[i].joins(delta):
            joined[i] = joined[i].join(delta)
        else:
            latest[delta.key] = len(joined)
            joined.append(delta)
    return joined


class OutputBuilder:
    """Adds up one sample's deltas, in one run, into the ``RequestOutput``s a caller sees. Its lists
    only grow, so each output reads its whole-so-far fields from them, cut at its own length, when
    first asked (``StreamedOutput``): a delta costs its own size, however long the output has grown."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        metrics: RequestMetrics | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.finished = False
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.text_pieces: list[str] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.metrics = metrics or RequestMetrics()  # shared with the caller, who may stamp more times
        self.num_cached_tokens = 0
        self.cumulative_logprob: float | None = None
        self.beam_score: float | None = None

    def add(self, delta: RequestDelta) -> RequestOutput:
        """The output so far, ``delta`` included; its metrics are a snapshot of the request's."""
        if not self.output_token_ids and delta.new_token_ids:
            # The prompt's hits where it was prefilled: a decode instance's deltas, and a recompute's,
            # count those of later allocations.
            self.num_cached_tokens = delta.num_cached_tokens
        self.output_token_ids += delta.new_token_ids
        if delta.new_text:
            self.text_pieces.append(delta.new_text)
        self.finished = delta.finished
        for name, value in zip(STAGE_FIELDS, delta.stage_times):
            if value is not None:
                setattr(self.metrics, name, value)
        if delta.steps is not None:
            self.metrics.steps = delta.steps
            self.metrics.num_preemptions = delta.num_preemptions
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.beam_score is not None:
            self.cumulative_logprob, self.beam_score = delta.cumulative_logprob, delta.beam_score
        return StreamedOutput.of(self, delta)


class StreamedOutput(RequestOutput):
    """A ``RequestOutput`` as an ``OutputBuilder`` makes it. Its new_* fields are the delta's own; its
    whole-so-far fields (``output_token_ids``, ``text``, ``logprobs``, ``metrics``) are copied from
    the builder's lists, cut at this output's length, when first read, and kept. A streaming
    consumer reading only the new fields and ``num_output_tokens`` never pays for the rest. A copy
    (``dataclasses.replace``) has every field read."""

    @classmethod
    def of(cls, builder: OutputBuilder, delta: RequestDelta) -> StreamedOutput:
        output = cls.__new__(cls)  # not the dataclass's __init__: the whole-so-far fields stay unread
        output._builder = builder
        output._num_pieces = len(builder.text_pieces)
        output._num_logprobs = None if builder.logprobs is None else len(builder.logprobs)
        output._num_token_times = len(builder.metrics.token_times)
        output.num_output_tokens = len(builder.output_token_ids)
        output.request_id = builder.request_id
        output.prompt = builder.prompt
        output.prompt_token_ids = builder.prompt_token_ids
        output.new_token_ids = delta.new_token_ids
        output.new_text = delta.new_text
        output.finished = delta.finished
        output.finish_reason = delta.finish_reason
        output.num_cached_tokens = builder.num_cached_tokens
        output.new_logprobs = delta.logprobs
        output.prompt_logprobs = builder.prompt_logprobs
        output.index = builder.index
        output.error = None if delta.fault is None else str(delta.fault)
        output.cumulative_logprob, output.beam_score = builder.cumulative_logprob, builder.beam_score
        return output

    @cached_property
    def num_output_tokens(self) -> int:  # set by ``of``
        return len(self.output_token_ids)

    @cached_property
    def output_token_ids(self) -> list[int]:
        return self._builder.output_token_ids[: self.num_output_tokens]

    @cached_property
    def text(self) -> str:
        return "".join(self._builder.text_pieces[: self._num_pieces])

    @cached_property
    def logprobs(self) -> list[TokenLogprobs] | None:
        logprobs = self._builder.logprobs
        return None if self._num_logprobs is None else logprobs[: self._num_logprobs]

    @cached_property
    def metrics(self) -> RequestMetrics:
        """The request's metrics when first read, its token times as of this output."""
        metrics = self._builder.metrics
        return replace(metrics, token_times=metrics.token_times[: self._num_token_times])
