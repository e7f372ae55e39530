"""vLLM's request fields, in one table: every field of vLLM's CompletionRequest and
ChatCompletionRequest (and OpenAI's) is in ``FIELDS``, once, with what each route does with it: it
SETS SamplingParams fields, or the REQUEST code reads it (``openai_protocol``), or only its NEUTRAL
values (those that leave the result unchanged) are accepted, or it is IGNORED (any value leaves the
result unchanged). A field a route does not list is refused as unknown. null always means the
default. docs/openai.md's field table is ``field_table()`` of this one."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

from distserve.core.config import is_int, is_number
from distserve.entrypoints.openai_errors import HTTPError

Check = tuple[str, Callable[[Any], bool]]  # what a value must be, in words, and the test of it


def _all(v: Any, kind: type) -> bool:
    return isinstance(v, list) and all(isinstance(x, kind) for x in v)


def is_ints(v: Any) -> bool:
    """A list of integers: token ids."""
    return isinstance(v, list) and all(is_int(t) for t in v)


_INT: Check = ("an integer", is_int)
_NUMBER: Check = ("a finite number", is_number)
_BOOL: Check = ("a boolean", lambda v: isinstance(v, bool))
_STRING: Check = ("a string", lambda v: isinstance(v, str))
_OBJECT: Check = ("an object", lambda v: isinstance(v, dict))
_LIST: Check = ("a list", lambda v: isinstance(v, list))
_INTS: Check = ("a list of integers", is_ints)
_STRINGS: Check = ("a list of strings", lambda v: _all(v, str))
_OBJECTS: Check = ("a list of objects", lambda v: _all(v, dict))
_STOP: Check = ("a string or a list of strings", lambda v: isinstance(v, str) or _all(v, str))
_SCHEMA: Check = ("a JSON schema (an object, or its text)", lambda v: isinstance(v, (dict, str)))
_EARLY_STOPPING: Check = ('a boolean or "never"', lambda v: isinstance(v, bool) or v == "never")
_ANY: Check = ("anything", lambda v: True)  # checked by the code that reads it

SETS, REQUEST, NEUTRAL, IGNORED = "sets", "request", "neutral", "ignored"


@dataclasses.dataclass(frozen=True)
class Use:
    """What one route does with a field: ``check`` is its type; ``to`` maps a SETS field's value to
    SamplingParams keywords (default: the field's own name); ``neutral`` holds the values a NEUTRAL
    field accepts (none: only null)."""

    check: Check
    how: str
    to: Callable[[Any], dict[str, Any]] | None = None
    neutral: tuple = ()

    def cell(self) -> str:
        """This use in the docs' table."""
        if self.how == NEUTRAL:
            return f"only {_values(self.neutral)}" if self.neutral else "refused"
        return "ignored" if self.how == IGNORED else "yes"


def _values(values: tuple) -> str:
    return ", ".join(f"`{json.dumps(v)}`" for v in values)


def sets(check: Check, to: Callable[[Any], dict[str, Any]] | None = None) -> Use:
    return Use(check, SETS, to)


def request(check: Check) -> Use:
    return Use(check, REQUEST)


def neutral(check: Check, *values: Any) -> Use:
    return Use(check, NEUTRAL, neutral=values)


def ignored(check: Check) -> Use:
    return Use(check, IGNORED)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    completions: Use | None  # None: unknown to that route
    chat: Use | None
    doc: str  # what happens, for the docs' table


def _field(name: str, use: Use, doc: str) -> Field:
    return Field(name, use, use, doc)


def _structured(key: str) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {"structured_outputs": {key: v}}


def _response_format(value: dict) -> dict[str, Any]:
    """OpenAI's response_format as structured outputs, as vLLM maps it."""
    refuse_unknown(value, ("type", "json_schema"), "response_format")
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"structured_outputs": {"json_object": True}}
    if kind == "json_schema":
        spec = value.get("json_schema")
        where = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise HTTPError(f"'{where}' must be an object with the 'schema'", param=where)
        refuse_unknown(spec, ("name", "description", "schema", "strict"), where)
        for name, (what, ok) in (("name", _STRING), ("description", _STRING), ("strict", _BOOL)):
            if spec.get(name) is not None and not ok(spec[name]):
                raise HTTPError(f"'{where}.{name}' must be {what}", param=f"{where}.{name}")
        if not isinstance(spec.get("schema"), dict):
            raise HTTPError(f"'{where}.schema' must be a JSON schema object", param=f"{where}.schema")
        return {"structured_outputs": {"json": spec["schema"]}}
    if kind == "structural_tag":
        raise HTTPError(
            "'response_format' of type 'structural_tag' is not supported by this server", param="response_format"
        )
    raise HTTPError(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)}",
        param="response_format.type",
    )


