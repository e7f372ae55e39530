"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distserve.core.errors import RequestError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` or ``top_k == 1`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable
    those filters. A ``seed`` makes the request's samples reproducible whatever it is batched with.
    """

    max_tokens: int = field(default=16, metadata={"help": "most tokens to generate"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; 0 is greedy"})
    top_k: int = field(default=0, metadata={"help": "sample from the k likeliest tokens; 0 disables it"})
    top_p: float = field(
        default=1.0, metadata={"help": "sample from the smallest set of this probability; 1 disables it"}
    )
    seed: int | None = field(default=None, metadata={"help": "seed of this request's samples"})
    stop: list[str] = field(
        default_factory=list, metadata={"help": "stop at this string (repeat the flag for several)"}
    )
    stop_token_ids: list[int] = field(
        default_factory=list, metadata={"help": "stop at this token id (repeat the flag for several)"}
    )
    ignore_eos: bool = field(default=False, metadata={"help": "keep generating past the end-of-sequence token"})
    include_stop_str_in_output: bool = field(
        default=False, metadata={"help": "keep the stop string that ended the text in it"}
    )
    skip_special_tokens: bool = field(default=True, metadata={"help": "leave special tokens out of the text"})

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def stop_text_holdback(self) -> int:
        """Characters of output text held back while a request runs: they may begin a stop string,
        which is cut from the text with everything after it once complete."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
