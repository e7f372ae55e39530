"""The OpenAI-compatible HTTP endpoint: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, plus ``/health`` and ``/metrics``, in front of a ``Frontend``. The request fields,
extensions and error bodies are described in docs/openai.md."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import inspect
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, suppress
from typing import Any

from aiohttp import web
from jinja2 import TemplateError

from distserve.core.config import is_int, is_number
from distserve.core.errors import RequestError
from distserve.core.outputs import RequestOutput, TokenLogprobs
from distserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from distserve.entrypoints.errors import ServingError
from distserve.entrypoints.frontend import Frontend
from distserve.entrypoints.preflight import port_in_use
from distserve.entrypoints.prometheus import CONTENT_TYPE
from distserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger(__name__)

MAX_N = 16  # samples per prompt: each is a request of its own, so this bounds what one call admits
MAX_BODY_BYTES = 32 * 2**20  # room for batches of token-id prompts
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# For tokenizers without a chat template of their own.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT_ROLES = ("system", "developer", "user", "assistant")


class HTTPError(Exception):
    """An HTTP error answer, with the fields of OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code

    @classmethod
    def of(cls, error: ServingError) -> HTTPError:
        return cls(str(error), error.http_status, error.error_type)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.code}}


# -- request fields ------------------------------------------------------------------------------
#
# Every field of vLLM's CompletionRequest and ChatCompletionRequest (and OpenAI's) is in FIELDS, once,
# with what each route does with it: it SETS SamplingParams fields, or the REQUEST code reads it, or
# only its NEUTRAL values (those that leave the result unchanged) are accepted, or it is IGNORED
# (any value leaves the result unchanged). A field a route does not list is refused as unknown.
# null always means the default. docs/openai.md's field table is field_table() of this one.

Check = tuple[str, Callable[[Any], bool]]

_INT: Check = ("an integer", is_int)
_NUMBER: Check = ("a finite number", is_number)
_BOOL: Check = ("a boolean", lambda v: isinstance(v, bool))
_STRING: Check = ("a string", lambda v: isinstance(v, str))
_OBJECT: Check = ("an object", lambda v: isinstance(v, dict))
_LIST: Check = ("a list", lambda v: isinstance(v, list))
_INTS: Check = ("a list of integers", lambda v: isinstance(v, list) and all(is_int(t) for t in v))
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
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise HTTPError(f"unknown field 'response_format.{extra[0]}'", param=f"response_format.{extra[0]}")
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
        extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
        if extra:
            raise HTTPError(f"unknown field '{where}.{extra[0]}'", param=f"{where}.{extra[0]}")
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
        "max_completion_tokens", None, request(_INT), "most tokens to generate; default: what is left of the context"
    ),
    _field("n", request(_INT), f"samples per prompt, 1 to {MAX_N}"),
    _field(
        "best_of",
        request(_INT),
        "accepted when equal to `n`: no extra samples are drawn to rank; any other value is refused",
    ),
    _field("temperature", sets(_NUMBER), "default 1; 0 is greedy"),
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
    _field("use_beam_search", neutral(_BOOL, False), "beam search is not implemented"),
    _field("length_penalty", ignored(_NUMBER), "beam search's only"),
    _field("early_stopping", ignored(_EARLY_STOPPING), "beam search's only"),
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
    _field("priority", request(_INT), "scheduling priority, lower first (under `scheduler.policy: priority`)"),
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
    _field("cache_salt", neutral(_STRING), "the prefix cache is not salted"),
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
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def field_table() -> str:
    """FIELDS as docs/openai.md's table."""
    rows = ["| Field | Completions | Chat | What happens |", "|---|---|---|---|"]
    for f in FIELDS:
        cells = [use.cell() if use is not None else "-" for use in (f.completions, f.chat)]
        rows.append(f"| `{f.name}` | {cells[0]} | {cells[1]} | {f.doc} |")
    return "\n".join(rows) + "\n"


def _all(v: Any, kind: type) -> bool:
    return isinstance(v, list) and all(isinstance(x, kind) for x in v)


def _parse_fields(body: Any, table: dict[str, Use]) -> dict[str, Any]:
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


def _sampling_kwargs(fields: dict[str, Any], table: dict[str, Use]) -> tuple[dict[str, Any], dict[str, str]]:
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


def _check_model(frontend: Frontend, fields: dict[str, Any]) -> None:
    model = fields.get("model", frontend.model_name)
    if model != frontend.model_name:
        raise HTTPError(
            f"the model '{model}' does not exist: this server serves '{frontend.model_name}'",
            404,
            param="model",
            code="model_not_found",
        )


