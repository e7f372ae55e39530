"""What one streamed token costs the serving process: CPU time (user + system, every thread) of
`distserve launch` (orchestrator, HTTP and gRPC servers; not the instances' Ray workers) against
`vllm serve`'s API server process (not its EngineCore), divided by the tokens its clients got.
One run, the same model, requests and load for both, under this script's client and vLLM's own.

    python scripts/benchmarks/bench_serving_cpu.py                        # distserve, then vllm; both clients
    python scripts/benchmarks/bench_serving_cpu.py --servers distserve --clients ours   # where vLLM is not installed
    python scripts/benchmarks/bench_serving_cpu.py --streams 32 --output-len 128 --waves 4 --dtype float32

Model: the 58M dummy Llama (``llama-58m``, as bench_peer_serving.py), served by each system at its
own defaults unless ``--dtype``; distserve as 1 prefill + 1 decode instance. Load: ``--waves`` waves
of ``--streams`` requests at once, each a ``--input-len``-token prompt of token ids (distinct, so
none hits a prefix cache) streamed from ``/v1/completions`` (``stream: true``, ``ignore_eos``,
``--output-len`` tokens, ``include_usage``, ``return_token_ids``), sampled at temperature 1 with a
seed each. Most of the dummy weights' tokens are past the built-in tokenizer's vocabulary, of no
text, which distserve sends no event for unless their ids are asked for (vLLM sends one per token
either way): with ``return_token_ids`` both send an event per token, as for a real model's tokens.

``--clients`` (default ``ours,vllm``, in that order, each against every server): ``ours`` is the
load above from this process's aiohttp client; ``vllm`` is ``vllm bench serve`` (its random data
set of ``--input-len``/``--output-len`` tokens, ``ignore_eos``, ``--streams`` at once,
``--streams x --waves`` requests, ``return_token_ids`` as an extra body field, the same seed for
every server: vllm_bench_client.py). Neither client is pinned: each is a process of its own (ours
this one), where the OS puts it, and neither counts toward the serving process's CPU.

One wave of ours first warms the server up unmeasured, then its CPU use idle is read over
``--idle`` seconds. The serving process's CPU is read from ``/proc/PID/stat`` (and each of its
threads' from ``/proc/PID/task``) before the first measured wave and after the last (for vllm
bench: at its lines that start its main run and print its results); tokens delivered are the
usage's ``completion_tokens`` of every stream (checked against the tokens asked for; vllm bench's
``total_output_tokens``). ``--profile`` runs ``py-spy record`` on the serving process over each
client's load: its collapsed stacks (``py-spy-CLIENT.txt`` beside its log, a line per stack and
its samples) and the functions with the most samples, their own and with what they call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_peer_serving import DTYPES, MODEL, ran_as, start_server
from peer_clients import ServerProcess, client_env, executable, model_files
from vllm_bench_client import run_vllm_bench

SERVERS = {"distserve": "disaggregated", "vllm": "vllm"}  # this script's names -> bench_peer_serving's
CLIENTS = ("ours", "vllm")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU time of every thread of process ``pid`` (not its children); of one thread
    with ``PID/task/TID``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15


def num_threads(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[17])


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``'s threads by name (threads of one name added up)."""
    seconds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            name = (task / "comm").read_text().strip()
            seconds[name] = seconds.get(name, 0.0) + cpu_seconds(f"{pid}/task/{task.name}")
    return seconds


def prompt(i: int, length: int) -> list[int]:
    return [10 + (i * 7919 + j * 31) % 30000 for j in range(length)]  # distinct: no prefix-cache hits


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, int]:
    """(completion tokens the usage reports, SSE data events) of one streamed completion."""
    tokens = events = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            events += 1
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, events


