"""Grammars for structured outputs: JSON schema, any JSON object, regex, choice and EBNF grammar.

Constraining a request to a language is done with a token bitmask per step: each step, a request's
matcher writes which tokens may come next into its row of an int32 bitmask (bit ``t % 32`` of word
``t // 32`` for token ``t``), the sampler sets every other token's logit to -inf, and the token
sampled is fed back to the matcher. The grammar library is xgrammar (scripts/benchmarks/bench_grammar.py
measured it against llguidance: a faster mask per token, and a CPU kernel to apply it). It compiles
more slowly (10-25 ms for a JSON schema or regex on 32000 tokens), hence the cache of compiled
grammars, which are immutable and shared by every request with the same spec, and a compile that
may run off the step loop; a matcher is per request.

A request's grammar state is never pickled or shipped: it is rebuilt from the spec and the output
tokens so far (``GrammarMatcher.replay``), so it survives the hand-over from a prefill to a decode
instance, preemption and role changes without any state of its own crossing a process.

Usage (the engine side; ``eos_token_ids`` are the ids the engine stops on)::

    compiler = GrammarCompiler(tokenizer, model_vocab_size, eos_token_ids)   # once per instance
    compiled = compiler.compile(params.structured_outputs)   # any thread; RequestError if invalid
    matcher = GrammarMatcher.replay(compiled, seq.output_token_ids)   # admission, hand-over, resume
    bitmask = allocate_bitmask(max_batch, model_vocab_size)   # once, reused every step
    for row, matcher in constrained.items():       # each step, before sampling; row: the logits row
        matcher.fill_bitmask(bitmask, row)
    apply_bitmask(logits, bitmask[: len(logits)], rows_index=list(constrained))   # sampler, in place
    for row, matcher in constrained.items():       # after sampling
        matcher.accept(sampled[row])               # False: the token broke the grammar

Once the grammar is complete its mask allows EOS (with whatever may still continue it), so a
constrained request must not have EOS banned at that point (``min_tokens``) or its row allows
nothing; and once ``is_terminated()`` the request is over, ``ignore_eos`` or not (nothing follows).
The bitmask itself (allocating and applying it) lives beside the sampler, in
``distserve.model_executor.token_bitmask``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from distserve.core.cpu_cores import available_cores
from distserve.core.errors import RequestError
from distserve.core.sampling_params import StructuredOutputsParams
from distserve.model_executor.token_bitmask import bitmask_words, word_bit

# Bytes 0x00-0x1f other than \n and \r. Valid JSON text never holds them raw, yet xgrammar 0.2.9
# lets strings with minLength/maxLength take them (xgrammar issue #800: the walk in
# scripts/benchmarks/bench_grammar.py wrote raw \x01 and \t into such strings). Tokens holding one are kept out
# of JSON masks: \t is JSON whitespace too, but never needed, and space, \n and \r remain.
_JSON_BANNED_BYTES = frozenset(range(0x20)) - {0x0A, 0x0D}
_JSON_KINDS = ("json", "json_object")
# xgrammar's C++ errors start with a timestamp and source location: "[12:00:00] /x/y.cc:94: ".
_ERROR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _bits_to_words(allowed: np.ndarray) -> np.ndarray:
    """A bool vector (one per token) as an int32 bitmask row."""
    padded = np.zeros(bitmask_words(len(allowed)) * 32, dtype=bool)
    padded[: len(allowed)] = allowed
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)  # token t: bit t % 32 of word t // 32


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled against one tokenizer, shared read-only by all its requests' matchers."""

    kind: str  # the StructuredOutputsParams field: json, json_object, regex, choice or grammar
    spec: str  # the spec as compiled: schema text, regex, grammar (choice: its JSON list)
    grammar: xgr.CompiledGrammar
    stop_token_ids: tuple[int, ...]  # the tokens the grammar ends with: the engine's EOS ids
    banned: np.ndarray | None  # an allowed-token bitmask row ANDed into every mask (JSON kinds)
    banned_ids: frozenset[int]  # the tokens it bans, for accept()

    @property
    def memory_size_bytes(self) -> int:
        return self.grammar.memory_size_bytes


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and model, keeping the latest in an LRU.

    The tokenizer's information is built once here (about 0.1 s for 32000 tokens). ``vocab_size``
    is the model's logits width, which may exceed ``len(tokenizer)`` (padded embeddings): tokens
    past the tokenizer are never allowed. ``stop_token_ids`` are the tokens a complete grammar
    allows to end the output; pass the engine's EOS ids, so that the grammar's end and the
    engine's stop agree (default: the tokenizer's eos_token_id).

    ``compile`` is thread-safe and releases the GIL while xgrammar works, so it may run outside
    the step loop; concurrent compiles of one spec wait for a single compilation.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int] | None = None,
        *,
        max_cached: int = 64,
        max_threads: int | None = None,
    ) -> None:
        stops = sorted(set(stop_token_ids)) if stop_token_ids is not None else [tokenizer.eos_token_id]
        if not stops or any(t is None or not 0 <= t < vocab_size for t in stops):
            raise ValueError(f"stop_token_ids must be token ids below vocab_size={vocab_size}, got {stops}")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stops)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        # Our LRU is the only cache (xgrammar's own would grow without bound).
        # As many threads as the cores this process may run on: an instance bound to one core
        # compiles on one thread, leaving its step loop half the core rather than a third.
        threads = max_threads or min(8, len(available_cores()))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._json_banned, self._json_banned_ids = self._json_ban(self.info.decoded_vocab)
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def _json_ban(self, decoded_vocab: list[bytes]) -> tuple[np.ndarray, frozenset[int]]:
        banned = frozenset(t for t, text in enumerate(decoded_vocab) if not _JSON_BANNED_BYTES.isdisjoint(text))
        allowed = np.ones(self.vocab_size, dtype=bool)
        allowed[sorted(banned)] = False
        return _bits_to_words(allowed), banned

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params``, from the cache if the same kind and spec was
        compiled lately. Raises RequestError naming what is wrong with an invalid spec."""
        key = (params.kind, _spec_text(params))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = Future()
        if not owner:
            return pending.result()
        try:
            compiled = self._compile(*key)
        except BaseException as e:
            with self._lock:
                del self._pending[key]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._pending[key]
            if self.max_cached > 0:
                self._cache[key] = compiled
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        pending.set_result(compiled)
        return compiled

    def matcher(self, params: StructuredOutputsParams, output_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for ``params`` that has accepted ``output_token_ids`` (a request's outputs so far)."""
        return GrammarMatcher.replay(self.compile(params), output_token_ids)

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        try:
            if kind in _JSON_KINDS:
                grammar = self._compiler.compile_json_schema(spec)
            elif kind == "regex":
                grammar = self._compiler.compile_regex(spec)
            else:  # choice (an EBNF of its strings) or grammar
                grammar = self._compiler.compile_grammar(_choice_ebnf(spec) if kind == "choice" else spec)
        except (RuntimeError, UnicodeDecodeError) as e:
            # Where xgrammar's message quotes the spec, it may cut a character in half: then it cannot
            # be read (UnicodeDecodeError), and the spec is invalid all the same.
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "EBNF grammar"}
            why = f": {_library_error(e)}" if isinstance(e, RuntimeError) else ""
            raise RequestError(f"structured outputs' {what.get(kind, kind)} is invalid{why}") from None
        json_kind = kind in _JSON_KINDS
        return CompiledGrammar(
            kind,
            spec,
            grammar,
            self.stop_token_ids,
            self._json_banned if json_kind else None,
            self._json_banned_ids if json_kind else frozenset(),
        )