def _sampling_params(
    kwargs: dict[str, Any], sources: dict[str, str], max_tokens_field: str, max_tokens: int
) -> SamplingParams:
    if max_tokens < 1:
        raise HTTPError(f"'{max_tokens_field}' must be >= 1, got {max_tokens}", param=max_tokens_field)
    try:
        return SamplingParams(max_tokens=max_tokens, **kwargs)
    except RequestError as e:
        # SamplingParams' messages begin with the parameter at fault: name the field that set it.
        message = str(e)
        key = "structured_outputs" if message.startswith("structured") else message.split(" ", 1)[0]
        param = max_tokens_field if key == "max_tokens" else sources.get(key)
        if param is not None and param not in message:
            message = f"'{param}' is invalid: {message}"
        raise HTTPError(message, param=param) from e


def _completion_prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(is_int(t) for t in value):
            return [value]
        if _all(value, str) or all(isinstance(p, list) and all(is_int(t) for t in p) for p in value):
            return value
    raise HTTPError(
        "'prompt' must be a string, a list of token ids, or a non-empty list of strings or of token-id lists",
        param="prompt",
    )


def _chat_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise HTTPError("'messages' must be a non-empty list of messages", param="messages")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(f"'{where}' must be an object with 'role' and 'content'", param=where)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise HTTPError(f"'{where}' has an unsupported field '{extra[0]}'", param=f"{where}.{extra[0]}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise HTTPError(
                f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}", param=f"{where}.role"
            )
        message = {"role": role, "content": _message_text(m.get("content"), f"{where}.content")}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise HTTPError(f"'{where}.name' must be a string", param=f"{where}.name")
            message["name"] = m["name"]
        messages.append(message)
    return messages


def _message_text(content: Any, where: str) -> str:
    """A message's content as one string: text parts are joined by newlines, as vLLM does."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise HTTPError(
                    f"'{where}' has the part {json.dumps(part)}: only text parts (type 'text' with a string "
                    "'text') are supported",
                    param=where,
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise HTTPError(f"'{where}' must be a string or a list of text parts", param=where)


def render_chat(
    tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    documents: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation, by default ending with the assistant's turn opened."""
    template = None if tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            documents=documents,
            **(template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        # The request's own values (documents, template variables) reach the template.
        raise HTTPError(f"the chat template refused the messages: {e}", param="messages") from e


def _template_kwargs(tokenizer, fields: dict[str, Any]) -> dict[str, Any]:
    """The chat template's extra variables: chat_template_kwargs and reasoning_effort."""
    kwargs = dict(fields.get("chat_template_kwargs", {}))
    if kwargs:
        reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages", "conversation"}
        clash = sorted(kwargs.keys() & reserved)
        if clash:
            where = f"chat_template_kwargs.{clash[0]}"
            raise HTTPError(f"'{where}' is not a template variable: it is set by its own field", param=where)
    if "reasoning_effort" in fields:
        kwargs["reasoning_effort"] = fields["reasoning_effort"]
    return kwargs


# -- logprobs ------------------------------------------------------------------------------------
#
# Pure functions of the tokenizer and the engine's TokenLogprobs, as vLLM formats them: a token is
# named by decoding it alone (``tokenizer.decode([id])``, so a piece of a UTF-8 character is "\ufffd"),
# and -inf is written -9999.0, which JSON can carry.

_MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def token_text(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text decoded alone (a SentencePiece word-start token keeps
    its leading space, which decoding it alone drops), or ``token_id:<id>``."""
    if as_id:
        return f"token_id:{token_id}"
    text = tokenizer.decode([token_id]) or ""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
        text = " " * (len(piece) - len(piece.lstrip("\u2581"))) + text
    return text


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    num_top: int,
    text_offset: int = 0,
    as_ids: bool = False,
) -> dict[str, list]:
    """/v1/completions' ``logprobs`` of the tokens: for each, its text, its logprob and a map of the
    texts of it and the ``num_top`` likeliest tokens to their logprobs (None for a position without
    logprobs: the prompt's first), and ``text_offset``, where its text begins (``text_offset`` for
    the first, then each token's text length added, as vLLM counts)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, logprobs):
        token = token_text(tokenizer, token_id, as_ids)
        out["tokens"].append(token)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_logprob(entry.logprob))
        # The token first, then the likeliest (itself once if among them); tokens of the same
        # text share one key, the later one's value, as in vLLM.
        by_id = {token_id: entry.logprob}
        for top_id, value in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top]):
            by_id.setdefault(top_id, value)
        out["top_logprobs"].append({token_text(tokenizer, t, as_ids): _logprob(v) for t, v in by_id.items()})
    return out


