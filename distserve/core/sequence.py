"""A request's state as it moves through the scheduler, the KV cache and the sampler."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time

from distserve.core.handover import HandedSample, Handover
from distserve.core.outputs import RequestMetrics, TokenLogprobs
from distserve.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a run stands on its instance."""

    WAITING = "waiting"  # queued: for prefill (or a recompute), or for blocks to pull its KV into
    RUNNING = "running"  # scheduled: its blocks hold its KV, and a step runs it
    HELD = "held"  # its KV held for a decode instance to pull (``KVHold``)
    PULLING = "pulling"  # its blocks allocated, its KV arriving by a pull (``DecodeAdmission``)
    SWAPPED = "swapped"  # preempted, its KV in the host pool until blocks are free (``SwapSpace``)
    FINISHED = "finished"


class Sequence:
    """One request: prompt plus generated tokens, its block table and its text so far.

    ``all_token_ids`` holds prompt and output together (the KV cache does not distinguish them);
    ``num_computed_tokens`` counts the tokens whose KV is in the cache.
    """

    _ids = itertools.count()

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        attempt: int = 0,
        ttft_deadline: float | None = None,
        tpot_slo: float | None = None,
    ) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.attempt = attempt  # which run of the request (re-runs after a failure count up)
        # Which of the request's ``n`` samples this is: sample 0 runs the prompt, the others are
        # forked from it at its end (``fork``), sharing its KV blocks.
        self.sample_index = 0
        self.request_params = sampling_params  # the request's, of which this sample's are derived
        # A beam of a beam search: its request's live beams, one list that they all share (the
        # scheduler preempts them together); None for any other request.
        self.beams: list[Sequence] | None = None
        self.prompt = prompt
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Wall-clock time by which its first token is due (arrival at the cluster plus its TTFT
        # SLO), None: no SLO; the ``deadline`` policy orders prompts by it.
        self.ttft_deadline = ttft_deadline
        # Seconds per output token after the first it must average, None: no SLO; a colocated step
        # that decodes it is cut to fit it (``tpot_aware_chunking``).
        self.tpot_slo = tpot_slo
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of full blocks, grown lazily
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits of the latest allocation
        self.prefill_steps_waited = 0  # prefill steps it waited for, under the SJF policy (its aging)
        self.num_preemptions = 0
        self.metrics = RequestMetrics()
        # Logprobs of the prompt's tokens after the first, as its prefill chunks compute them
        # (SamplingParams.prompt_logprobs); sent with the first output token.
        self.prompt_logprobs: list[TokenLogprobs] = []
        # Where its output stands in its structured outputs' grammar (an engine's GrammarMatcher),
        # rebuilt from the output tokens wherever it runs; None when unconstrained.
        self.grammar = None
        # Incremental detokenization state.
        self.output_text = ""
        self.num_text_sent = 0  # characters of output_text already in deltas
        self.prefix_offset = 0
        self.read_offset = 0

    @classmethod
    def from_handover(cls, handover: Handover, sample: HandedSample | None = None) -> Sequence:
        """A handed-over request as the decode side runs it: prompt, the tokens generated so far and
        how much of their text was sent; of the sample that carries the KV, or of ``sample``."""
        sample = sample or handover.carrier
        seq = cls(
            handover.prompt_token_ids,
            handover.sampling_params.sample_params(sample.index),
            handover.request_id,
            handover.prompt,
            handover.priority,
            attempt=handover.attempt,
            tpot_slo=handover.tpot_slo,
        )
        seq.sample_index, seq.request_params = sample.index, handover.sampling_params
        seq.all_token_ids += sample.output_token_ids
        seq.num_text_sent = sample.num_text_sent
        return seq

    def fork(self, index: int) -> Sequence:
        """Sample (or beam) ``index`` of this request, with this one's tokens so far (a sample's:
        its prompt) and timeline, no block yet (``BlockManager.fork`` shares them)."""
        params = self.request_params.sample_params(index)
        child = Sequence(self.prompt_token_ids, params, self.request_id, self.prompt, self.priority,
                         self.arrival_time, self.attempt, self.ttft_deadline, self.tpot_slo)  # fmt: skip
        child.all_token_ids = list(self.all_token_ids)
        child.sample_index, child.request_params, child.beams = index, self.request_params, self.beams
        child.status = self.status
        child.num_cached_tokens = self.num_cached_tokens
        child.metrics = dataclasses.replace(self.metrics, steps=[], token_times=[])
        return child

    def __len__(self) -> int:
        return len(self.all_token_ids)

    def __repr__(self) -> str:
        return f"Sequence(id={self.request_id}, tokens={len(self)}, status={self.status.value})"

    @property
    def num_samples(self) -> int:
        return self.request_params.n

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return (len(self.all_token_ids) + block_size - 1) // block_size

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.all_token_ids[index * block_size : (index + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