_STRUCTURED_KINDS: dict[str, Check] = {
    "json": _SCHEMA,
    "regex": _STRING,
    "choice": _STRINGS,
    "grammar": _STRING,
    "json_object": _BOOL,
}
# vLLM's other StructuredOutputsParams fields, with the values that change nothing here.
_STRUCTURED_NEUTRAL = {
    "disable_fallback": (False,),
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
    "whitespace_pattern": (),
    "structural_tag": (),
}


def _structured_outputs(value: dict) -> dict[str, Any]:
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar, json_object."""
    kinds = {}
    for key, v in value.items():
        where = f"structured_outputs.{key}"
        if v is None:
            continue
        if key in _STRUCTURED_KINDS:
            what, ok = _STRUCTURED_KINDS[key]
            if not ok(v):
                raise HTTPError(f"'{where}' must be {what}, got {json.dumps(v)}", param=where)
            kinds[key] = v
        elif key in _STRUCTURED_NEUTRAL:
            if v not in _STRUCTURED_NEUTRAL[key] or not isinstance(v, bool):
                raise HTTPError(f"'{where}' is not supported by this server", param=where)
        else:
            raise HTTPError(f"unknown field '{where}'", param=where)
    return {"structured_outputs": kinds}


FIELDS: tuple[Field, ...] = (
    # OpenAI's fields
    _field("model", request(_STRING), "must be the served model (404 otherwise)"),
    Field(
        "prompt",
        request(_ANY),
        None,
        "a string, a list of token ids, or a batch: a list of strings or of token-id lists",
    ),
    Field("messages", None, request(_ANY), "the conversation (below)"),
    _field(
        "max_tokens",
        request(_INT),
        "most tokens to generate; completions: default 16; chat: as `max_completion_tokens`",
    ),
    Field(
        "max_completion_tokens",
        None,
        request(_INT),
        "most tokens to generate; default: what is left of the context, or the model's `max_new_tokens` if less",
    ),
    _field("n", request(_INT), "samples per prompt, 1 to `limits.max_n` (default 16)"),
    _field(
        "best_of",
        request(_INT),
        "accepted when equal to `n`: no extra samples are drawn to rank; any other value is refused",
    ),
    _field("temperature", sets(_NUMBER), "default 1 (or the model's); 0 (anything below 1e-5, as vLLM) is greedy"),
    _field("top_p", sets(_NUMBER), "in (0, 1]; 1 disables it"),
    _field("seed", sets(_INT), "makes the samples reproducible; sample `i` of a prompt uses `seed + i`"),
    _field("stop", sets(_STOP), "a string or a list: the text ends before the first one generated"),
    _field("stream", request(_BOOL), "answer with server-sent events (below)"),
    _field(
        "stream_options",
        request(_OBJECT),
        "with `stream` only: `include_usage` (a last chunk with the usage), `continuous_usage_stats` (with "
        "`include_usage`: every chunk has its choice's usage so far)",
    ),
    _field("frequency_penalty", sets(_NUMBER), "in [-2, 2]: minus this times a token's count so far from its logit"),
    _field("presence_penalty", sets(_NUMBER), "in [-2, 2]: minus this from the logit of each token generated so far"),
    _field(
        "logit_bias",
        sets(_OBJECT),
        'token id (a string key, as JSON has) -> added to its logit, clamped to [-100, 100]: `{"50256": -100}` bans it',
    ),
    Field(
        "logprobs",
        sets(_INT),
        request(_BOOL),
        "logprobs of the output tokens (below): completions: an integer N in [0, 20], each token's and the "
        "N likeliest; chat: `true`, each token's and `top_logprobs` likeliest",
    ),
    Field("top_logprobs", None, request(_INT), "in [0, 20], with `logprobs: true`"),
    Field(
        "echo",
        request(_BOOL),
        neutral(_BOOL, False),
        "completions: the prompt's text comes first in the choice's text, its tokens first in `logprobs`; "
        "vLLM's chat echo (of the last message) is not implemented",
    ),
    Field("suffix", neutral(_STRING, ""), None, "text after the insertion point: insertion is not implemented"),
    _field("user", ignored(_STRING), "names the end user to OpenAI; it changes nothing here"),
    # vLLM's sampling extensions
    _field(
        "top_k",
        sets(_INT, lambda v: {"top_k": 0 if v == -1 else v}),
        "only the k likeliest tokens; 0 or -1 disables it",
    ),
    _field("min_p", sets(_NUMBER), "in [0, 1]: drop tokens less likely than this share of the likeliest"),
    _field(
        "repetition_penalty",
        sets(_NUMBER),
        "in (0, 2], 1 is off: divides the positive logits (multiplies the negative) of tokens in the prompt or output",
    ),
    _field("min_tokens", sets(_INT), "no EOS, stop token or stop string ends the output before this many tokens"),
    _field("stop_token_ids", sets(_INTS), "the output ends at any of these tokens"),
    _field("ignore_eos", sets(_BOOL), "generate past the end-of-sequence token"),
    _field("include_stop_str_in_output", sets(_BOOL), "keep the stop string that ended the text in it"),
    _field("skip_special_tokens", sets(_BOOL), "leave special tokens out of the text (default true)"),
    _field(
        "spaces_between_special_tokens",
        neutral(_BOOL, True),
        "the detokenizer decodes with the tokenizer's default, which is this",
    ),
    _field("allowed_token_ids", sets(_INTS), "sample only among these tokens"),
    _field("bad_words", sets(_STRINGS), "never generate these words"),
    _field(
        "prompt_logprobs",
        sets(_INT),
        "in [0, 20]: each prompt token's logprob and the N likeliest at its position, as `prompt_logprobs` (below); "
        "not with `stream`",
    ),
    _field(
        "truncate_prompt_tokens",
        sets(_INT),
        "keep only the prompt's last N tokens; -1: the context's length",
    ),
    _field("truncation_side", neutral(_STRING, "left"), "truncation keeps the prompt's last tokens"),
    _field(
        "use_beam_search",
        request(_BOOL),
        "beam search of `n` beams (vLLM's mapping: `n` is the beam width), all `n` returned, best first, each "
        "with its `cumulative_logprob`; streamed, every choice comes whole at the end (below)",
    ),
    _field(
        "length_penalty",
        sets(_NUMBER),
        "with `use_beam_search`: a hypothesis scores its summed logprob over its length to this power (default 1); "
        "ignored without it, as vLLM",
    ),
    _field(
        "early_stopping",
        sets(_EARLY_STOPPING),
        'with `use_beam_search`: `true`, `false` (default) or `"never"`, as transformers\' `early_stopping`; '
        "ignored without it, as vLLM",
    ),
    _field("watermarking", neutral(_BOOL, False), "not implemented"),
    _field("repetition_detection", neutral(_OBJECT), "not implemented"),
    _field("thinking_token_budget", neutral(_INT, -1), "no reasoning parser"),
    _field("logprob_token_ids", neutral(_INTS), "not implemented: `logprobs` gives the likeliest tokens'"),
    _field("logits_processors", neutral(_LIST), "no code from requests runs here"),
    _field(
        "add_special_tokens",
        request(_BOOL),
        "add the tokenizer's special tokens (BOS...) when encoding the prompt; default true for completions, false "
        "for chat (the template writes them)",
    ),
    # structured outputs
    _field(
        "response_format",
        sets(_OBJECT, _response_format),
        '`{"type": "text"}` changes nothing; `json_object`: any JSON object; `json_schema` '
        '(`{"json_schema": {"name", "schema", "strict"}}`): a JSON value of `schema`',
    ),
    _field(
        "structured_outputs",
        sets(_OBJECT, _structured_outputs),
        "vLLM's: exactly one of `json` (a schema), `regex`, `choice` (a list of strings), `grammar` (EBNF), "
        "`json_object: true`",
    ),
    _field("guided_json", sets(_SCHEMA, _structured("json")), "vLLM's older `structured_outputs.json`"),
    _field("guided_regex", sets(_STRING, _structured("regex")), "vLLM's older `structured_outputs.regex`"),
    _field("guided_choice", sets(_STRINGS, _structured("choice")), "vLLM's older `structured_outputs.choice`"),
    _field("guided_grammar", sets(_STRING, _structured("grammar")), "vLLM's older `structured_outputs.grammar`"),
    _field("guided_decoding_backend", ignored(_STRING), "the engine has one backend"),
    _field("guided_whitespace_pattern", neutral(_STRING), "not implemented"),
    # vLLM's request extensions
    _field(
        "priority",
        request(_INT),
        "scheduling priority, lower first; other than 0 only under `scheduler.policy: priority` (400 otherwise)",
    ),
    _field("request_id", request(_STRING), "the response's `id` is `cmpl-<request_id>` (`chatcmpl-` for chat)"),
    _field("session_id", ignored(_STRING), "names a conversation; it changes nothing here"),
    _field(
        "return_token_ids",
        request(_BOOL),
        "each choice gets `prompt_token_ids` and `token_ids`; when streaming, each chunk its new `token_ids` and a "
        "choice's first chunk its `prompt_token_ids`",
    ),
    _field(
        "return_tokens_as_token_ids", request(_BOOL), "logprobs name tokens `token_id:<id>` rather than by their text"
    ),
    _field("return_token_offsets", ignored(_BOOL), "vLLM answers it on its render endpoints only"),
    _field("return_mm_kwargs", ignored(_BOOL), "vLLM answers it on its render endpoints only"),
    _field("stream_interval", ignored(_INT), "chunks follow the server's `stream_interval`"),
    _field("routed_experts_prompt_start", neutral(_INT, 0), "not implemented"),
    _field(
        "cache_salt",
        sets(_STRING),
        "cached prompt prefixes are shared only between requests of the same salt (in the instances' caches, the "
        "prefix tier and routing); at most 128 characters, none of `@`, `/`, `\\` or NUL",
    ),
    _field("kv_transfer_params", neutral(_OBJECT), "the cluster moves KV between its instances itself"),
    _field("ec_transfer_params", neutral(_OBJECT), "no encoder cache"),
    _field("vllm_xargs", neutral(_OBJECT, {}), "no custom extensions"),
    Field("prompt_embeds", neutral(_ANY), None, "prompts are text or token ids"),
    # chat only
    Field("tools", None, neutral(_LIST, []), "tool calling is not implemented"),
    Field("tool_choice", None, neutral(_ANY, "none"), "tool calling is not implemented"),
    Field("functions", None, neutral(_LIST, []), "tool calling is not implemented"),
    Field("function_call", None, neutral(_ANY, "none"), "tool calling is not implemented"),
    Field("parallel_tool_calls", None, ignored(_BOOL), "without tools it changes nothing"),
    Field("reasoning_effort", None, request(_STRING), "passed to the chat template, as vLLM does"),
    Field("include_reasoning", None, neutral(_BOOL, True), "no reasoning parser: all the answer is content"),
    Field("add_generation_prompt", None, request(_BOOL), "open the assistant's turn after the messages (default true)"),
    Field(
        "continue_final_message",
        None,
        request(_BOOL),
        "continue the last message rather than open a new one (`add_generation_prompt` then defaults to false)",
    ),
    Field("documents", None, request(_OBJECTS), "passed to the chat template, for templates that cite documents"),
    Field("chat_template", None, neutral(_STRING), "templates sent with a request are not trusted (vLLM's default)"),
    Field("chat_template_kwargs", None, request(_OBJECT), "more variables for the chat template"),
    Field("mm_processor_kwargs", None, neutral(_OBJECT, {}), "text only"),
    Field("media_io_kwargs", None, neutral(_OBJECT, {}), "text only"),
    Field("return_prompt_text", None, neutral(_BOOL, False), "not implemented"),
)

COMPLETION_FIELDS: dict[str, Use] = {f.name: f.completions for f in FIELDS if f.completions is not None}
CHAT_FIELDS: dict[str, Use] = {f.name: f.chat for f in FIELDS if f.chat is not None}


def field_table() -> str:
    """FIELDS as docs/openai.md's table."""
    rows = ["| Field | Completions | Chat | What happens |", "|---|---|---|---|"]
    for f in FIELDS:
        cells = [use.cell() if use is not None else "-" for use in (f.completions, f.chat)]
        rows.append(f"| `{f.name}` | {cells[0]} | {cells[1]} | {f.doc} |")
    return "\n".join(rows) + "\n"