def next_text_offset(logprobs: dict[str, list], text_offset: int) -> int:
    """Where the text of the token after ``logprobs``' last begins."""
    if not logprobs["tokens"]:
        return text_offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _chat_token(tokenizer, token_id: int, value: float, as_ids: bool) -> dict[str, Any]:
    token = token_text(tokenizer, token_id, as_ids)
    return {"token": token, "logprob": _logprob(value), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(tokenizer, logprobs: list[TokenLogprobs], num_top: int, as_ids: bool = False) -> dict[str, list]:
    """/v1/chat/completions' ``logprobs``: for each token its text, logprob, UTF-8 bytes (of the text,
    as vLLM gives them) and the ``num_top`` likeliest tokens, likeliest first."""
    content = []
    for entry in logprobs:
        item = _chat_token(tokenizer, entry.token_id, entry.logprob, as_ids)
        item["top_logprobs"] = [
            _chat_token(tokenizer, t, v, as_ids)
            for t, v in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])
        ]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(tokenizer, logprobs: list[TokenLogprobs | None]) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or a map of token id (a string,
    as JSON keys are) to ``{"logprob", "rank", "decoded_token"}``, for the prompt's token and then the
    likeliest."""
    out: list[dict[str, dict] | None] = []
    for entry in logprobs:
        if entry is None:
            out.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank)]
        ranked += [(t, v, rank) for rank, (t, v) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), 1)]
        position: dict[str, dict] = {}
        for token_id, value, rank in ranked:
            position.setdefault(
                str(token_id),
                {"logprob": _logprob(value), "rank": rank, "decoded_token": token_text(tokenizer, token_id)},
            )
        out.append(position)
    return out


# -- running a request ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    """One choice: its prompt (text or token ids), params, and the prompt's text as sent, if any."""

    prompt: str | list[int]
    params: SamplingParams
    text: str | None = None


@dataclasses.dataclass
class _Call:
    """A parsed request: one job per choice, in choice-index order, and how to answer."""

    chat: bool
    jobs: list[_Job]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    echo: bool = False
    logprobs: int | None = None  # top logprobs per output token; None: no logprobs
    prompt_logprobs: bool = False
    tokens_as_ids: bool = False
    request_id: str | None = None
    priority: int = 0


def _call(chat: bool, fields: dict[str, Any]) -> _Call:
    """The request-level fields both routes share."""
    n = fields.get("n", 1)
    if not 1 <= n <= MAX_N:
        raise HTTPError(f"'n' must be in [1, {MAX_N}], got {n}", param="n")
    best_of = fields.get("best_of", n)
    if best_of != n:
        raise HTTPError(
            f"'best_of' must equal 'n' ({n}), got {best_of}: this server draws no extra samples to rank",
            param="best_of",
        )
    stream = fields.get("stream", False)
    options = fields.get("stream_options") or {}
    if options and not stream:
        raise HTTPError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    extra = sorted(set(options) - set(STREAM_OPTIONS))
    if extra:
        raise HTTPError(f"unknown field 'stream_options.{extra[0]}'", param=f"stream_options.{extra[0]}")
    for name in STREAM_OPTIONS:
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise HTTPError(f"'stream_options.{name}' must be a boolean", param=f"stream_options.{name}")
    if stream and "prompt_logprobs" in fields:
        raise HTTPError("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")
    priority = fields.get("priority", 0)
    if not -(2**63) <= priority < 2**63:
        raise HTTPError(f"'priority' must be a 64-bit integer, got {priority}", param="priority")
    include_usage = bool(options.get("include_usage"))
    return _Call(
        chat,
        [],
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),  # as vLLM
        return_token_ids=fields.get("return_token_ids", False),
        prompt_logprobs="prompt_logprobs" in fields,
        tokens_as_ids=fields.get("return_tokens_as_token_ids", False),
        request_id=fields.get("request_id"),
        priority=priority,
    )


def _samples(prompts: list[tuple[str | list[int], str | None]], params: SamplingParams, n: int) -> list[_Job]:
    # Seeded samples of one prompt get consecutive seeds: the same seed would make them identical.
    return [
        _Job(prompt, params if params.seed is None else dataclasses.replace(params, seed=params.seed + i), text)
        for prompt, text in prompts
        for i in range(n)
    ]


