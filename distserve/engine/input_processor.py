"""Turns a request into a validated ``Sequence``: tokenizes a text prompt and checks the ids, the
context length and whether the request can ever fit the KV cache, and fills in what its sampling
params need of the model (stop tokens, bad words as token ids). Engines and the orchestrator share
it, so a request is refused with the same message wherever it arrives. It holds the model's
sampling defaults too (``sampling_defaults``), which the entry points apply to the fields a
request leaves out, where they can tell. Thread-safe: the orchestrator runs it on its input
workers' threads, an instance on its calls' threads."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from distserve.core.errors import RequestError
from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence

if TYPE_CHECKING:
    from distserve.engine.structured_output import GrammarCompiler


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        num_kv_blocks: int,
        block_size: int,
        eos_token_ids: Iterable[int] = (),
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # SamplingParams fields the model's generation config sets (``default_sampling_params``).
        self.sampling_defaults = dict(sampling_defaults or {})
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured outputs' grammar compiler, made on first use (it indexes the vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                from distserve.engine.structured_output import GrammarCompiler  # the library: when first needed

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            return self._grammars

    def default_params(self, **given: Any) -> SamplingParams:
        """The sampling params of a request that sets only ``given``: the model's defaults for the rest."""
        return SamplingParams(**{**self.sampling_defaults, **given})

    def process(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        attempt: int = 0,
        ttft_deadline: float | None = None,
        tpot_slo: float | None = None,
    ) -> Sequence:
        """Validate a request and build its sequence; raises RequestError saying what to fix."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        else:
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if not token_ids:
            raise RequestError("the prompt is empty: pass at least one token")
        if params.truncate_prompt_tokens is not None and len(token_ids) > params.truncate_prompt_tokens:
            text, token_ids = None, token_ids[-params.truncate_prompt_tokens :]
        params = self.resolve(params)
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens but the model's context is {self.max_model_len}: "
                f"shorten it to at most {self.max_model_len - 1} tokens"
            )
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if -(-longest // self.block_size) > self.num_kv_blocks:
            raise RequestError(
                f"the request may grow to {longest} tokens, more than the KV cache's "
                f"{self.num_kv_blocks * self.block_size}: lower max_tokens or give the cache more blocks"
            )
        if params.beam_width is not None:
            self._check_beams(len(token_ids), params)
        return Sequence(
            token_ids, params, request_id=request_id, prompt=text, priority=priority, attempt=attempt,
            ttft_deadline=ttft_deadline, tpot_slo=tpot_slo,
        )  # fmt: skip

    def _check_beams(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """A beam search's candidates must fit the vocabulary, and its beams grown to their longest
        the KV cache (their prompt's blocks shared, each beam's own beside them): a search that can
        never hold all its beams at once would wait for ever."""
        if params.num_beam_candidates > self.vocab_size:
            raise RequestError(
                f"beam_width={params.beam_width} ranks {params.num_beam_candidates} candidates a step, more than "
                f"the vocabulary's {self.vocab_size} tokens: lower beam_width"
            )
        longest = min(params.max_tokens, self.max_model_len - num_prompt_tokens)
        need = num_prompt_tokens // self.block_size + params.beam_width * (-(-longest // self.block_size) + 1)
        if need > self.num_kv_blocks:
            raise RequestError(
                f"beam_width={params.beam_width} beams of up to {longest} tokens each may hold {need} KV blocks, "
                f"more than the cache's {self.num_kv_blocks}: lower beam_width or max_tokens, or give the cache more "
                "blocks"
            )

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the model's stop tokens and the bad words' token ids filled in, and every
        token id they name checked against the vocabulary."""
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise RequestError(f"{name} names token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # RequestError if it does not compile; cached
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return dataclasses.replace(
            params, all_stop_token_ids=tuple(sorted(stops)), bad_words_token_ids=self._bad_words(params.bad_words)
        )

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as it would appear alone and after a space (vLLM bans both)."""
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    found[ids] = None
        return tuple(found)
