"""What one streamed token costs the serving process: CPU time (user + system, every thread) of
`distserve launch` (orchestrator, HTTP and gRPC servers; not the instances' Ray workers) against
`vllm serve`'s API server process (not its EngineCore), divided by the tokens its clients got.
One run, the same model, requests and load for both.

    python scripts/benchmarks/bench_serving_cpu.py                        # distserve, then vllm
    python scripts/benchmarks/bench_serving_cpu.py --servers distserve    # where vLLM is not installed
    python scripts/benchmarks/bench_serving_cpu.py --streams 32 --output-len 128 --waves 4 --dtype float32

Model: the 58M dummy Llama (``llama-58m``, as bench_peer_serving.py), served by each system at its
own defaults unless ``--dtype``; distserve as 1 prefill + 1 decode instance. Load: ``--waves`` waves
of ``--streams`` requests at once, each a ``--input-len``-token prompt of token ids (distinct, so
none hits a prefix cache) streamed from ``/v1/completions`` (``stream: true``, ``ignore_eos``,
``--output-len`` tokens, ``include_usage``, ``return_token_ids``), sampled at temperature 1 with a
seed each. Most of the dummy weights' tokens are past the built-in tokenizer's vocabulary, of no
text, which distserve sends no event for unless their ids are asked for (vLLM sends one per token
either way): with ``return_token_ids`` both send an event per token, as for a real model's tokens.

One wave first warms the server up unmeasured, then its CPU use idle is read over ``--idle``
seconds. The serving process's CPU is read from ``/proc/PID/stat`` (and each of its threads' from
``/proc/PID/task``) before the first measured wave and after the last; tokens delivered are the
usage's ``completion_tokens`` of every stream (checked against the tokens asked for).
``--profile`` runs ``py-spy record`` on the serving process over the measured waves: its
collapsed stacks (``py-spy.txt`` beside its log, a line per stack and its samples) and the
functions with the most samples, their own and with what they call.
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

SERVERS = {"distserve": "disaggregated", "vllm": "vllm"}  # this script's names -> bench_peer_serving's
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


def measure(name: str, args: argparse.Namespace, out: Path, env: dict[str, str]) -> dict:
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
        with profiling(pid, out / name / "py-spy.txt", args.profile):
            cpu, threads, started = cpu_seconds(pid), thread_seconds(pid), time.monotonic()
            tokens, events = asyncio.run(waves(server.url, args, 1, args.waves))
            cpu, wall = cpu_seconds(pid) - cpu, time.monotonic() - started
            threads = {k: v - threads.get(k, 0.0) for k, v in thread_seconds(pid).items()}
        row = {"server": name, **ran, "process_threads": num_threads(pid), "tokens": tokens, "events": events,
               "cpu_s": cpu, "wall_s": wall, "us_per_token": cpu / tokens * 1e6, "idle_use": idle / args.idle,
               "thread_cpu_s": threads}  # fmt: skip
        print(format_row(row), flush=True)
        print(f"{name}: CPU seconds by thread over the measured waves:")
        for thread, seconds in sorted(threads.items(), key=lambda item: -item[1])[:12]:
            print(f"  {seconds:7.2f}  {thread}")
        if args.profile:
            print_profile(out / name / "py-spy.txt")
        return row
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
    "| serving process | dtype | its threads | tokens | SSE events | wall s | CPU s | CPU use (idle) | us/token |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    return (
        f"| {row['server']} | {row['dtype']} | {row['process_threads']} | {row['tokens']} | {row['events']} "
        f"| {row['wall_s']:.1f} | {row['cpu_s']:.2f} | {row['cpu_s'] / row['wall_s']:.0%} ({row['idle_use']:.1%}) "
        f"| {row['us_per_token']:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="distserve,vllm", help="distserve, vllm or both, comma-separated")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="serve in this dtype (default: each its own)")
    parser.add_argument("--streams", type=int, default=32, help="requests at once")
    parser.add_argument("--waves", type=int, default=4, help="measured waves of --streams requests")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--idle", type=float, default=5, help="seconds of idle CPU measured before the waves")
    parser.add_argument("--profile", action="store_true", help="py-spy record the serving process (SVG in --out)")
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--client-timeout", type=float, default=600, help="seconds a wave may take")
    parser.add_argument("--venvs", type=Path, default=Path.home() / "venvs")
    parser.add_argument("--out", type=Path, default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := [s for s in servers if s not in SERVERS]:
        parser.error(f"unknown servers {unknown}: choose from {', '.join(SERVERS)}")
    if "vllm" in servers and executable(args.venvs, "vllm", "vllm") is None:
        parser.error(f"no vllm in {args.venvs / 'vllm'} (docs/experiments/peer-clients.md): use --servers distserve")
    out = args.out or Path(tempfile.mkdtemp(prefix="serving-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    args.tokenizer, args.api_key = model_files(MODEL, out)[0], None  # bench_peer_serving's start_server reads them
    rows = [measure(name, args, out, client_env(args)) for name in servers]

    print(f"\n{args.waves} waves of {args.streams} streams at once, {args.input_len}-token prompts, "
          f"{args.output_len} tokens each (ignore_eos), {MODEL}; logs in {out}\n")  # fmt: skip
    print(HEADER)
    for row in rows:
        print(format_row(row))
    if len(rows) == 2:
        print(f"\n{rows[0]['server']} / {rows[1]['server']}: {rows[0]['us_per_token'] / rows[1]['us_per_token']:.2f}")
    print("\nwhere each put its threads, as its log says:")
    for row in rows:
        print(f"  {row['server']}: {row['threads'] or 'no line on its threads'}")
    (out / "table.json").write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