async def waves(url: str, args: argparse.Namespace, first: int, count: int) -> tuple[int, int]:
    """``count`` waves of ``args.streams`` streams at once; (tokens, events) over all of them."""
    tokens = events = 0
    timeout = aiohttp.ClientTimeout(total=args.client_timeout)
    connector = aiohttp.TCPConnector(limit=args.streams)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for wave in range(first, first + count):
            bodies = [
                {"model": MODEL, "prompt": prompt(wave * args.streams + i, args.input_len),
                 "max_tokens": args.output_len, "ignore_eos": True, "temperature": 1.0, "seed": wave * args.streams + i,
                 "stream": True, "return_token_ids": True,
                 "stream_options": {"include_usage": True}}
                for i in range(args.streams)
            ]  # fmt: skip
            got, sent = await run_wave(session, url, bodies, args.output_len)
            tokens += got
            events += sent
    return tokens, events


async def run_wave(session: aiohttp.ClientSession, url: str, bodies: list[dict], output_len: int) -> tuple[int, int]:
    """The streams of ``bodies`` at once, each checked to deliver ``output_len`` tokens; (tokens, events)."""
    tokens = events = 0
    for got, sent in await asyncio.gather(*(stream(session, url, body) for body in bodies)):
        if got != output_len:
            raise RuntimeError(f"a stream delivered {got} tokens, not {output_len}")
        tokens += got
        events += sent
    return tokens, events


class Window:
    """The CPU seconds of process ``pid`` (in all and by thread) and the wall seconds between
    ``start()`` and ``stop()``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def start(self) -> None:
        self.cpu, self.threads, self.started = cpu_seconds(self.pid), thread_seconds(self.pid), time.monotonic()

    def stop(self) -> None:
        self.cpu, self.wall = cpu_seconds(self.pid) - self.cpu, time.monotonic() - self.started
        self.threads = {k: v - self.threads.get(k, 0.0) for k, v in thread_seconds(self.pid).items()}


def load(client: str, server: ServerProcess, args: argparse.Namespace, out: Path, env: dict[str, str]) -> dict:
    """``client``'s measured load on ``server``: the window's figures and the client's."""
    window = Window(server.process.pid)
    if client == "vllm":
        figures = run_vllm_bench(server.url, args, out, env, window.start, window.stop)
    else:
        window.start()
        tokens, events = asyncio.run(waves(server.url, args, 1, args.waves))
        window.stop()
        figures = {"tokens": tokens, "events": events, "client_tokens_per_s": tokens / window.wall}
    return {"cpu_s": window.cpu, "wall_s": window.wall, "thread_cpu_s": window.threads, **figures}


@contextlib.contextmanager
def profiling(pid: int, path: Path, enabled: bool):
    """``py-spy record`` of process ``pid``'s busy threads while the block runs, collapsed stacks to ``path``."""
    if not enabled:
        yield
        return
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    # --nonblocking: sampled without pausing it, so that the CPU measured stays its own.
    command = [spy, "record", "--pid", str(pid), "--rate", "500", "--format", "raw", "--nonblocking"]
    command += ["--output", str(path)]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(1)  # attached before the load starts
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)  # py-spy writes its output and exits
        recorder.wait(timeout=120)


def measure(name: str, args: argparse.Namespace, out: Path, env: dict[str, str]) -> list[dict]:
    """Server ``name`` under each of ``args.clients`` in turn: a row each."""
    server: ServerProcess = start_server(SERVERS[name], args, out / name, env)
    try:
        server.wait_ready(args.launch_timeout)
        ran = ran_as(server.log.read_text())
        pid = server.process.pid
        print(f"{name}: serving after {server.startup_s:.0f} s (pid {pid}); warming up", flush=True)
        asyncio.run(waves(server.url, args, 0, 1))
        idle = cpu_seconds(pid)
        time.sleep(args.idle)
        idle = cpu_seconds(pid) - idle
        rows = []
        for client in args.clients:
            with profiling(pid, out / name / f"py-spy-{client}.txt", args.profile):
                figures = load(client, server, args, out / name, env)
            row = {"server": name, "client": client, **ran, "process_threads": num_threads(pid), **figures,
                   "us_per_token": figures["cpu_s"] / figures["tokens"] * 1e6,
                   "idle_use": idle / args.idle}  # fmt: skip
            print(format_row(row), flush=True)
            print(f"{name}, {client} client: CPU seconds by thread over the measured load:")
            for thread, seconds in sorted(row["thread_cpu_s"].items(), key=lambda item: -item[1])[:12]:
                print(f"  {seconds:7.2f}  {thread}")
            if args.profile:
                print_profile(out / name / f"py-spy-{client}.txt")
            rows.append(row)
        return rows
    finally:
        server.stop()


