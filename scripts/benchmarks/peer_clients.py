"""Run the clients people already use against distserve's OpenAI-compatible server, and say what fails.

    # against a server already running (its /v1 routes at URL), with the model's tokenizer directory
    python scripts/benchmarks/peer_clients.py --url http://127.0.0.1:8000 --model tiny-llama
    # or start `distserve launch` here, run the clients, stop it
    python scripts/benchmarks/peer_clients.py --launch disaggregated            # 1 prefill + 1 decode instance
    python scripts/benchmarks/peer_clients.py --launch colocated                # 1 colocated instance
    python scripts/benchmarks/peer_clients.py --launch colocated --launch-model llama-58m   # the 58M dummy Llama

Clients, each run as a subprocess from a virtualenv of its own (docs/experiments/peer-clients.md,
"Install", has the install commands), chosen with ``--clients a,b,...`` (default all):

    vllm-completions  vllm bench serve --backend vllm: streamed /v1/completions, random dataset
    vllm-chat         vllm bench serve --backend openai-chat --endpoint /v1/chat/completions
    guidellm          guidellm run: streamed /v1/chat/completions, synthetic_text data, constant rate
    lm-eval-mc        lm_eval --model local-completions on scripts/benchmarks/lm_eval_task's distserve_tiny_mc:
                      64 log-likelihood requests (token-id prompts, echo: true, logprobs: 1)
    lm-eval-gen       the same 16 questions as distserve_tiny_gen: generation with stop strings

Every client talks to the server through a recording pass-through proxy on 127.0.0.1, so the counts
are the same for all of them whatever each prints: requests sent (POSTs to /v1/...), failed (an
HTTP status other than 200, or a stream that carried an error event) and the first error body.
For the first request refused with 400, the script then replays it to the server, dropping the
field each 400 names, until it is accepted: that lists every field of the request the server
refuses, not only the first. Other routes a client probes (/tokenize, /tokenizer_info, ...) are
listed with their status; a 404 there is not a failure, as each client goes on without them.

Options: ``--num-prompts 20 --request-rate 4 --input-len 32 --output-len 16`` size the load of
the three benchmark clients (lm-eval's is its task's: 64 + 16 requests); ``--vllm-extra=
"--temperature 0 --top-k 5 --logprobs 2 ..."`` adds flags to both vllm runs; ``--client-timeout``
bounds each client's run (seconds); ``--venvs DIR`` is where the virtualenvs are (DIR/vllm,
DIR/guidellm, DIR/lmeval; default ~/venvs, else the executables on PATH); ``--out DIR`` keeps the
clients' logs and results and, per client, every exchange as JSON lines (CLIENT.jsonl: request
body, status, response body or the first and last stream events); ``--tokenizer DIR`` when the
model is not a built-in tiny one or a local directory; ``--api-key`` (or $DISTSERVE_API_KEY) when
the server has one. The launched server listens on free loopback ports and is stopped at the end.

Exit status: 0 when every chosen client ran, exited 0 and had every request succeed; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

HERE = Path(__file__).resolve().parent
TASK_DIR = HERE / "lm_eval_task"
CLIENTS = ("vllm-completions", "vllm-chat", "guidellm", "lm-eval-mc", "lm-eval-gen")
DEPLOYMENTS = {
    "disaggregated": ["--prefill-instances", "1", "--decode-instances", "1"],
    "colocated": ["--colocated-instances", "1"],
}
# Headers that belong to one hop, or that would make the recorded bodies compressed.
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
_KEEP_EVENTS = 4  # stream events kept at each end of a recorded stream


# -- the recording proxy ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What one client sent through the proxy and what came back."""

    sent: int = 0
    failed: int = 0
    statuses: Counter = field(default_factory=Counter)
    first_error: str | None = None
    first_refused: tuple[str, dict] | None = None  # (path, body) of the first 400
    other_routes: Counter = field(default_factory=Counter)  # (method, path, status)
    client_left: int = 0  # streams the client closed before their end
    capture: object | None = None  # an open JSONL file, or None

    def record(self, method: str, path: str, body: object, status: int, error: str | None, response: object) -> None:
        if self.capture is not None:
            entry = {"method": method, "path": path, "body": body, "status": status, "response": response}
            self.capture.write(json.dumps(entry) + "\n")
            self.capture.flush()
        if not (method == "POST" and path.startswith("/v1/")):
            self.other_routes[(method, path.split("?")[0], status)] += 1
            return
        self.sent += 1
        self.statuses[status] += 1
        if isinstance(response, dict) and response.get("client_left"):
            self.client_left += 1
        if error is not None:
            self.failed += 1
            if self.first_error is None:
                self.first_error = f"{status} {error}"
            if status == 400 and self.first_refused is None and isinstance(body, dict):
                self.first_refused = (path, body)


def _stream_error(event: str) -> str | None:
    """The event's data when it is an error event (``data: {"error": ...}``), else None."""
    data = event.strip()
    if not data.startswith("data:"):
        return None
    data = data[len("data:") :].strip()
    if data == "[DONE]":
        return None
    try:
        parsed = json.loads(data)
    except ValueError:
        return f"not JSON: {data[:200]}"
    return data if isinstance(parsed, dict) and "error" in parsed else None


class RecordingProxy:
    """An HTTP pass-through on 127.0.0.1 to ``upstream`` that records into ``self.tally``."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.tally = Tally()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, name="recording-proxy", daemon=True).start()
        ready.wait()
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=900))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        tally = self.tally  # the client's, even if the next client starts while this one finishes
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw[:2000].decode(errors="replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        method, path = request.method, request.path_qs
        try:
            upstream = await self._session.request(method, self.upstream + path, data=raw, headers=headers)
        except aiohttp.ClientError as e:
            tally.record(method, path, body, 502, f"proxy could not reach the server: {e!r}", None)
            return web.json_response({"error": {"message": f"proxy: {e!r}"}}, status=502)
        async with upstream:
            ctype = upstream.headers.get("Content-Type", "")
            if "text/event-stream" not in ctype:
                data = await upstream.read()
                text = data.decode(errors="replace")
                try:
                    recorded = json.loads(text)
                except ValueError:
                    recorded = text[:4000]
                error = None if upstream.status == 200 else text[:2000]
                tally.record(method, path, body, upstream.status, error, recorded)
                return web.Response(status=upstream.status, body=data, headers={"Content-Type": ctype} if ctype else {})
            response = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            buffer, head, tail, count, error, done, client_left = "", [], [], 0, None, False, False
            try:
                async for chunk in upstream.content.iter_any():
                    buffer += decoder.decode(chunk)
                    while "\n\n" in buffer:
                        event, buffer = buffer.split("\n\n", 1)
                        count += 1
                        (head if len(head) < _KEEP_EVENTS else tail).append(event)
                        del tail[:-_KEEP_EVENTS]
                        error = error or _stream_error(event)
                        done = done or event.strip() == "data: [DONE]"
                    try:
                        await response.write(chunk)
                    except ConnectionError:
                        client_left = True  # the client's choice (cancelled, or done reading): not a failure
                        break
            except aiohttp.ClientError as e:
                error = error or f"the server's stream broke: {e!r}"
            if not client_left:
                with contextlib.suppress(ConnectionError):
                    await response.write_eof()
                if buffer.strip():
                    tail.append(buffer)
                    error = error or f"stream ended inside an event: {buffer[:200]!r}"
                if not done:
                    error = error or "stream ended without 'data: [DONE]'"
            if error is None and upstream.status != 200:
                error = "\n\n".join(head)[:2000]
            recorded = {"events": count, "first": head, "last": tail, "client_left": client_left}
            tally.record(method, path, body, upstream.status, error, recorded)
            return response


# -- what the server refuses -----------------------------------------------------------------------


def _post(url: str, body: dict, api_key: str | None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def refused_fields(server: str, path: str, body: dict, api_key: str | None, limit: int = 12) -> list[str]:
    """Replay a refused request, dropping the field each 400 names, until it is accepted.

    One line per refusal (``field: message``), then how the last attempt ended."""
    body = json.loads(json.dumps(body))
    lines = []
    for _ in range(limit):
        status, text = _post(server + path, body, api_key)
        if status != 400:
            outcome = "accepted" if status == 200 else f"then {status}: {text[:300]}"
            lines.append(f"without them: {outcome}")
            return lines
        try:
            error = json.loads(text)["error"]
            param, message = error.get("param"), error.get("message")
        except (ValueError, KeyError, TypeError, AttributeError):
            lines.append(f"400 with a body that is not an OpenAI error: {text[:300]}")
            return lines
        lines.append(f"{param}: {message}")
        top, _, sub = (param or "").partition(".")
        if sub and isinstance(body.get(top), dict) and sub in body[top]:
            body[top] = {k: v for k, v in body[top].items() if k != sub}
        elif not sub and top in body:
            del body[top]
        else:
            lines.append("(the field it names is not in the request: stopping)")
            return lines
    lines.append(f"(stopped after {limit} refusals)")
    return lines


# -- the server ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, api_key: str | None, timeout: float = 5) -> object:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def model_files(name: str, out: Path) -> tuple[str, list[str]]:
    """(tokenizer directory, --model and the flags it needs) of a model: llama-58m (written to
    ``out`` with the built-in tokenizer, served with dummy weights), a local directory, a built-in
    tiny model or a preset (which distserve serves with the tiny models' tokenizer)."""
    from distserve.model_executor.model_loader import find_model_preset
    from distserve.model_executor.tiny_models import (
        BENCH_LLAMA_SHAPE,
        TINY_MODELS,
        ensure_tiny_model,
        write_llama_shape,
    )

    if name == "llama-58m":
        directory = write_llama_shape(out / "llama-58m", **BENCH_LLAMA_SHAPE)
        return str(directory), [str(directory), "--load-format", "dummy", "--served-model-name", "llama-58m"]
    if Path(name).expanduser().is_dir():
        return name, [name]
    if name.lower() in TINY_MODELS:
        return str(ensure_tiny_model(name.lower())), [name]
    if find_model_preset(name) is not None:
        return str(ensure_tiny_model(TINY_MODELS[0])), [name, "--load-format", "dummy"]
    raise SystemExit(f"no tokenizer known for model '{name}': pass --tokenizer DIR")


class ServerProcess:
    """A server started as a process group of its own; ready once ``ready()`` says so."""

    name = "server"

    def __init__(self, command: list[str], url: str, log: Path, env: dict[str, str] | None = None) -> None:
        self.url, self.log = url, log
        self.startup_s: float | None = None  # from the start to ready
        self._started = time.monotonic()
        with log.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def ready(self) -> bool:
        try:
            return bool(get_json(self.url + "/v1/models", None).get("data"))
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.process.returncode}: see {self.log}")
            if self.ready():
                self.startup_s = time.monotonic() - self._started
                return
            time.sleep(1)
        raise SystemExit(f"{self.name} did not serve within {timeout:.0f} s: see {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # drains, then stops its workers
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class LaunchedServer(ServerProcess):
    """``distserve launch`` on free loopback ports."""

    name = "distserve launch"

    def __init__(self, deployment: str, model: str, extra: list[str], out: Path, api_key: str | None) -> None:
        self.tokenizer, model_flags = model_files(model, out)
        self.model = "llama-58m" if model == "llama-58m" else model
        http_port, grpc_port = free_port(), free_port()
        command = [sys.executable, "-c", "import sys; from distserve.cli import main; sys.exit(main())", "launch"]
        command += ["--model", *model_flags, *DEPLOYMENTS[deployment], "--host", "127.0.0.1"]
        command += ["--port", str(http_port), "--grpc-port", str(grpc_port), "--drain-timeout", "5", *extra]
        if api_key:
            command += ["--api-key", api_key]
        print(f"launching: distserve {' '.join(command[4:])}", flush=True)
        super().__init__(command, f"http://127.0.0.1:{http_port}", out / "server.log")

    def ready(self) -> bool:
        try:
            return get_json(self.url + "/health", None).get("status") == "serving"
        except (OSError, ValueError):
            return False


# -- the clients -----------------------------------------------------------------------------------


def executable(venvs: Path, venv: str, name: str) -> str | None:
    candidate = venvs / venv / "bin" / name
    return str(candidate) if candidate.exists() else shutil.which(name)


def client_command(name: str, args: argparse.Namespace, proxy: str, out: Path, max_model_len: int) -> list[str] | None:
    n, rate, inp, outp = args.num_prompts, args.request_rate, args.input_len, args.output_len
    if name.startswith("vllm-"):
        exe = executable(args.venvs, "vllm", "vllm")
        backend = ["--backend", "vllm"] if name == "vllm-completions" else ["--backend", "openai-chat"]
        endpoint = "/v1/completions" if name == "vllm-completions" else "/v1/chat/completions"
        return exe and [
            exe, "bench", "serve", *backend, "--base-url", proxy, "--endpoint", endpoint,
            "--model", args.model, "--tokenizer", args.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len", str(outp),
            "--num-prompts", str(n), "--request-rate", str(rate), "--seed", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json",
            *shlex.split(args.vllm_extra),
        ]  # fmt: skip
    if name == "guidellm":
        exe = executable(args.venvs, "guidellm", "guidellm")
        backend = f"kind=openai_http,target={proxy},model={args.model},request_format=/v1/chat/completions"
        if args.api_key:
            backend += f",api_key={args.api_key}"
        return exe and [
            exe, "run", "--backend", backend, "--profile", f"kind=constant,rate={rate}",
            "--constraint", f"kind=max_requests,count={n}",
            "--constraint", f"kind=max_duration,seconds={max(10, int(args.client_timeout * 0.8))}",
            "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={inp},output_tokens={outp}",
            "--output", f"kind=json,path={out / 'guidellm.json'}", "--disable-console-interactive",
        ]  # fmt: skip
    exe = executable(args.venvs, "lmeval", "lm_eval") or executable(args.venvs, "lmeval", "lm-eval")
    model_args = ",".join(
        [
            f"model={args.model}",
            f"base_url={proxy}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={args.tokenizer}",
            "tokenized_requests=True",  # token-id prompts: the server's echo lines up with the tokenizer's
            "num_concurrent=1",
            "max_retries=1",
            f"max_length={max_model_len}",
        ]
    )
    task = "distserve_tiny_mc" if name == "lm-eval-mc" else "distserve_tiny_gen"
    return exe and [
        exe, "--model", "local-completions", "--model_args", model_args, "--include_path", str(TASK_DIR),
        "--tasks", task, "--output_path", str(out / name),
    ]  # fmt: skip


def client_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",  # the CPU build of vLLM, for its platform check
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("VIRTUAL_ENV", None)
    if args.api_key:
        env["OPENAI_API_KEY"] = args.api_key  # vllm bench serve and lm-eval send it as a bearer key
    return env


def run_client(command: list[str], log: Path, env: dict[str, str], timeout: float) -> int:
    with log.open("w") as out:
        out.write(" ".join(command) + "\n\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return 124


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", choices=sorted(DEPLOYMENTS), help="start `distserve launch` with this deployment")
    parser.add_argument("--model", default=None, help="model name the server serves (default: asked from /v1/models)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--launch-model", default="tiny-llama", help="tiny-llama, another tiny model, llama-58m or DIR")
    parser.add_argument(
        "--launch-arg", action="append", default=[], help="a flag for distserve launch: --launch-arg=--flag=value"
    )
    parser.add_argument("--launch-timeout", type=float, default=900, help="seconds to wait for the server")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated, of {', '.join(CLIENTS)}")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--vllm-extra", default="", help="vllm bench serve flags: --vllm-extra='--top-k 5'")
    parser.add_argument("--client-timeout", type=float, default=600, help="seconds each client may run")
    parser.add_argument("--venvs", type=Path, default=Path.home() / "venvs")
    parser.add_argument("--out", type=Path, default=None, help="directory for logs, results and exchanges")
    parser.add_argument("--api-key", default=os.environ.get("DISTSERVE_API_KEY"))
    args = parser.parse_args(argv)

    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown:
        parser.error(f"unknown clients {unknown}: choose from {', '.join(CLIENTS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="peer-clients-"))
    out.mkdir(parents=True, exist_ok=True)

    server = None
    try:
        if args.launch:
            server = LaunchedServer(args.launch, args.launch_model, args.launch_arg, out, args.api_key)
            server.wait_ready(args.launch_timeout)
            url = server.url
            args.tokenizer = args.tokenizer or server.tokenizer
        else:
            url = args.url.rstrip("/").removesuffix("/v1")
        card = get_json(url + "/v1/models", args.api_key)["data"][0]
        args.model = args.model or card["id"]
        max_model_len = int(card.get("max_model_len") or 2048)
        if args.tokenizer is None:
            args.tokenizer = model_files(args.model, out)[0]
        print(f"server {url}, model {args.model}, tokenizer {args.tokenizer}; logs in {out}", flush=True)

        proxy = RecordingProxy(url)
        proxy_url = proxy.start()
        env = client_env(args)
        results = []
        try:
            for name in clients:
                command = client_command(name, args, proxy_url, out, max_model_len)
                if command is None:
                    print(f"{name}: not installed (see docs/experiments/peer-clients.md)", flush=True)
                    results.append((name, None, Tally(), []))
                    continue
                tally = Tally(capture=(out / f"{name}.jsonl").open("w"))
                proxy.tally = tally
                print(f"{name}: {' '.join(command)}", flush=True)
                started = time.monotonic()
                rc = run_client(command, out / f"{name}.log", env, args.client_timeout)
                time.sleep(0.5)  # let the proxy record a response still being written
                tally.capture.close()
                print(f"{name}: exit {rc} after {time.monotonic() - started:.0f} s", flush=True)
                refusals = refused_fields(url, *tally.first_refused, args.api_key) if tally.first_refused else []
                results.append((name, rc, tally, refusals))
        finally:
            proxy.stop()
    finally:
        if server is not None:
            server.stop()

    return report(results, out)


def report(results: list, out: Path) -> int:
    print(f"\n{'client':<18}{'sent':>6}{'failed':>8}{'exit':>6}  first error")
    ok = True
    for name, rc, tally, _ in results:
        good = rc == 0 and tally.sent > 0 and tally.failed == 0
        ok &= good
        exit_text = "-" if rc is None else str(rc)
        error = tally.first_error or ("" if rc is not None else "not installed")
        if rc is not None and tally.sent == 0:
            error = error or f"sent no request: see {out / (name + '.log')}"
        print(f"{name:<18}{tally.sent:>6}{tally.failed:>8}{exit_text:>6}  {error[:600]}")
    for name, _, tally, refusals in results:
        if refusals:
            print(f"\n{name}: fields of its first refused request, as the server refuses them one by one:")
            for line in refusals:
                print(f"  {line}")
        others = [f"{m} {p} -> {s} (x{k})" for (m, p, s), k in sorted(tally.other_routes.items())]
        if others:
            print(f"{name}: other routes: {'; '.join(others)}")
        if tally.client_left:
            print(f"{name}: closed {tally.client_left} streams before their end (its own choice, not a failure)")
    print(f"\nlogs, results and exchanges: {out}")
    return 0 if ok and results else 1


if __name__ == "__main__":
    sys.exit(main())