def _truncation(kwargs: dict[str, Any], frontend: Frontend) -> None:
    if kwargs.get("truncate_prompt_tokens") == -1:  # vLLM's "the context's length"
        kwargs["truncate_prompt_tokens"] = frontend.max_model_len


def _parse_completion(frontend: Frontend, body: Any) -> _Call:
    fields = _parse_fields(body, COMPLETION_FIELDS)
    _check_model(frontend, fields)
    if "prompt" not in fields:
        raise HTTPError("'prompt' is required", param="prompt")
    prompts = _completion_prompts(fields["prompt"])
    call = _call(False, fields)
    call.echo = fields.get("echo", False)
    kwargs, sources = _sampling_kwargs(fields, COMPLETION_FIELDS)
    _truncation(kwargs, frontend)
    if call.echo and kwargs.get("logprobs") is not None:
        # The prompt's tokens come first in logprobs: compute theirs, with as many of the likeliest.
        kwargs.setdefault("prompt_logprobs", kwargs["logprobs"])
        sources.setdefault("prompt_logprobs", "logprobs")
    # No request can outgrow the context, and a bound keeps absurd values out of load estimates.
    max_tokens = min(fields.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS), frontend.max_model_len)
    params = _sampling_params(kwargs, sources, "max_tokens", max_tokens)
    call.logprobs = params.logprobs
    add_special_tokens = fields.get("add_special_tokens", True)
    jobs: list[tuple[str | list[int], str | None]] = []
    for prompt in prompts:
        if isinstance(prompt, str) and not add_special_tokens:
            jobs.append((frontend.tokenizer.encode(prompt, add_special_tokens=False), prompt))
        else:
            jobs.append((prompt, prompt if isinstance(prompt, str) else None))
    call.jobs = _samples(jobs, params, call.n)
    return call


def _parse_chat(frontend: Frontend, body: Any) -> _Call:
    fields = _parse_fields(body, CHAT_FIELDS)
    _check_model(frontend, fields)
    if "messages" not in fields:
        raise HTTPError("'messages' is required", param="messages")
    top_logprobs = fields.get("top_logprobs", 0)
    if not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise HTTPError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", param="top_logprobs")
    if top_logprobs and not fields.get("logprobs", False):
        raise HTTPError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    continue_final = fields.get("continue_final_message", False)
    add_generation_prompt = fields.get("add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise HTTPError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true", param="continue_final_message"
        )
    tokenizer = frontend.tokenizer
    text = render_chat(
        tokenizer,
        _chat_messages(fields["messages"]),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        documents=fields.get("documents"),
        template_kwargs=_template_kwargs(tokenizer, fields),
    )
    # The template writes any special tokens the model expects (BOS...): by default encoding adds none.
    prompt = tokenizer.encode(text, add_special_tokens=fields.get("add_special_tokens", False))
    call = _call(True, fields)
    kwargs, sources = _sampling_kwargs(fields, CHAT_FIELDS)
    _truncation(kwargs, frontend)
    if fields.get("logprobs", False):
        kwargs["logprobs"] = top_logprobs
        sources["logprobs"] = "top_logprobs"
    name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    if name in fields:
        max_tokens = min(fields[name], frontend.max_model_len)
    else:
        # The answer may fill the rest of the context; a prompt that leaves no room is refused by
        # the prompt's own check, with a message about its length rather than about max_tokens.
        max_tokens = max(1, frontend.max_request_tokens - len(prompt))
    params = _sampling_params(kwargs, sources, name, max_tokens)
    call.logprobs = params.logprobs
    call.jobs = _samples([(prompt, text)], params, call.n)
    return call