def print_profile(path: Path, top: int = 25) -> None:
    """The functions with the most samples in py-spy's collapsed stacks: their own, and with what they call."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]  # a function, not a line
        total += int(count)
        own[frames[-1]] = own.get(frames[-1], 0) + int(count)
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + int(count)
    for title, counts in (("own samples", own), ("with what they call", inclusive)):
        print(f"\n{path}: {total} samples; {title}:")
        for frame, count in sorted(counts.items(), key=lambda item: -item[1])[:top]:
            print(f"  {count / total:6.1%}  {frame}")


HEADER = (
    "| serving process | client | dtype | its threads | tokens | SSE events | wall s | CPU s | CPU use (idle) "
    "| us/token | client tokens/s | client mean TPOT ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    tpot = f"{row['client_mean_tpot_ms']:.1f}" if "client_mean_tpot_ms" in row else "-"  # ours does not time tokens
    return (
        f"| {row['server']} | {row['client']} | {row['dtype']} | {row['process_threads']} | {row['tokens']} "
        f"| {row['events']} | {row['wall_s']:.1f} | {row['cpu_s']:.2f} "
        f"| {row['cpu_s'] / row['wall_s']:.0%} ({row['idle_use']:.1%}) | {row['us_per_token']:.0f} "
        f"| {row['client_tokens_per_s']:.0f} | {tpot} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="distserve,vllm", help="distserve, vllm or both, comma-separated")
    parser.add_argument("--clients", default="ours,vllm", help="ours, vllm (vllm bench serve) or both, comma-separated")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="serve in this dtype (default: each its own)")
    parser.add_argument("--streams", type=int, default=32, help="requests at once")
    parser.add_argument("--waves", type=int, default=4, help="measured waves of --streams requests")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--idle", type=float, default=5, help="seconds of idle CPU measured before the waves")
    parser.add_argument("--profile", action="store_true", help="py-spy record the serving process (SVG in --out)")
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--client-timeout", type=float, default=600, help="seconds a wave (vllm: its run) may take")
    parser.add_argument("--venvs", type=Path, default=Path.home() / "venvs")
    parser.add_argument("--out", type=Path, default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := [s for s in servers if s not in SERVERS]:
        parser.error(f"unknown servers {unknown}: choose from {', '.join(SERVERS)}")
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if unknown := [c for c in args.clients if c not in CLIENTS]:
        parser.error(f"unknown clients {unknown}: choose from {', '.join(CLIENTS)}")
    if "vllm" in servers + args.clients and executable(args.venvs, "vllm", "vllm") is None:
        where = f"no vllm in {args.venvs / 'vllm'} (docs/experiments/peer-clients.md)"
        parser.error(f"{where}: use --servers distserve --clients ours")
    out = args.out or Path(tempfile.mkdtemp(prefix="serving-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    args.tokenizer, args.api_key = model_files(MODEL, out)[0], None  # bench_peer_serving's start_server reads them
    rows = [row for name in servers for row in measure(name, args, out, client_env(args))]

    print(f"\n{args.waves} waves of {args.streams} streams at once, {args.input_len}-token prompts, "
          f"{args.output_len} tokens each (ignore_eos), {MODEL}; logs in {out}\n")  # fmt: skip
    print(HEADER)
    for row in rows:
        print(format_row(row))
    us = {(row["server"], row["client"]): row["us_per_token"] for row in rows}
    if len(servers) == 2:
        for client in args.clients:
            ratio = us[servers[0], client] / us[servers[1], client]
            print(f"\n{client} client: {servers[0]} / {servers[1]}: {ratio:.2f}")
    print("\nwhere each put its threads, as its log says:")
    for row in {row["server"]: row for row in rows}.values():
        print(f"  {row['server']}: {row['threads'] or 'no line on its threads'}")
    (out / "table.json").write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
