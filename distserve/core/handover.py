"""The hand-over record: what a decode instance needs to take a prefilled request over."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.sampling_params import SamplingParams


@dataclass
class Handover:
    """Emitted by a prefill instance with a request's first token, while it holds the prompt's KV;
    or by an instance leaving decode, for a request it was decoding.

    The decode instance admits the request when it can allocate blocks for it, pulls the first
    ``num_kv_tokens`` tokens' KV from ``block_table`` on ``prefill_instance`` into them, and only
    then decodes it; the source instance frees its blocks when the pull is done.
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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
