"""Which instance gets a request: a prompt goes where its first token comes soonest, the instance
with the fewest prompt tokens still to prefill, counting this prompt's own less the prefix cached
there or in the prefix tier (which every instance reads); decode goes to the instance with the
most room. With per-request disaggregation, a decode instance holding the prompt's prefix may
prefill it itself (``pick_local_prefill``). When instances that take prompts are added (a role
change), the prompts queued at the others are spread over them all.

Prefill work, not load, picks the prompt's instance: a colocated instance's load is mostly the
requests it decodes, which slow its next prefill little (their tokens ride in the same steps),
while every prompt queued ahead delays it by a whole prefill. Routed by load, a prompt could
wait behind another's prefill while the other instance had none to do.

Load is counted in tokens (the prompt plus the most each of a request's ``n`` samples may
generate) per KV token an instance can hold, so instances of different sizes fill alike; a prompt goes to an instance
without room for it only when none has room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from distserve.cluster.instance import InstanceInfo
from distserve.cluster.prefix_index import PrefixIndex
from distserve.core.config import EngineConfig
from distserve.core.errors import InstanceFailure
from distserve.core.local_prefill import LocalPrefillConfig, prefill_locally
from distserve.core.role import Role


@dataclass(eq=False)  # one per instance, told apart by identity
class InstanceState:
    """The orchestrator's view of one instance."""

    name: str
    role: Role
    handle: Any
    info: InstanceInfo
    config: EngineConfig  # what a replacement is started with
    load_tokens: int = 0  # tokens of the requests assigned to it and not yet done with it
    prefill_tokens: int = 0  # prompt tokens sent to it that it has still to compute (prefix hits left out)
    # The same of the requests the cluster's other API servers sent it, as it counted them lately.
    others_load_tokens: int = 0
    others_prefill_tokens: int = 0
    failure: str | None = None
    changing_to: Role | None = None  # a role change under way: it gets no new work meanwhile

    @property
    def capacity(self) -> int:
        """Tokens its KV cache holds."""
        return self.info.num_blocks * self.info.block_size

    @property
    def total_load_tokens(self) -> int:
        return self.load_tokens + self.others_load_tokens

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens it has still to compute, this server's requests' and the others'."""
        return self.prefill_tokens + self.others_prefill_tokens

    @property
    def load(self) -> float:
        return self.total_load_tokens / self.capacity


class Router:
    def __init__(self, block_size: int) -> None:
        self.prefix_index = PrefixIndex(block_size)
        # With a prefix tier, the prefixes sent anywhere lately, as many blocks as the tier holds: an
        # instance finds them there, at the cost of a copy, whatever it has in its own cache.
        self.tier_index: PrefixIndex | None = None

    def use_tier(self, capacity_blocks: int) -> None:
        self.tier_index = PrefixIndex(self.prefix_index.block_size, capacity_blocks)

    def _add(self, entry: InstanceState, hashes: list[int]) -> None:
        self.prefix_index.add(entry.name, hashes)
        if self.tier_index is not None:
            self.tier_index.add("", hashes)

    def pick_prefill(
        self,
        pool: list[InstanceState],
        prompt_token_ids: list[int],
        tokens: int,
        chosen: InstanceState | None = None,
        cache_salt: str | None = None,
    ) -> tuple[InstanceState, int]:
        """``chosen`` when it is in ``pool``; else, of the instances with room for the request's
        ``tokens`` (all, when none has), the one with the fewest prompt tokens to prefill once this
        prompt joins them (less the longest prefix of it sent there before under the same
        ``cache_salt``), the least loaded of those that tie. Returns the instance and the prompt
        tokens it is expected to compute."""
        hashes = self.prefix_index.block_hashes(prompt_token_ids, cache_salt)
        candidates = [chosen] if chosen in pool else _roomy(pool, tokens)
        to_prefill = self._to_compute(candidates, prompt_token_ids, hashes)
        entry = min(to_prefill, key=lambda s: (s.queued_prefill_tokens + to_prefill[s], s.load))
        self._add(entry, hashes)
        return entry, to_prefill[entry]

    def pick_local_prefill(
        self,
        config: LocalPrefillConfig,
        decodes: list[InstanceState],
        prefills: list[InstanceState],
        prompt_token_ids: list[int],
        tokens: int,
        cache_salt: str | None = None,
    ) -> tuple[InstanceState, int] | None:
        """Per-request disaggregation: the decode instance that prefills the request itself, and the
        prompt tokens it is expected to compute, or None when a prefill instance is to. The
        candidate is the decode instance with room holding the longest prefix of the prompt (the
        least loaded of those that tie); the rule (``prefill_locally``) weighs its tokens to compute
        and its queue against the prefill instance's the prompt would go to."""
        if config.mode == "off" or not decodes or not prefills:
            return None
        hashes = self.prefix_index.block_hashes(prompt_token_ids, cache_salt)
        to_compute = self._to_compute(_roomy(decodes, tokens), prompt_token_ids, hashes)
        decode = min(to_compute, key=lambda s: (to_compute[s], s.load))
        remote = self._to_compute(_roomy(prefills, tokens), prompt_token_ids, hashes)
        prefill_queued = min(s.queued_prefill_tokens + n for s, n in remote.items())
        if not prefill_locally(config, to_compute[decode], decode.queued_prefill_tokens, prefill_queued):
            return None
        self._add(decode, hashes)
        return decode, to_compute[decode]

    def remember(self, entry: InstanceState, token_ids: list[int], cache_salt: str | None = None) -> None:
        """``entry`` holds the KV of ``token_ids``, salted with ``cache_salt`` (in its prefix cache
        once the request is done, and in the tier)."""
        self._add(entry, self.prefix_index.block_hashes(token_ids, cache_salt))

    def _to_compute(
        self, candidates: list[InstanceState], prompt_token_ids: list[int], hashes: list[int]
    ) -> dict[InstanceState, int]:
        """Per candidate: the prompt's tokens less the prefix sent there or to the tier; the last
        token is always computed."""
        to_compute = {}
        in_tier = self.tier_index.matched_blocks("", hashes) if self.tier_index is not None else 0
        for entry in candidates:
            cached = max(self.prefix_index.matched_blocks(entry.name, hashes), in_tier) * self.prefix_index.block_size
            to_compute[entry] = len(prompt_token_ids) - min(cached, len(prompt_token_ids) - 1)
        return to_compute

    def pick_decode(self, pool: list[InstanceState]) -> InstanceState:
        """The decode instance with the most room for a handed-over request."""
        return self.least_loaded(pool)

    @staticmethod
    def least_loaded(pool: list[InstanceState]) -> InstanceState:
        return min(_available(pool), key=lambda s: s.load)


def _roomy(pool: list[InstanceState], tokens: int) -> list[InstanceState]:
    """The instances of ``pool`` with room for ``tokens`` more; all of them when none has."""
    return [s for s in _available(pool) if s.total_load_tokens + tokens <= s.capacity] or pool


def _available(pool: list[InstanceState]) -> list[InstanceState]:
    """``pool``, which must hold an instance to route to."""
    if not pool:
        raise InstanceFailure("no instance is available to serve the request")
    return pool


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
