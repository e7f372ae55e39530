"""The hand-over record: what a decode instance needs to take a prefilled request over."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.sampling_params import SamplingParams


@dataclass
class Handover:
    """Emitted by a prefill instance with a request's first token, while it holds the prompt's KV.

    The decode instance admits the request when it can allocate blocks for it, pulls the KV from
    ``block_table`` on ``prefill_instance`` into them, and only then decodes it; the prefill
    instance frees its blocks when the pull is done.
    """

    request_id: str
    attempt: int  # which run of the request this is (a re-run after a failure counts up)
    prefill_instance: str  # the Ray actor name of the instance holding the KV
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what prefill sampled: the first token
    sampling_params: SamplingParams
    priority: int
    block_table: list[int]  # the prompt's blocks on the prefill instance
    block_size: int  # the prefill instance's (a decode pool may use another)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