def _spec_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind == "json":
        if isinstance(params.json, dict):
            return json.dumps(params.json)  # key order kept: it is the order properties are written in
        try:
            json.loads(params.json)
        except ValueError as e:
            raise RequestError(f"structured outputs' JSON schema is not valid JSON: {e}") from None
        return params.json
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "choice":
        return json.dumps(params.choice, ensure_ascii=False)
    return getattr(params, kind)


def _choice_ebnf(choice_json: str) -> str:
    # JSON string literals are EBNF string literals to xgrammar (escapes included); ensure_ascii=False
    # keeps characters beyond the BMP whole, where \\u escapes would split them into surrogates.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(choice_json))


def _library_error(e: Exception) -> str:
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return _ERROR_PREFIX.sub("", first).strip().rstrip(".")


class GrammarMatcher:
    """One request's place in its grammar: the tokens it accepted decide the next mask.

    Build it with ``replay`` from a request's output tokens whenever the request (re)starts on an
    instance; the state is a function of (compiled grammar, tokens), never carried across.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=list(compiled.stop_token_ids))
        self.num_tokens = 0  # tokens accepted so far, the final stop token included
        self._terminated = False  # kept here: a call into the library costs more than the check
        self._view: tuple[torch.Tensor | None, np.ndarray | None] = (None, None)  # the last bitmask, as numpy

    @classmethod
    def replay(cls, compiled: CompiledGrammar, token_ids: Iterable[int]) -> GrammarMatcher:
        """A matcher that has accepted ``token_ids``; ValueError if the grammar refuses one, as
        tokens generated under this grammar never are."""
        matcher = cls(compiled)
        for token in token_ids:
            if not matcher.accept(token):
                raise ValueError(
                    f"token {token} at output position {matcher.num_tokens} is not allowed by the "
                    f"{compiled.kind} grammar: the tokens were not generated under it"
                )
        return matcher

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (state unchanged) if the grammar does not allow it,
        or the matcher has already accepted a stop token."""
        if self._terminated or token_id in self.compiled.banned_ids or not self._matcher.accept_token(token_id):
            return False
        self.num_tokens += 1
        # xgrammar terminates on accepting a stop token, and only then
        self._terminated = token_id in self.compiled.stop_token_ids
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens allowed next into ``bitmask[row]`` (a CPU int32 tensor from
        ``allocate_bitmask``); a terminated matcher allows only its stop tokens. Returns whether
        the row masks anything (False: every token is allowed and applying it changes nothing)."""
        if self._terminated:
            bitmask[row] = 0
            for token in self.compiled.stop_token_ids:
                bitmask[row, token // 32] |= word_bit(token % 32)
            return True
        restricts = self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.compiled.banned is not None:
            tensor, view = self._view
            if tensor is not bitmask:  # numpy's AND costs a third of torch's on one row
                tensor, view = self._view = (bitmask, bitmask.numpy())
            np.bitwise_and(view[row], self.compiled.banned, out=view[row])
            return True
        return restricts

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted: the output is a complete sentence of the grammar."""
        return self._terminated

    def is_completed(self) -> bool:
        """Whether the output so far is a complete sentence (EOS is allowed), terminated or not."""
        return self._matcher.is_completed()
