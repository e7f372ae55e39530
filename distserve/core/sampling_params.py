"""Per-request sampling and stopping parameters, validated on construction. Names and meanings
follow vLLM's ``SamplingParams``."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields

from distserve.core.errors import RequestError

MAX_LOGPROBS = 20  # top logprobs a request may ask for per token, as OpenAI allows
# vLLM's bounds on a cache salt (``validate_cache_salt``): a salt it refuses is refused here too.
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")
GREEDY_TEMPERATURE = 1e-5  # temperatures below it sample greedily


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language: set exactly one of these (vLLM's names)."""

    json: str | dict | None = None  # a JSON schema (as text or parsed): the output is a JSON value of it
    regex: str | None = None  # the output matches this regular expression
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # the output is a sentence of this EBNF (GBNF) grammar
    json_object: bool | None = None  # the output is any JSON object

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise RequestError(
                "structured outputs take exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(given) or "none")
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise RequestError(f"structured outputs' choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"structured outputs' {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestError("structured outputs' json must be a JSON schema, as an object or its text")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` or ``top_k == 1`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable
    those filters. A ``seed`` makes the request's samples reproducible whatever it is batched with.
    Penalties, biases and bans change the logits before temperature and the filters; logprobs are
    of the model's own distribution, before any of them.
    """

    max_tokens: int = field(default=16, metadata={"help": "most tokens to generate"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; below 1e-5 is greedy"})
    top_k: int = field(default=0, metadata={"help": "sample from the k likeliest tokens; 0 disables it"})
    top_p: float = field(
        default=1.0, metadata={"help": "sample from the smallest set of this probability; 1 disables it"}
    )
    min_p: float = field(
        default=0.0, metadata={"help": "drop tokens less likely than this share of the likeliest; 0 disables it"}
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
    min_tokens: int = field(default=0, metadata={"help": "generate at least this many tokens before any stop"})
    presence_penalty: float = field(
        default=0.0, metadata={"help": "subtract this from the logit of every token already generated"}
    )
    frequency_penalty: float = field(
        default=0.0, metadata={"help": "subtract this times its count from the logit of every generated token"}
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={"help": "divide positive (multiply negative) logits of prompt and output tokens by this; 1 is off"},
    )
    logit_bias: dict[int, float] | None = field(
        default=None,
        metadata={
            "help": 'token id -> value added to its logit (-100 bans it), as JSON: {"42": 5}',
            "parse": json.loads,
        },
    )
    allowed_token_ids: list[int] | None = field(default=None, metadata={"help": "sample only among these tokens"})
    bad_words: list[str] = field(default_factory=list, metadata={"help": "never generate this word"})
    logprobs: int | None = field(
        default=None, metadata={"help": "return each output token's logprob and the top N (0: the token's only)"}
    )
    prompt_logprobs: int | None = field(
        default=None, metadata={"help": "return each prompt token's logprob and the top N"}
    )
    truncate_prompt_tokens: int | None = field(default=None, metadata={"help": "keep only the prompt's last N tokens"})
    structured_outputs: StructuredOutputsParams | None = field(
        default=None,
        metadata={
            "help": 'constrain the output, as JSON: {"json": SCHEMA}, {"regex": R}, {"choice": [...]}, {"grammar": G}',
            "parse": json.loads,
        },
    )
    n: int = field(default=1, metadata={"help": "samples of the prompt (with beam_width: the best beams returned)"})
    beam_width: int | None = field(
        default=None,
        metadata={"help": "beam search of this many beams, returning the n best (None: sample instead)"},
    )
    length_penalty: float = field(
        default=1.0,
        metadata={"help": "beam search: a hypothesis scores its summed logprob over its length to this power"},
    )
    early_stopping: bool | str = field(
        default=False,
        metadata={
            "help": "beam search: stop once width hypotheses are done (true), once no beam is likely to beat "
            "them (false), or once none can (never), as transformers' early_stopping",
            "parse": lambda v: v if v == "never" else json.loads(v),
        },
    )
    cache_salt: str | None = field(
        default=None,
        metadata={
            "help": "share cached prompt prefixes only with requests of the same salt (vLLM's cache_salt): a "
            "secret per tenant, so that no other can learn from cache hits what it sent"
        },
    )
    # Filled in by the engine that admits the request, from its tokenizer and model.
    all_stop_token_ids: tuple[int, ...] = field(default=(), repr=False, metadata={"internal": True})
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not _int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not _int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not (_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if self.seed is not None and not _int(self.seed):
            # Its samples are seeded seed + 1, ...: anything else fails in the step, not here.
            raise RequestError(f"seed must be an integer, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if any(not _int(t) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not _int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and -2.0 <= value <= 2.0):
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not (_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0):
            raise RequestError(f"repetition_penalty must be in (0, 2] (1 is off), got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            self.logit_bias = self._checked_bias(self.logit_bias)
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or any(not _int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            raise RequestError(
                f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}"
            )
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise RequestError("bad_words must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.truncate_prompt_tokens is not None and (
            not _int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise RequestError(f"truncate_prompt_tokens must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError("structured_outputs must be a StructuredOutputsParams")
        if not _int(self.n) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}")
        self._check_beam_search()
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str)
            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
            or not CACHE_SALT_FORBIDDEN.isdisjoint(self.cache_salt)
        ):
            raise RequestError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters without "
                "'@', '/', '\\' or NUL"
            )

    def _check_beam_search(self) -> None:
        """Beam search's own fields, and the options it refuses. Its beams are scored by the model's
        own logprobs, as vLLM's beam search and transformers' do: what only picks among tokens
        (temperature, top_k, top_p, min_p, seed) has nothing to act on and is ignored, as vLLM ignores
        it; what changes the distribution or the output (penalties, biases, bans, allowed tokens,
        min_tokens, structured outputs, stop strings, logprobs) is refused."""
        if self.beam_width is None:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                raise RequestError("length_penalty and early_stopping apply only to beam search: set beam_width")
            return
        if not _int(self.beam_width) or self.beam_width < 1:
            raise RequestError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.n > self.beam_width:
            raise RequestError(f"n must be at most beam_width={self.beam_width} (the beams returned), got {self.n}")
        if not _number(self.length_penalty):
            raise RequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise RequestError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}')
        refused = {
            "stop": bool(self.stop),
            "min_tokens": self.min_tokens > 0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured_outputs": self.structured_outputs is not None,
        }
        given = [name for name, is_set in refused.items() if is_set]
        if given:  # the message begins with the field, which the HTTP server names as the param at fault
            raise RequestError(f"{given[0]} does not apply to beam search (beam_width): leave out {', '.join(given)}")

    @property
    def num_beam_candidates(self) -> int:
        """The continuations a beam search step ranks: transformers' ``max(2, 1 + stop tokens)``
        per beam, so that ``beam_width`` of them go on whichever stop tokens the others take."""
        return max(2, 1 + len(self.all_stop_token_ids)) * self.beam_width

    @staticmethod
    def _checked_bias(bias: dict) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise RequestError(f"logit_bias must map token ids to numbers, got {bias!r}")
        checked = {}
        for token, value in bias.items():
            try:
                token_id = int(token)  # JSON keys are strings
            except (TypeError, ValueError):
                raise RequestError(f"logit_bias keys must be token ids, got {token!r}") from None
            if token_id < 0 or not _number(value):
                raise RequestError(f"logit_bias must map token ids to finite numbers, got {token!r}: {value!r}")
            checked[token_id] = max(-100.0, min(100.0, float(value)))  # OpenAI's range
        return checked

    def sample_params(self, index: int) -> SamplingParams:
        """What sample ``index`` of the ``n`` draws with: one sample, seeded ``seed + index`` (as vLLM
        seeds a request's samples). The prompt's logprobs come once, with sample 0."""
        if index == 0 or self.beam_width is not None:  # beams share the request's params
            return self
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=None)

    @property
    def stop_text_holdback(self) -> int:
        """Characters of output text held back while a request runs: they may begin a stop string,
        which is cut from the text with everything after it once complete."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    @property
    def greedy(self) -> bool:
        # A temperature this small is greedy in effect, and dividing logits by it can overflow to
        # inf and NaN probabilities (vLLM draws the line at the same value).
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the request's tokens so far (penalties, multi-token bad words)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or any(len(w) > 1 for w in self.bad_words_token_ids)
        )

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature and the top-k/top-p/min-p filters changes the logits."""
        return (
            self.penalized
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )
