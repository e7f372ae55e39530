"""The OpenAI-compatible HTTP endpoint: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, plus ``/health`` and ``/metrics``, in front of a ``Frontend``. The request fields,
extensions and error bodies are described in docs/openai.md."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
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
from distserve.core.outputs import RequestOutput
from distserve.core.sampling_params import SamplingParams
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


_INT = ("an integer", is_int)
_NUMBER = ("a finite number", is_number)
_BOOL = ("a boolean", lambda v: isinstance(v, bool))
_STRING = ("a string", lambda v: isinstance(v, str))
_OBJECT = ("an object", lambda v: isinstance(v, dict))
_ANY = ("anything", lambda v: True)  # checked by the handler itself

_SAMPLING_FIELDS = {
    "model": _STRING,
    "n": _INT,
    "max_tokens": _INT,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "seed": _INT,
    "stop": ("a string or a list of strings", lambda v: isinstance(v, str) or _all(v, str)),
    "stream": _BOOL,
    "stream_options": _OBJECT,
    "user": _STRING,  # accepted and ignored, as it only identifies the end user to OpenAI
    # vLLM's extensions
    "top_k": _INT,
    "ignore_eos": _BOOL,
    "stop_token_ids": ("a list of integers", lambda v: isinstance(v, list) and all(is_int(t) for t in v)),
    "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL,
    "return_token_ids": _BOOL,
}
COMPLETION_FIELDS = {**_SAMPLING_FIELDS, "prompt": _ANY}
CHAT_FIELDS = {**_SAMPLING_FIELDS, "messages": _ANY, "max_completion_tokens": _INT}

# Fields this server does not implement, each with the values that leave the result unchanged
# (null always does): any other value is refused rather than silently ignored.
_PENALTIES: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": lambda v: v == 0,
    "presence_penalty": lambda v: v == 0,
    "logit_bias": lambda v: v == {},
}
COMPLETION_UNSUPPORTED = {
    **_PENALTIES,
    "logprobs": lambda v: False,  # even 0 asks for the sampled token's logprob
    "echo": lambda v: v is False,
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
}
CHAT_UNSUPPORTED = {
    **_PENALTIES,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: v == 0,
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "response_format": lambda v: v == {"type": "text"},
}


def _all(v: Any, kind: type) -> bool:
    return isinstance(v, list) and all(isinstance(x, kind) for x in v)


def _parse_fields(
    body: Any, known: dict[str, tuple[str, Callable[[Any], bool]]], unsupported: dict[str, Callable[[Any], bool]]
) -> dict[str, Any]:
    """The body's fields with a value (null means the default), each checked for its type."""
    if not isinstance(body, dict):
        raise HTTPError(f"the request body must be a JSON object, got {type(body).__name__}")
    fields = {}
    for name, value in body.items():
        if name in unsupported:
            if value is not None and not unsupported[name](value):
                raise HTTPError(f"'{name}' is not supported by this server", param=name)
        elif name not in known:
            raise HTTPError(f"unknown field '{name}'", param=name)
        elif value is not None:
            what, ok = known[name]
            if not ok(value):
                raise HTTPError(f"'{name}' must be {what}, got {json.dumps(value)}", param=name)
            fields[name] = value
    return fields


def _check_model(frontend: Frontend, fields: dict[str, Any]) -> None:
    model = fields.get("model", frontend.model_name)
    if model != frontend.model_name:
        raise HTTPError(
            f"the model '{model}' does not exist: this server serves '{frontend.model_name}'",
            404,
            param="model",
            code="model_not_found",
        )


def _sampling_params(fields: dict[str, Any], max_tokens_field: str, max_tokens: int) -> SamplingParams:
    if max_tokens < 1:
        raise HTTPError(f"'{max_tokens_field}' must be >= 1, got {max_tokens}", param=max_tokens_field)
    top_k = fields.get("top_k", 0)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=fields.get("temperature", 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" -1
            top_p=fields.get("top_p", 1.0),
            seed=fields.get("seed"),
            stop=fields.get("stop", []),
            stop_token_ids=fields.get("stop_token_ids", []),
            ignore_eos=fields.get("ignore_eos", False),
            include_stop_str_in_output=fields.get("include_stop_str_in_output", False),
            skip_special_tokens=fields.get("skip_special_tokens", True),
        )
    except RequestError as e:
        raise HTTPError(str(e)) from e


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


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text of a conversation, ending with the assistant's turn."""
    template = None if tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except TemplateError as e:
        raise HTTPError(f"the chat template refused the messages: {e}", param="messages") from e


# -- running a request ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Call:
    """A parsed request: one job (prompt, params) per choice, in choice-index order."""

    chat: bool
    jobs: list[tuple[str | list[int], SamplingParams]]
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool


def _common(fields: dict[str, Any]) -> tuple[int, bool, bool, bool]:
    """(n, stream, include_usage, return_token_ids) of a request."""
    n = fields.get("n", 1)
    if not 1 <= n <= MAX_N:
        raise HTTPError(f"'n' must be in [1, {MAX_N}], got {n}", param="n")
    stream = fields.get("stream", False)
    options = fields.get("stream_options")
    if options is not None and not stream:
        raise HTTPError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    options = options or {}
    extra = sorted(set(options) - {"include_usage"})
    if extra:
        raise HTTPError(f"unknown field 'stream_options.{extra[0]}'", param=f"stream_options.{extra[0]}")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise HTTPError("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
    return n, stream, include_usage, fields.get("return_token_ids", False)


def _samples(prompts: list, params: SamplingParams, n: int) -> list[tuple[str | list[int], SamplingParams]]:
    # Seeded samples of one prompt get consecutive seeds: the same seed would make them identical.
    return [
        (prompt, params if params.seed is None else dataclasses.replace(params, seed=params.seed + i))
        for prompt in prompts
        for i in range(n)
    ]


def _parse_completion(frontend: Frontend, body: Any) -> _Call:
    fields = _parse_fields(body, COMPLETION_FIELDS, COMPLETION_UNSUPPORTED)
    _check_model(frontend, fields)
    if "prompt" not in fields:
        raise HTTPError("'prompt' is required", param="prompt")
    prompts = _completion_prompts(fields["prompt"])
    n, stream, include_usage, return_token_ids = _common(fields)
    # No request can outgrow the context, and a bound keeps absurd values out of load estimates.
    max_tokens = min(fields.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS), frontend.max_model_len)
    params = _sampling_params(fields, "max_tokens", max_tokens)
    return _Call(False, _samples(prompts, params, n), n, stream, include_usage, return_token_ids)


def _parse_chat(frontend: Frontend, body: Any) -> _Call:
    fields = _parse_fields(body, CHAT_FIELDS, CHAT_UNSUPPORTED)
    _check_model(frontend, fields)
    if "messages" not in fields:
        raise HTTPError("'messages' is required", param="messages")
    tokenizer = frontend.tokenizer
    # The template writes any special tokens the model expects (BOS...); encoding must not add them again.
    prompt = tokenizer.encode(render_chat(tokenizer, _chat_messages(fields["messages"])), add_special_tokens=False)
    n, stream, include_usage, return_token_ids = _common(fields)
    name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    if name in fields:
        max_tokens = min(fields[name], frontend.max_model_len)
    else:
        # The answer may fill the rest of the context; a prompt that leaves no room is refused by
        # the prompt's own check, with a message about its length rather than about max_tokens.
        max_tokens = max(1, frontend.max_request_tokens - len(prompt))
    params = _sampling_params(fields, name, max_tokens)
    return _Call(True, _samples([prompt], params, n), n, stream, include_usage, return_token_ids)


async def _run_choices(
    frontend: Frontend, request_id: str, jobs: list[tuple[str | list[int], SamplingParams]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run the jobs concurrently, admitted together, and yield (choice index, output) as outputs
    come. The first error is raised; leaving early (or an error) cancels the jobs still running."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def run(index: int, prompt: str | list[int], params: SamplingParams) -> None:
        try:
            async for output in frontend.generate(prompt, params, f"{request_id}-{index}", admitted=True):
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    with frontend.admission(len(jobs)):
        tasks = [asyncio.create_task(run(i, prompt, params)) for i, (prompt, params) in enumerate(jobs)]
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


def _choice(call: _Call, index: int, output: RequestOutput) -> dict[str, Any]:
    if call.chat:
        choice = {"index": index, "message": {"role": "assistant", "content": output.text}}
    else:
        choice = {"index": index, "text": output.text}
    choice.update(logprobs=None, finish_reason=output.finish_reason)
    if call.return_token_ids:
        choice.update(prompt_token_ids=output.prompt_token_ids, token_ids=output.output_token_ids)
    return choice


def _chunk_choice(call: _Call, index: int, output: RequestOutput, first: bool) -> dict[str, Any] | None:
    """The streamed delta of one output; None when it adds nothing (text held back by the detokenizer)."""
    new_ids = call.return_token_ids and output.new_token_ids
    if not (first or output.new_text or output.finished or new_ids):
        return None
    if call.chat:
        delta = {"role": "assistant"} if first else {}
        if first or output.new_text:
            delta["content"] = output.new_text
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": output.new_text}
    choice.update(logprobs=None, finish_reason=output.finish_reason if output.finished else None)
    if call.return_token_ids:
        choice["token_ids"] = output.new_token_ids
        if first:
            choice["prompt_token_ids"] = output.prompt_token_ids
    return choice


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _respond(request: web.Request, frontend: Frontend, call: _Call) -> web.StreamResponse:
    request_id = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": frontend.model_name}
    finals: dict[int, RequestOutput] = {}
    async with aclosing(_run_choices(frontend, request_id, call.jobs)) as outputs:
        if not call.stream:
            async for index, output in outputs:
                if output.finished:
                    finals[index] = output
            choices = [_choice(call, i, finals[i]) for i in range(len(call.jobs))]
            kind = "chat.completion" if call.chat else "text_completion"
            return web.json_response({**head, "object": kind, "choices": choices, "usage": _usage(call, finals)})

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
        seen: set[int] = set()

        async def send(index: int, output: RequestOutput) -> None:
            choice = _chunk_choice(call, index, output, index not in seen)
            seen.add(index)
            if output.finished:
                finals[index] = output
            if choice is not None:
                await response.write(_sse({**head, "choices": [choice]}))

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
