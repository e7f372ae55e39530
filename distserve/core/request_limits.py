"""How much one request may ask for (``cluster.limits``): samples, tokens to generate, prompt bytes,
stop strings, bad words, logit biases, token-id lists and structured-output specs. The orchestrator
checks every request against them before it does any work for it (tokenizing, building one stream
per sample, compiling a grammar), so gRPC, HTTP and the Python API refuse alike; the HTTP server
checks the same limits before it renders or tokenizes a prompt itself. Over a limit is a
``RequestError`` that begins with the field at fault and names the limit and its option: gRPC
INVALID_ARGUMENT, HTTP 400.

Each limit bounds work that grows with a value the client picks: the orchestrator builds a stream
per sample on its event loop (``n``), a request holds KV and routing load for its ``max_tokens``,
tokenizing costs about a second per MiB of prompt, every decode step scans a request's stop
strings, logit biases, allowed tokens and bad words, and a grammar compiles in time that grows with
its spec.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from distserve.core.config import is_int, option
from distserve.core.errors import RequestError
from distserve.core.sampling_params import SamplingParams, StructuredOutputsParams

# The default prompt limit, per token of the model's context: English averages about 4 bytes a
# token and CJK text about 3, so this leaves room for prompts truncated to the context
# (``truncate_prompt_tokens``) while a prompt cannot cost more than about 16 contexts' tokenizing.
BYTES_PER_CONTEXT_TOKEN = 16
UTF8_MAX_BYTES = 4  # bytes of one character in UTF-8, at most


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = option(16, "samples per request (n), and beams of a beam search (beam_width)")
    max_tokens: int | None = option(None, "max_tokens of a request (default: the model's context length)")
    max_prompt_bytes: int | None = option(
        None,
        f"UTF-8 bytes of a text prompt, checked before it is tokenized (default: {BYTES_PER_CONTEXT_TOKEN} per "
        "token of the model's context)",
    )
    max_stop: int = option(64, "stop strings of a request")
    max_bad_words: int = option(64, "bad words of a request")
    max_word_chars: int = option(1024, "characters of one stop string or bad word")
    max_logit_bias: int = option(1024, "logit_bias entries of a request")
    max_token_ids: int = option(1024, "token ids in a request's allowed_token_ids, and in its stop_token_ids")
    max_structured_output_bytes: int = option(
        65536, "bytes of a structured output's JSON schema, regex, grammar or choices"
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (value is None and f.default is None) and (not is_int(value) or value < 1):
                raise ValueError(f"limits.{f.name} must be an integer >= 1, got {value!r}")

    @classmethod
    def parse(cls, value: RequestLimits | dict | None) -> RequestLimits:
        """From a config section: a mapping of its keys."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, dict):
            raise ValueError(f"limits must be a mapping of limits, got {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown limits option(s): {', '.join(sorted(unknown))}")
        return cls(**value)

    def resolve(self, max_model_len: int) -> RequestLimits:
        """The limits with those left to the model filled in from its context length."""
        return dataclasses.replace(
            self,
            max_tokens=self.max_tokens or max_model_len,
            max_prompt_bytes=self.max_prompt_bytes or BYTES_PER_CONTEXT_TOKEN * max_model_len,
        )

    def check(self, prompt: str | list[int], params: SamplingParams) -> None:
        """Raise RequestError for the first limit the request is over. Mostly lengths are read; what
        is measured in bytes (the prompt, a structured output's spec) costs a copy at most."""
        self.check_prompt(prompt)
        self.check_params(params)

    def check_prompt(self, prompt: str | list[int]) -> None:
        """A text prompt's UTF-8 bytes, counted only when its characters alone do not settle it."""
        if not isinstance(prompt, str) or len(prompt) * UTF8_MAX_BYTES <= self.max_prompt_bytes:
            return
        if len(prompt) > self.max_prompt_bytes:
            size = f"{len(prompt)} characters"
        else:
            num_bytes = len(prompt.encode("utf-8", "surrogatepass"))
            if num_bytes <= self.max_prompt_bytes:
                return
            size = f"{num_bytes} bytes"
        raise self._exceeded("max_prompt_bytes", f"the prompt has {size}", "bytes")

    def check_params(self, params: SamplingParams | Any) -> None:
        """``params``: a SamplingParams, or a message with its fields (gRPC's), whose lists are then
        measured before they are copied and checked entry by entry (a 16 MiB message's logit_bias
        takes a second to); unset numbers there read 0, and a structured output is left to the
        SamplingParams' own check."""
        scalars = (
            ("n", "max_n", params.n, "samples"),
            ("beam_width", "max_n", params.beam_width or 0, "beams"),  # a beam holds KV as a sample does
            ("max_tokens", "max_tokens", params.max_tokens, "tokens"),
        )
        for field, limit, value, unit in scalars:
            if value > getattr(self, limit):
                raise self._exceeded(limit, f"{field} is {value}", unit)
        lists = (
            ("stop", "max_stop", params.stop, "strings"),
            ("bad_words", "max_bad_words", params.bad_words, "words"),
            ("logit_bias", "max_logit_bias", params.logit_bias or (), "entries"),
            ("allowed_token_ids", "max_token_ids", params.allowed_token_ids or (), "ids"),
            ("stop_token_ids", "max_token_ids", params.stop_token_ids, "ids"),
        )
        for field, limit, values, unit in lists:
            if len(values) > getattr(self, limit):
                raise self._exceeded(limit, f"{field} has {len(values)} {unit}", unit)
        for field, words in (("stop", params.stop), ("bad_words", params.bad_words)):
            longest = max(map(len, words), default=0)
            if longest > self.max_word_chars:
                what = f"{field} has a string of {longest} characters"
                raise self._exceeded("max_word_chars", what, "characters")
        if isinstance(params.structured_outputs, StructuredOutputsParams):
            size = _spec_bytes(params.structured_outputs)
            if size > self.max_structured_output_bytes:
                what = f"structured_outputs' {params.structured_outputs.kind} has {size} bytes"
                raise self._exceeded("max_structured_output_bytes", what, "bytes")

    def _exceeded(self, limit: str, what: str, unit: str) -> RequestError:
        option_name = f"cluster.limits.{limit}, --limits-{limit.replace('_', '-')}"
        return RequestError(f"{what}, over the limit of {getattr(self, limit)} {unit} ({option_name})")


def _spec_bytes(spec: StructuredOutputsParams) -> int:
    value: Any = getattr(spec, spec.kind)
    if spec.kind == "choice":
        return sum(len(choice.encode("utf-8", "surrogatepass")) for choice in value)
    if isinstance(value, dict):
        value = json.dumps(value, default=str)
    return len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else 0
