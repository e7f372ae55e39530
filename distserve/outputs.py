"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distserve.migration import PrefilledRequest


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far
    new_token_ids: list[int]  # tokens added by this step
    new_text: str  # text added by this step
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    prefilled: PrefilledRequest | None = None  # from a prefill instance: what decode needs to take over