async def _run_choices(
    frontend: Frontend, request_id: str, jobs: list[_Job], priority: int = 0
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run the jobs concurrently, admitted together, and yield (choice index, output) as outputs
    come. The first error is raised; leaving early (or an error) cancels the jobs still running."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def run(index: int, job: _Job) -> None:
        try:
            outputs = frontend.generate(job.prompt, job.params, f"{request_id}-{index}", priority, admitted=True)
            async for output in outputs:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    with frontend.admission(len(jobs)):
        tasks = [asyncio.create_task(run(i, job)) for i, job in enumerate(jobs)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    running -= 1
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _usage(call: _Call, finals: dict[int, RequestOutput]) -> dict[str, int]:
    # A prompt is counted once however many samples it has.
    prompt = sum(len(out.prompt_token_ids) for i, out in finals.items() if i % call.n == 0)
    completion = sum(len(out.output_token_ids) for out in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice_usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.output_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Formatter:
    """Builds a call's choices and chunks; holds what streaming carries from chunk to chunk."""

    def __init__(self, call: _Call, tokenizer) -> None:
        self.call, self.tokenizer = call, tokenizer
        self.started: set[int] = set()
        self.text_offsets: dict[int, int] = {}
        self.prompt_entries: dict[int, list] = {}  # each choice's prompt logprobs, from whichever output has them
        self.prompt_logprobs: list | None = None  # chat's, answered once for the response

    def observe(self, index: int, output: RequestOutput) -> None:
        """Note what an output carries that later ones may not (the prompt's logprobs)."""
        if output.prompt_logprobs is not None:
            self.prompt_entries[index] = output.prompt_logprobs

    def _echo_text(self, index: int, output: RequestOutput) -> str:
        job = self.call.jobs[index]
        if job.text is not None and job.params.truncate_prompt_tokens is None:
            return job.text
        return self.tokenizer.decode(output.prompt_token_ids)

    def _logprobs(self, index: int, output: RequestOutput, entries: list | None, token_ids: list[int], echo: bool):
        """The choice's logprobs of ``token_ids`` (with the prompt's first when ``echo``), or None."""
        call = self.call
        if call.logprobs is None or entries is None:
            return None
        if call.chat:
            return chat_logprobs(self.tokenizer, entries, call.logprobs, call.tokens_as_ids)
        if echo:
            prompt_entries = self.prompt_entries.get(index) or [None] * len(output.prompt_token_ids)
            token_ids, entries = output.prompt_token_ids + token_ids, prompt_entries + entries
        offset = self.text_offsets.get(index, 0)
        logprobs = completion_logprobs(self.tokenizer, token_ids, entries, call.logprobs, offset, call.tokens_as_ids)
        self.text_offsets[index] = next_text_offset(logprobs, offset)
        return logprobs

    def _prompt_logprobs(self, index: int) -> list | None:
        entries = self.prompt_entries.get(index)
        return None if entries is None else prompt_logprobs_json(self.tokenizer, entries)

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        call = self.call
        text = output.text
        if call.echo:
            text = self._echo_text(index, output) + text
        if call.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": index, "text": text}
        logprobs = self._logprobs(index, output, output.logprobs, output.output_token_ids, call.echo)
        choice.update(logprobs=logprobs, finish_reason=output.finish_reason)
        if call.prompt_logprobs:
            if call.chat:
                self.prompt_logprobs = self.prompt_logprobs or self._prompt_logprobs(index)
            else:
                choice["prompt_logprobs"] = self._prompt_logprobs(index)
        if call.return_token_ids:
            choice.update(prompt_token_ids=output.prompt_token_ids, token_ids=output.output_token_ids)
        return choice

    def chunk_choice(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        """The streamed delta of one output; None when it adds nothing (text held back by the detokenizer)."""
        call = self.call
        first = index not in self.started
        self.started.add(index)
        tokens_wanted = (call.return_token_ids or call.logprobs is not None) and output.new_token_ids
        if not (first or output.new_text or output.finished or tokens_wanted):
            return None
        echo = first and call.echo
        text = (self._echo_text(index, output) if echo else "") + output.new_text
        if call.chat:
            delta = {"role": "assistant"} if first else {}
            if first or text:
                delta["content"] = text
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        logprobs = self._logprobs(index, output, output.new_logprobs, output.new_token_ids, echo)
        choice.update(logprobs=logprobs, finish_reason=output.finish_reason if output.finished else None)
        if call.return_token_ids:
            choice["token_ids"] = output.new_token_ids
            if first:
                choice["prompt_token_ids"] = output.prompt_token_ids
        return choice


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _respond(request: web.Request, frontend: Frontend, call: _Call) -> web.StreamResponse:
    prefix = "chatcmpl" if call.chat else "cmpl"
    internal_id = f"{prefix}-{uuid.uuid4().hex}"  # unique whatever id the client names the response
    response_id = f"{prefix}-{call.request_id}" if call.request_id is not None else internal_id
    head = {"id": response_id, "created": int(time.time()), "model": frontend.model_name}
    formatter = _Formatter(call, frontend.tokenizer)
    finals: dict[int, RequestOutput] = {}
    async with aclosing(_run_choices(frontend, internal_id, call.jobs, call.priority)) as outputs:
        if not call.stream:
            async for index, output in outputs:
                formatter.observe(index, output)
                if output.finished:
                    finals[index] = output
            choices = [formatter.choice(i, finals[i]) for i in range(len(call.jobs))]
            kind = "chat.completion" if call.chat else "text_completion"
            body = {**head, "object": kind, "choices": choices, "usage": _usage(call, finals)}
            if call.chat and call.prompt_logprobs:
                body["prompt_logprobs"] = formatter.prompt_logprobs
            return web.json_response(body)

        # Headers wait until every choice has its first output, so a refused prompt or an
        # overloaded server is a plain HTTP error rather than an event in a 200 stream.
        started: list[tuple[int, RequestOutput]] = []
        started_choices: set[int] = set()
        async for item in outputs:
            started.append(item)
            started_choices.add(item[0])
            if len(started_choices) == len(call.jobs):
                break
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head["object"] = "chat.completion.chunk" if call.chat else "text_completion"

        async def send(index: int, output: RequestOutput) -> None:
            formatter.observe(index, output)
            choice = formatter.chunk_choice(index, output)
            if output.finished:
                finals[index] = output
            if choice is not None:
                chunk = {**head, "choices": [choice]}
                if call.continuous_usage:
                    chunk["usage"] = _choice_usage(output)
                await response.write(_sse(chunk))

        try:
            for item in started:
                await send(*item)
            async for item in outputs:
                await send(*item)
            if call.include_usage:
                await response.write(_sse({**head, "choices": [], "usage": _usage(call, finals)}))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass  # the client left; closing `outputs` cancels its requests
        except Exception as e:
            error = HTTPError.of(e) if isinstance(e, ServingError) else _internal(e)
            with suppress(ConnectionError):
                await response.write(_sse(error.body()))
        return response


def _internal(error: Exception) -> HTTPError:
    logger.exception("internal error serving a request", exc_info=error)
    return HTTPError(f"internal error: {type(error).__name__}: {error}", 500, "internal_error")


# -- the application -----------------------------------------------------------------------------


def build_app(frontend: Frontend) -> web.Application:
    """The aiohttp application of the endpoint (routes in docs/openai.md)."""

    @web.middleware
    async def errors_and_auth(request: web.Request, handler) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/") or request.path == "/metrics":
                frontend.authenticate(request.headers.get("Authorization"))
            return await handler(request)
        except HTTPError as e:
            error = e
        except ServingError as e:
            error = HTTPError.of(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            error_type = "invalid_request_error" if e.status < 500 else "internal_error"
            error = HTTPError(f"{e.reason}: {request.method} {request.path}", e.status, error_type)
        except Exception as e:
            error = _internal(e)
        return web.json_response(error.body(), status=error.status)

    async def read_json(request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise HTTPError(f"the request body is not valid JSON: {e}") from e

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _respond(request, frontend, _parse_completion(frontend, await read_json(request)))

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _respond(request, frontend, _parse_chat(frontend, await read_json(request)))

    def model_card() -> dict[str, Any]:
        return {
            "id": frontend.model_name,
            "object": "model",
            "created": int(frontend.started),
            "owned_by": "distserve",
            "max_model_len": frontend.max_model_len,
        }

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card()]})

    async def model(request: web.Request) -> web.Response:
        _check_model(frontend, {"model": request.match_info["model"]})
        return web.json_response(model_card())

    async def health(request: web.Request) -> web.Response:
        if frontend.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "serving"})

    async def metrics(request: web.Request) -> web.Response:
        await frontend.info()  # refreshes the instance gauges
        return web.Response(body=frontend.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(middlewares=[errors_and_auth], client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_http_server(frontend: Frontend, config: ServerConfig) -> tuple[web.AppRunner, int]:
    """Serve the endpoint on config.host:config.http_port (over TLS when configured); returns the
    runner (``await runner.cleanup()`` stops it) and the bound port."""
    ssl_context = None
    if config.tls:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(config.tls_cert, config.tls_key)
    # A client that disconnects cancels its handler, and with it the requests it started.
    runner = web.AppRunner(build_app(frontend), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.http_port, ssl_context=ssl_context).start()
    except BaseException as e:
        await runner.cleanup()
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            raise port_in_use("HTTP", config.host, config.http_port) from None
        raise
    return runner, runner.addresses[0][1]
