"""The hand-over record: what a decode instance needs to take a prefilled request over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distserve.core.beams import BeamState
from distserve.core.sampling_params import SamplingParams


@dataclass
class HandedSample:
    """One of a request's samples as it crosses: which, its tokens so far, how much text was sent."""

    index: int
    output_token_ids: list[int]
    num_text_sent: int


@dataclass
class Handover:
    """Emitted by a prefill instance with a request's first token, while it holds the prompt's KV;
    or by an instance leaving decode, for a request it was decoding.

    The decode instance admits the request when it can allocate blocks for it, pulls the first
    ``num_kv_tokens`` tokens' KV from ``block_table`` on ``prefill_instance`` into them, and only
    then decodes it (and its sibling samples); the source instance frees its blocks when the pull
    is done.
    """

    request_id: str
    attempt: int  # which run of the request this is (a re-run after a failure counts up)
    prefill_instance: str  # the Ray actor name of the instance holding the KV (the source)
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what the request has generated: the first token, after prefill
    sampling_params: SamplingParams
    priority: int
    block_table: list[int]  # the request's blocks on the source instance
    block_size: int  # the source instance's (a decode pool may use another)
    num_kv_tokens: int  # tokens whose KV the blocks hold: all but the newest
    num_text_sent: int  # characters of output text the client has had
    tpot_slo: float | None = None  # seconds per output token it must average; None: no SLO
    # A request of n samples crosses once: the sample above (``sample_index``) carries the prompt's
    # KV, and its unfinished siblings, which share that KV, come with it and are forked from it
    # once it has arrived.
    sample_index: int = 0
    siblings: list[HandedSample] = field(default_factory=list)
    # How the decode instance reaches the KV: the source's ranks and holder (kv_transfer's KVSource).
    kv_source: Any = None
    # A beam search crosses the same way, after its first step: the carrier and the siblings are
    # its beams, best first, and this is the rest of where the search stands.
    beams: BeamState | None = None

    @property
    def carrier(self) -> HandedSample:
        return HandedSample(self.sample_index, self.output_token_ids, self.num_text_sent)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