def parse_fields(body: Any, table: dict[str, Use]) -> dict[str, Any]:
    """The body's fields with a value (null means the default), each checked for its type, and those
    accepted only at neutral values checked for one."""
    if not isinstance(body, dict):
        raise HTTPError(f"the request body must be a JSON object, got {type(body).__name__}")
    fields = {}
    for name, value in body.items():
        use = table.get(name)
        if use is None:
            raise HTTPError(f"unknown field '{name}'", param=name)
        if value is None:
            continue
        what, ok = use.check
        if not ok(value):
            raise HTTPError(f"'{name}' must be {what}, got {json.dumps(value)}", param=name)
        if use.how == NEUTRAL and value not in use.neutral:
            only = f": only {_values(use.neutral)} (or null) is accepted" if use.neutral else ""
            raise HTTPError(f"'{name}' is not supported by this server{only}", param=name)
        fields[name] = value
    return fields


def sampling_kwargs(fields: dict[str, Any], table: dict[str, Use]) -> tuple[dict[str, Any], dict[str, str]]:
    """The SamplingParams keywords the SETS fields give, and for each the field that set it."""
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, value in fields.items():
        use = table[name]
        if use.how != SETS:
            continue
        for key, v in (use.to(value) if use.to else {name: value}).items():
            if key == "structured_outputs":
                kwargs.setdefault(key, {}).update(v)
            else:
                kwargs[key] = v
            sources.setdefault(key, name)
    return kwargs, sources


def refuse_unknown(value: dict, known: Iterable[str], where: str) -> None:
    """Refuse the object at ``where`` if it has a field outside ``known``, naming the field."""
    extra = sorted(set(value) - set(known))
    if extra:
        raise HTTPError(f"unknown field '{where}.{extra[0]}'", param=f"{where}.{extra[0]}")
