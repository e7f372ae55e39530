"""A request as the engine's scheduler sees it, with its tokens counted rather than held.

The scheduler and block manager read a ``Sequence``'s token count, and a full block's tokens only to
key it in the prefix cache. Here block ``i`` of request ``r`` holds the one "token" ``(r, i)``: no
two requests share a prefix, and a request's blocks match its own alone, so a recompute after a
preemption finds those still cached, as the engine's would. A prompt of thousands of tokens costs
nothing to make, and a decode step adds one to a count. The blocks' hashes, which a ``Sequence``
works out from their tokens as they fill, are their keys made one number, all known at once.
"""

from __future__ import annotations

from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence

_PARAMS = SamplingParams()
_BLOCK_INDEX_BITS = 32  # a block's hash: its request's index, then its own


class SimSequence(Sequence):
    num_tokens = 0  # a count here, in place of ``Sequence``'s length of its token list

    def __init__(
        self,
        index: int,
        num_tokens: int,
        prompt_len: int,
        output_len: int,
        block_size: int,
        arrival: float,
        priority: int = 0,
        ttft_deadline: float | None = None,
        tpot_slo: float | None = None,
    ) -> None:
        super().__init__([], _PARAMS, str(index), None, priority, arrival, 0, ttft_deadline, tpot_slo)
        self.index = index  # in the simulation's list of requests
        self.num_prompt_tokens = prompt_len
        self.num_tokens = num_tokens
        self.final_num_tokens = prompt_len + output_len  # it makes exactly ``output_len`` tokens
        first = index << _BLOCK_INDEX_BITS
        self.block_hashes = list(range(first, first + self.final_num_tokens // block_size))

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def num_blocks(self, block_size: int) -> int:
        return (self.num_tokens + block_size - 1) // block_size

    def block_tokens(self, index: int, block_size: int) -> list[tuple[int, int]]:
        return [(self.index, index)]

    def append_token(self, token_id: int) -> None:
        self.num_tokens += 1
