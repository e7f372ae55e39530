"""Which instance gets a request: prefill goes where the prompt's prefix is likely cached unless
that instance is much busier, decode goes to the instance with the most room. When instances that
take prompts are added (a role change), the prompts queued at the others are spread over them all.

Load is counted in tokens (prompt plus the most a request may generate) per KV token an
instance can hold, so instances of different sizes fill alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from distserve.cluster.instance import InstanceInfo
from distserve.cluster.prefix_index import PrefixIndex
from distserve.core.config import EngineConfig
from distserve.core.errors import InstanceFailure
from distserve.core.role import Role

# A prefix-cache hit wins over a less loaded instance unless its load (per KV token) is higher by more.
PREFIX_LOAD_SLACK = 0.25


@dataclass(eq=False)  # one per instance, told apart by identity
class InstanceState:
    """The orchestrator's view of one instance."""

    name: str
    role: Role
    handle: Any
    info: InstanceInfo
    config: EngineConfig  # what a replacement is started with
    load_tokens: int = 0  # tokens of the requests assigned to it and not yet done with it
    failure: str | None = None
    changing_to: Role | None = None  # a role change under way: it gets no new work meanwhile

    @property
    def load(self) -> float:
        return self.load_tokens / (self.info.num_blocks * self.info.block_size)


class Router:
    def __init__(self, block_size: int) -> None:
        self.prefix_index = PrefixIndex(block_size)

    def pick_prefill(
        self, pool: list[InstanceState], prompt_token_ids: list[int], chosen: InstanceState | None = None
    ) -> InstanceState:
        """``chosen`` when it is in ``pool``; else the instance of ``pool`` that was sent the longest
        prefix of this prompt, unless it is much busier than the least loaded one, which gets the
        request otherwise."""
        hashes = self.prefix_index.block_hashes(prompt_token_ids)
        if chosen in pool:
            entry = chosen
        else:
            least = self.least_loaded(pool)
            matched = {s.name: self.prefix_index.matched_blocks(s.name, hashes) for s in pool}
            best = max(pool, key=lambda s: (matched[s.name], -s.load))
            hit = matched[best.name] > 0
            entry = best if hit and best.load <= least.load + PREFIX_LOAD_SLACK else least
        self.prefix_index.add(entry.name, hashes)
        return entry

    def pick_decode(self, pool: list[InstanceState]) -> InstanceState:
        """The decode instance with the most room for a handed-over request."""
        return self.least_loaded(pool)

    @staticmethod
    def least_loaded(pool: list[InstanceState]) -> InstanceState:
        if not pool:
            raise InstanceFailure("no instance is available to serve the request")
        return min(pool, key=lambda s: s.load)


Entry = TypeVar("Entry")
Prompt = TypeVar("Prompt")


def spread_prompts(queues: dict[Entry, list[tuple[Prompt, int]]]) -> list[tuple[Prompt, Entry, Entry]]:
    """Which queued prompts to move, as (prompt, from, to), so that the instances' queues (each
    oldest first, with every prompt's token count) hold about as many tokens: the newest prompt of
    the longest queue goes to the shortest while that leaves both shorter than the longest was.
    The oldest stay, as they would be served first where they are."""
    tokens = {entry: sum(n for _, n in queue) for entry, queue in queues.items()}
    queues = {entry: list(queue) for entry, queue in queues.items()}
    moves = []
    while tokens:
        longest = max(tokens, key=tokens.__getitem__)
        shortest = min(tokens, key=tokens.__getitem__)
        if not queues[longest]:
            break
        prompt, n = queues[longest][-1]
        if tokens[shortest] + n >= tokens[longest]:
            break
        queues[longest].pop()
        tokens[longest] -= n
        tokens[shortest] += n
        moves.append((prompt, longest, shortest))
    return moves
