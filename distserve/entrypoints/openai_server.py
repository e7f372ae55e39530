"""The OpenAI-compatible HTTP endpoint: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, plus ``/health`` and ``/metrics``, in front of a ``Frontend``: a parsed call's
choices run together, answered whole or streamed as server-sent events. The request fields,
extensions and error bodies are described in docs/openai.md."""

from __future__ import annotations

import asyncio
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

from distserve.core.outputs import RequestOutput
from distserve.entrypoints.errors import ServingError
from distserve.entrypoints.frontend import Frontend
from distserve.entrypoints.openai_errors import HTTPError
from distserve.entrypoints.openai_logprobs import (
    chat_logprobs,
    completion_logprobs,
    next_text_offset,
    prompt_logprobs_json,
)
from distserve.entrypoints.openai_protocol import Call, Job, check_model, check_prompt, parse_chat, parse_completion
from distserve.entrypoints.preflight import port_in_use
from distserve.entrypoints.prometheus import CONTENT_TYPE
from distserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger(__name__)

SERVER_HEADER = "X-DistServe-Server"
MAX_BODY_BYTES = 32 * 2**20  # room for batches of token-id prompts


async def _run_choices(
    frontend: Frontend, request_id: str, jobs: list[Job], priority: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run the jobs concurrently, admitted together (each of its ``n`` samples counted), and yield
    (choice index, output) as outputs come: job i's samples are choices i*n to i*n+n-1. The first
    error is raised; leaving early (or an error) cancels the jobs still running."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def run(index: int, job: Job) -> None:
        n = job.params.n
        try:
            outputs = frontend.generate(job.prompt, job.params, f"{request_id}-{index}", priority, admitted=True)
            async for output in outputs:
                queue.put_nowait((index * n + output.index, output))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    with frontend.admission(sum(job.params.n for job in jobs)):
        if len(jobs) == 1:  # one prompt (most calls): its outputs as they come, with no task and queue between
            job = jobs[0]
            async with aclosing(frontend.generate(job.prompt, job.params, f"{request_id}-0", priority, True)) as outs:
                async for output in outs:
                    yield output.index, output
            return
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


def _usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """OpenAI's usage: ``cached`` is the prompt tokens whose KV was found (prefix cache or tier),
    None where the server does not report them (``server.enable_prompt_tokens_details``)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _call_usage(call: Call, finals: dict[int, RequestOutput], cached: bool) -> dict[str, Any]:
    # A prompt is counted once however many samples it has.
    prompts = [out for i, out in finals.items() if i % call.n == 0]
    completion = sum(out.num_output_tokens for out in finals.values())
    num_cached = sum(out.num_cached_tokens for out in prompts) if cached else None
    return _usage(sum(len(out.prompt_token_ids) for out in prompts), completion, num_cached)


def _choice_usage(output: RequestOutput, cached: bool) -> dict[str, Any]:
    num_cached = output.num_cached_tokens if cached else None
    return _usage(len(output.prompt_token_ids), output.num_output_tokens, num_cached)


class _Formatter:
    """Builds a call's choices and chunks; holds what streaming carries from chunk to chunk."""

    def __init__(self, call: Call, tokenizer) -> None:
        self.call, self.tokenizer = call, tokenizer
        self.started: set[int] = set()
        self.text_offsets: dict[int, int] = {}
        # Each prompt's logprobs (by job: a prompt's n samples share them), from the output that has them.
        self.prompt_entries: dict[int, list] = {}
        self.prompt_logprobs: list | None = None  # chat's, answered once for the response

    def observe(self, index: int, output: RequestOutput) -> None:
        """Note what an output carries that later ones may not (the prompt's logprobs)."""
        if output.prompt_logprobs is not None:
            self.prompt_entries[index // self.call.n] = output.prompt_logprobs

    def _echo_text(self, index: int, output: RequestOutput) -> str:
        job = self.call.jobs[index // self.call.n]
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
            prompt_entries = self.prompt_entries.get(index // call.n) or [None] * len(output.prompt_token_ids)
            token_ids, entries = output.prompt_token_ids + token_ids, prompt_entries + entries
        offset = self.text_offsets.get(index, 0)
        logprobs = completion_logprobs(self.tokenizer, token_ids, entries, call.logprobs, offset, call.tokens_as_ids)
        self.text_offsets[index] = next_text_offset(logprobs, offset)
        return logprobs

    def _prompt_logprobs(self, index: int) -> list | None:
        entries = self.prompt_entries.get(index // self.call.n)
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
        if output.cumulative_logprob is not None:  # a beam of a beam search
            choice["cumulative_logprob"] = output.cumulative_logprob
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
        if output.finished and output.cumulative_logprob is not None:  # a beam, whole at the end
            choice["cumulative_logprob"] = output.cumulative_logprob
        return choice


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _respond(request: web.Request, frontend: Frontend, call: Call) -> web.StreamResponse:
    prefix = "chatcmpl" if call.chat else "cmpl"
    internal_id = f"{prefix}-{uuid.uuid4().hex}"  # unique whatever id the client names the response
    response_id = f"{prefix}-{call.request_id}" if call.request_id is not None else internal_id
    head = {"id": response_id, "created": int(time.time()), "model": frontend.model_name}
    formatter = _Formatter(call, frontend.tokenizer)
    cached = frontend.config.enable_prompt_tokens_details
    finals: dict[int, RequestOutput] = {}
    async with aclosing(_run_choices(frontend, internal_id, call.jobs, call.priority)) as outputs:
        if not call.stream:
            async for index, output in outputs:
                formatter.observe(index, output)
                if output.finished:
                    finals[index] = output
            choices = [formatter.choice(i, finals[i]) for i in range(call.num_choices)]
            kind = "chat.completion" if call.chat else "text_completion"
            body = {**head, "object": kind, "choices": choices, "usage": _call_usage(call, finals, cached)}
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
            if len(started_choices) == call.num_choices:
                break
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head["object"] = "chat.completion.chunk" if call.chat else "text_completion"
        # Every chunk is {**head, "choices": [choice]} (and its usage): the head is encoded once.
        chunk_head = f"data: {json.dumps(head)[:-1]}, " + '"choices": ['

        async def send(index: int, output: RequestOutput) -> None:
            formatter.observe(index, output)
            choice = formatter.chunk_choice(index, output)
            if output.finished:
                finals[index] = output
            if choice is not None:
                usage = f', "usage": {json.dumps(_choice_usage(output, cached))}' if call.continuous_usage else ""
                await response.write(f"{chunk_head}{json.dumps(choice)}]{usage}}}\n\n".encode())

        try:
            for item in started:
                await send(*item)
            async for item in outputs:
                await send(*item)
            if call.include_usage:
                await response.write(_sse({**head, "choices": [], "usage": _call_usage(call, finals, cached)}))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass  # the client left; closing `outputs` cancels its requests
        except Exception as e:
            error = _http_error(e)
            with suppress(ConnectionError):
                await response.write(_sse(error.body()))
        return response


def _http_error(error: Exception) -> HTTPError:
    """The answer to an error: its own, a ServingError's, or else an internal error (a bug: logged)."""
    if isinstance(error, HTTPError):
        return error
    if isinstance(error, ServingError):
        return HTTPError.of(error)
    logger.exception("internal error serving a request", exc_info=error)
    return HTTPError(f"internal error: {type(error).__name__}: {error}", 500, "internal_error")


# -- the application -----------------------------------------------------------------------------
# Bodies are parsed, and /tokenize's and /detokenize's answers written, on the input workers'
# threads (``Frontend.off_loop``): megabytes of JSON or of tokens would hold the loop.


def _load_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise HTTPError(f"the request body is not valid JSON: {e}") from e


def _json_response(text: str) -> web.Response:
    return web.Response(text=text, content_type="application/json")


def _tokenize(frontend: Frontend, raw: bytes) -> str:
    body = _load_json(raw)
    fields = body if isinstance(body, dict) else {}
    prompt, special = fields.get("prompt"), fields.get("add_special_tokens", True)
    if not isinstance(prompt, str) or not isinstance(special, bool):
        raise HTTPError("'/tokenize' takes {'prompt': text, 'add_special_tokens': bool}", param="prompt")
    check_model(frontend, fields.get("model", frontend.model_name))
    check_prompt(frontend, prompt, "prompt")
    tokens = frontend.tokenizer.encode(prompt, add_special_tokens=special)
    return json.dumps({"count": len(tokens), "max_model_len": frontend.max_model_len, "tokens": tokens})


def _detokenize(frontend: Frontend, raw: bytes) -> str:
    body = _load_json(raw)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list):
        raise HTTPError("'/detokenize' takes {'tokens': [token ids]}", param="tokens")
    check_model(frontend, body.get("model", frontend.model_name))
    return json.dumps({"prompt": frontend.detokenize(tokens)})


def build_app(frontend: Frontend) -> web.Application:
    """The aiohttp application of the endpoint (routes in docs/openai.md)."""

    @web.middleware
    async def errors_and_auth(request: web.Request, handler) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/") or request.path in ("/metrics", "/tokenize", "/detokenize"):
                frontend.authenticate(request.headers.get("Authorization"))
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            error_type = "invalid_request_error" if e.status < 500 else "internal_error"
            error = HTTPError(f"{e.reason}: {request.method} {request.path}", e.status, error_type)
        except Exception as e:
            error = _http_error(e)
        return web.json_response(error.body(), status=error.status)

    async def call(request: web.Request, parse: Callable[[Frontend, Any], Call]) -> Call:
        """The body's call, parsed on the input workers: a body of megabytes, its prompts'
        tokens and a chat template's rendering would hold the loop every stream is served from."""
        raw = await request.read()
        return await frontend.off_loop(lambda: parse(frontend, _load_json(raw)))

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _respond(request, frontend, await call(request, parse_completion))

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _respond(request, frontend, await call(request, parse_chat))

    def model_card() -> dict[str, Any]:
        return {
            "id": frontend.model_name,
            "object": "model",
            "created": int(frontend.started),
            "owned_by": "distserve",
            "max_model_len": frontend.max_model_len,
            # What a request's left-out sampling fields default to: the model's generation config's.
            "default_sampling_params": frontend.sampling_defaults,
        }

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card()]})

    async def model(request: web.Request) -> web.Response:
        check_model(frontend, request.match_info["model"])
        return web.json_response(model_card())

    async def tokenize(request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a prompt's token ids (benchmark clients align lengths with it)."""
        raw = await request.read()
        return _json_response(await frontend.off_loop(_tokenize, frontend, raw))

    async def detokenize(request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: the text of token ids."""
        raw = await request.read()
        return _json_response(await frontend.off_loop(_detokenize, frontend, raw))

    async def health(request: web.Request) -> web.Response:
        if frontend.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "serving"})

    async def metrics(request: web.Request) -> web.Response:
        await frontend.info()  # refreshes the instance gauges
        return web.Response(body=frontend.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(middlewares=[errors_and_auth], client_max_size=MAX_BODY_BYTES)

    async def name_the_server(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[SERVER_HEADER] = str(frontend.server_index)  # which of the cluster's API servers

    app.on_response_prepare.append(name_the_server)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_http_server(
    frontend: Frontend, config: ServerConfig, shared_port: bool = False
) -> tuple[web.AppRunner, int]:
    """Serve the endpoint on config.host:config.http_port (over TLS when configured); returns the
    runner (``await runner.cleanup()`` stops it) and the bound port. ``shared_port``: with the
    cluster's other API servers (SO_REUSEPORT)."""
    ssl_context = None
    if config.tls:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(config.tls_cert, config.tls_key)
    # A client that disconnects cancels its handler, and with it the requests it started.
    runner = web.AppRunner(build_app(frontend), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(
            runner, config.host, config.http_port, ssl_context=ssl_context, reuse_port=shared_port or None
        ).start()
    except BaseException as e:
        await runner.cleanup()
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            raise port_in_use("HTTP", config.host, config.http_port) from None
        raise
    return runner, runner.addresses[0][1]
