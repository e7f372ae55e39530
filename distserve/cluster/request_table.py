"""The requests the orchestrator has, one state machine each, from admission to the client's last
token. Its fields change only through the methods below; the orchestrator calls them as outputs
and failures come in.

A request's life::

    admitted -> prefilling (routed to a prefill or colocated instance; ``routed``)
        -> prefilled (its first token came; ``first_token``)
        -> handed over (given to a decode instance that pulls its KV; ``handed_to``)
        -> decoding (tokens stream from the decode instance)
        -> finished (every sample's end came; ``finish``)

Off that path: ``cancel`` (the client left: aborted wherever it is), a re-run (an instance it needed
failed, or a role change gave it back: ``begin_rerun`` aborts the run, ``new_attempt`` starts the
next from its prompt, at most ``max_request_attempts`` failed runs), and a move (``move_to``: a
queued prompt given back to even out the queues goes to that instance). Each run is numbered
(``attempt``) so that outputs of an abandoned run still in flight are told apart. Colocated, one
instance prefills and decodes: no hand-over; so does a decode instance that prefills a request
itself (``local_prefill``).

A request counts towards the load of the instances it is routed to, from routing until it is
done with them (``unassign``), and its prompt towards its prefill instance's queued prompt
tokens until its first token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from distserve.cluster.output_queue import OutputQueue
from distserve.cluster.routing import InstanceState
from distserve.core.outputs import OutputBuilder, RequestMetrics, RequestOutput
from distserve.core.sampling_params import SamplingParams
from distserve.core.slo import RequestSLO


@dataclass
class SampleStream:
    """One sample of a request, as the client gets it: the current run's output, and how far the
    client has got, which a re-run (repeating the tokens, as sampling is seeded) does not repeat."""

    run: OutputBuilder | None = None
    delivered_tokens: int = 0
    delivered_text: int = 0  # characters
    delivered_end: bool = False

    def unseen(self, output: RequestOutput) -> RequestOutput | None:
        """``output`` with only what the client does not have yet; None when that is nothing. The
        client usually has exactly what came before it: then it is ``output`` as it is, and its
        whole-so-far fields are not read."""
        num_tokens = output.num_output_tokens
        if self.delivered_end or (num_tokens <= self.delivered_tokens and not output.finished):
            return None
        if num_tokens - len(output.new_token_ids) == self.delivered_tokens:
            # Its tokens follow the client's, and so does its text: the same tokens have the same text.
            self.delivered_text += len(output.new_text)
        else:  # a re-run's output overlapping what the client has from an earlier run
            output = dataclasses.replace(
                output,
                new_token_ids=output.output_token_ids[self.delivered_tokens :],
                new_text=output.text[self.delivered_text :],
                new_logprobs=None if output.logprobs is None else output.logprobs[self.delivered_tokens :],
            )
            self.delivered_text = max(self.delivered_text, len(output.text))
        self.delivered_tokens = max(self.delivered_tokens, num_tokens)
        self.delivered_end = output.finished
        return output


@dataclass
class RequestState:
    request_id: str  # its own, unique among the requests in the cluster: what instances know it by
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    slo: RequestSLO = RequestSLO()
    queue: OutputQueue = field(default_factory=OutputQueue)
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
    client_id: str | None = None  # the id the client named it by, which its outputs carry (default: request_id)

    def __post_init__(self) -> None:
        self.client_id = self.client_id or self.request_id
        self.samples = [SampleStream() for _ in range(self.params.n)]
        self.new_attempt(0)

    @property
    def load(self) -> int:
        """Tokens it may occupy on an instance: the prompt, which its samples (beams) share, and the
        most each of its samples (each beam of a beam search) may generate."""
        return len(self.prompt_token_ids) + (self.params.beam_width or self.params.n) * self.params.max_tokens

    def instances(self) -> list[InstanceState]:
        """Where its current run may have blocks."""
        found = [s for s in (self.prefill, self.decode, self.source) if s is not None]
        return [s for i, s in enumerate(found) if s not in found[:i]]

    @property
    def has_output(self) -> bool:
        """Whether the current run has given any sample a token."""
        return any(sample.run.output_token_ids for sample in self.samples)

    @property
    def delivered(self) -> bool:
        """Whether the client has every sample's end."""
        return all(sample.delivered_end for sample in self.samples)

    # Transitions ------------------------------------------------------------------------------

    def routed(self, entry: InstanceState, to_prefill: int, local: bool = False) -> None:
        """Its run goes to ``entry`` for prefill, which counts on computing ``to_prefill`` of its tokens;
        ``local``: ``entry`` is the decode instance that decodes it too (per-request disaggregation)."""
        self._assign(entry, "prefill")
        self.metrics.local_prefill = local
        if local:
            self.metrics.decode_instance = entry.name
        self.to_prefill = to_prefill
        entry.prefill_tokens += to_prefill
        self.move_to = None

    def first_token(self) -> None:
        """Prefilled where it was: a plan to move its prompt is void."""
        self.move_to = None
        self._prefilled()

    def handed_on(self, source: InstanceState) -> None:
        """``source`` holds its KV for the next decode instance; a decode instance it was on is left."""
        if self.decode is not None:
            self.decode.load_tokens -= self.load
            self.decode = None
        self.source = source

    def handed_to(self, entry: InstanceState, now: float) -> None:
        self._assign(entry, "decode")
        self.metrics.handover_time = now

    def moving_to(self, target: InstanceState) -> None:
        self.move_to = target

    def unassign(self) -> None:
        """The request no longer counts towards its instances' load."""
        self._prefilled()
        for entry in (self.prefill, self.decode):
            if entry is not None:
                entry.load_tokens -= self.load
        self.prefill = self.decode = self.source = None

    def cancel(self) -> None:
        self.cancelled = True

    def finish(self, now: float) -> None:
        """Its last sample's end came."""
        self.finished = True
        self.metrics.finished_time = now

    def begin_rerun(self, failed: bool) -> None:
        """Its current run is being abandoned (``failed``: by a failure, not given back)."""
        self.rerunning = True
        self.failed_runs += failed
        self.unassign()

    def end_rerun(self) -> None:
        self.rerunning = False

    def new_attempt(self, attempt: int | None = None) -> None:
        """Start run ``attempt`` (the next by default): its samples' outputs start again."""
        self.attempt = self.attempt + 1 if attempt is None else attempt
        for index, sample in enumerate(self.samples):
            sample.run = OutputBuilder(self.client_id, self.prompt, self.prompt_token_ids, self.metrics, index)

    def _assign(self, entry: InstanceState, phase: str) -> None:
        setattr(self, phase, entry)
        setattr(self.metrics, f"{phase}_instance", entry.name)
        entry.load_tokens += self.load

    def _prefilled(self) -> None:
        """Its prompt is no longer work its prefill instance has before it."""
        if self.prefill is not None:
            self.prefill.prefill_tokens -= self.to_prefill
        self.to_prefill = 0


class RequestTable(dict[str, RequestState]):
    """The requests in the cluster, by their own ids (``RequestState.request_id``), in order of arrival."""

    def forget(self, state: RequestState) -> None:
        """The request is over: it no longer counts anywhere."""
        state.unassign()
        if self.get(state.request_id) is state:
            del self[state.request_id]
