"""A request body to the ``Call`` the server runs: the body's fields checked against the field table
(``openai_fields``), the prompts, and one ``Job`` (prompt and SamplingParams) per choice. Parsing
tokenizes and renders chat templates: the server runs it on the input workers (``Frontend.off_loop``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from distserve.core.errors import RequestError
from distserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from distserve.entrypoints.frontend import Frontend
from distserve.entrypoints.openai_chat import chat_prompt
from distserve.entrypoints.openai_errors import HTTPError
from distserve.entrypoints.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    is_ints,
    parse_fields,
    refuse_unknown,
    sampling_kwargs,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


@dataclasses.dataclass
class Job:
    """One prompt: its text or token ids, params (``n`` samples: that many choices), and the
    prompt's text as sent, if any."""

    prompt: str | list[int]
    params: SamplingParams
    text: str | None = None


@dataclasses.dataclass
class Call:
    """A parsed request: one job per prompt, each of ``n`` choices, in choice-index order, and how
    to answer."""

    chat: bool
    jobs: list[Job]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    echo: bool = False
    logprobs: int | None = None  # top logprobs per output token; None: no logprobs
    prompt_logprobs: bool = False
    tokens_as_ids: bool = False
    beam_search: bool = False  # use_beam_search: each job's n choices are its beams
    request_id: str | None = None
    priority: int = 0

    @property
    def num_choices(self) -> int:
        return len(self.jobs) * self.n


def check_model(frontend: Frontend, model: str) -> None:
    """Refuse, as OpenAI does (404), a model this server does not serve."""
    if model != frontend.model_name:
        raise HTTPError(
            f"the model '{model}' does not exist: this server serves '{frontend.model_name}'",
            404,
            param="model",
            code="model_not_found",
        )


def parse_completion(frontend: Frontend, body: Any) -> Call:
    """A /v1/completions body as its call: a job per prompt and sample."""
    fields = parse_fields(body, COMPLETION_FIELDS)
    check_model(frontend, fields.get("model", frontend.model_name))
    if "prompt" not in fields:
        raise HTTPError("'prompt' is required", param="prompt")
    prompts = _completion_prompts(fields["prompt"])
    for prompt in prompts:  # before any of them is tokenized here
        check_prompt(frontend, prompt, "prompt")
    call = _call(False, fields)
    call.echo = fields.get("echo", False)
    kwargs, sources = sampling_kwargs(fields, COMPLETION_FIELDS)
    _truncation(kwargs, frontend)
    _defaults(kwargs, frontend)
    if call.echo and kwargs.get("logprobs") is not None:
        # The prompt's tokens come first in logprobs: compute theirs, with as many of the likeliest.
        kwargs.setdefault("prompt_logprobs", kwargs["logprobs"])
        sources.setdefault("prompt_logprobs", "logprobs")
    # The model's max_new_tokens is not read here: a completion leaving max_tokens out asks for 16,
    # as in vLLM (whose null, unlike this server's, would read it). The limits bound the rest.
    max_tokens = fields.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    params = _sampling_params(frontend, kwargs, sources, "max_tokens", max_tokens, call)
    call.logprobs = params.logprobs
    add_special_tokens = fields.get("add_special_tokens", True)
    jobs: list[tuple[str | list[int], str | None]] = []
    for prompt in prompts:
        if isinstance(prompt, str) and not add_special_tokens:
            jobs.append((frontend.tokenizer.encode(prompt, add_special_tokens=False), prompt))
        else:
            jobs.append((prompt, prompt if isinstance(prompt, str) else None))
    call.jobs = [Job(prompt, params, text) for prompt, text in jobs]
    return call


def parse_chat(frontend: Frontend, body: Any) -> Call:
    """A /v1/chat/completions body as its call: the conversation rendered to one prompt, a job per sample."""
    fields = parse_fields(body, CHAT_FIELDS)
    check_model(frontend, fields.get("model", frontend.model_name))
    if "messages" not in fields:
        raise HTTPError("'messages' is required", param="messages")
    top_logprobs = fields.get("top_logprobs", 0)
    if not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise HTTPError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", param="top_logprobs")
    if top_logprobs and not fields.get("logprobs", False):
        raise HTTPError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    text = chat_prompt(frontend.tokenizer, fields)
    check_prompt(frontend, text, "messages")  # before it is tokenized here
    # The template writes any special tokens the model expects (BOS...): by default encoding adds none.
    prompt = frontend.tokenizer.encode(text, add_special_tokens=fields.get("add_special_tokens", False))
    call = _call(True, fields)
    kwargs, sources = sampling_kwargs(fields, CHAT_FIELDS)
    _truncation(kwargs, frontend)
    _defaults(kwargs, frontend)
    if fields.get("logprobs", False):
        kwargs["logprobs"] = top_logprobs
        sources["logprobs"] = "top_logprobs"
    name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    if name in fields:
        max_tokens = fields[name]
    else:
        # The answer may fill the rest of the context (or the model's max_new_tokens, if less), within
        # the limit; a prompt that leaves no room is refused by the prompt's own check, with a message
        # about its length rather than about max_tokens.
        room = max(1, frontend.max_request_tokens - len(prompt))
        max_tokens = min(room, frontend.sampling_defaults.get("max_tokens", room), frontend.limits.max_tokens)
    params = _sampling_params(frontend, kwargs, sources, name, max_tokens, call)
    call.logprobs = params.logprobs
    call.jobs = [Job(prompt, params, text)]
    return call


def _call(chat: bool, fields: dict[str, Any]) -> Call:
    """The call of the request-level fields both routes share; its jobs come later."""
    n = fields.get("n", 1)  # checked with the other sampling params, against the cluster's limit
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
    refuse_unknown(options, STREAM_OPTIONS, "stream_options")
    for name in STREAM_OPTIONS:
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise HTTPError(f"'stream_options.{name}' must be a boolean", param=f"stream_options.{name}")
    if stream and "prompt_logprobs" in fields:
        raise HTTPError("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")
    priority = fields.get("priority", 0)
    if not -(2**63) <= priority < 2**63:
        raise HTTPError(f"'priority' must be a 64-bit integer, got {priority}", param="priority")
    include_usage = bool(options.get("include_usage"))
    return Call(
        chat,
        [],
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),  # as vLLM
        return_token_ids=fields.get("return_token_ids", False),
        prompt_logprobs="prompt_logprobs" in fields,
        tokens_as_ids=fields.get("return_tokens_as_token_ids", False),
        beam_search=fields.get("use_beam_search", False),
        request_id=fields.get("request_id"),
        priority=priority,
    )


def _completion_prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if is_ints(value):
            return [value]
        if all(isinstance(p, str) for p in value) or all(is_ints(p) for p in value):
            return value
    raise HTTPError(
        "'prompt' must be a string, a list of token ids, or a non-empty list of strings or of token-id lists",
        param="prompt",
    )


def _truncation(kwargs: dict[str, Any], frontend: Frontend) -> None:
    if kwargs.get("truncate_prompt_tokens") == -1:  # vLLM's "the context's length"
        kwargs["truncate_prompt_tokens"] = frontend.max_model_len


def _defaults(kwargs: dict[str, Any], frontend: Frontend) -> None:
    """The model's sampling defaults for the fields the body left out (absent or null), as vLLM's
    ``to_sampling_params``; max_tokens is each route's own."""
    for key, value in frontend.sampling_defaults.items():
        if key != "max_tokens":
            kwargs.setdefault(key, value)


def check_prompt(frontend: Frontend, prompt: str | list[int], field: str) -> None:
    """The cluster's prompt limit, checked before this server tokenizes the prompt itself; over it,
    a 400 naming ``field``."""
    try:
        frontend.limits.check_prompt(prompt)
    except RequestError as e:
        raise HTTPError(str(e), param=field) from e


def _sampling_params(
    frontend: Frontend,
    kwargs: dict[str, Any],
    sources: dict[str, str],
    max_tokens_field: str,
    max_tokens: int,
    call: Call,
) -> SamplingParams:
    """The SamplingParams of the keywords for the call's ``n`` samples, or with ``use_beam_search``
    its beam search of ``n`` beams, within the cluster's limits; a value they refuse is answered
    naming the field that set it."""
    if max_tokens < 1:
        raise HTTPError(f"'{max_tokens_field}' must be >= 1, got {max_tokens}", param=max_tokens_field)
    if call.beam_search:
        # Only what the body sets: the model's sampling defaults pick among tokens, which beams do not.
        kwargs = {key: value for key, value in kwargs.items() if key in sources}
        kwargs["beam_width"], sources["beam_width"] = call.n, "n"
    else:  # vLLM ignores them without beam search
        kwargs.pop("length_penalty", None)
        kwargs.pop("early_stopping", None)
    try:
        params = SamplingParams(max_tokens=max_tokens, n=call.n, **kwargs)
        frontend.limits.check_params(params)
        return params
    except RequestError as e:
        # SamplingParams' and the limits' messages begin with the parameter at fault: name the field that set it.
        message = str(e)
        key = "structured_outputs" if message.startswith("structured") else message.split(" ", 1)[0]
        param = max_tokens_field if key == "max_tokens" else {**sources, "n": "n"}.get(key)
        if param is not None and param not in message:
            message = f"'{param}' is invalid: {message}"
        raise HTTPError(message, param=param) from e
