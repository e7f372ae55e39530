"""The tokens per second the serving tier carries with 1, 2 and 4 API servers (``--api-servers``),
and what each streamed token costs the serving processes together (the CPU of every API server,
as ``/metrics`` reports it: ``distserve_api_server_cpu_seconds``).

    python scripts/benchmarks/bench_api_servers.py [--api-servers 1,2,4] [--streams 128] [--waves 3]

The tiny model (``tiny-llama``, float32, 1 prefill + 1 decode) makes tokens fast at large batches,
so the serving tier, not the instances, is what a wave waits on where it can be. Load: ``--waves``
waves of ``--streams`` streamed completions at once over HTTP, each on a connection of its own so
that the kernel spreads them over the servers sharing the port, after one wave of warm-up. Prints
per server count: tokens delivered, wall seconds, tokens/s (and its ratio to one server), the
serving processes' CPU seconds and CPU per token, and the client's own CPU per token. On a machine
of few cores the instances, the servers and the client share them: the figures say where that
bounds the tokens/s (the processes' CPU use against the cores there are).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from bench_serving_cpu import run_wave
from peer_clients import LaunchedServer

MODEL = "tiny-llama"
VOCAB = 1024
CPU_METRIC = re.compile(r'^distserve_api_server_cpu_seconds\{server="(\d+)"\} (\S+)$', re.M)


def server_cpu(url: str, servers: int, timeout: float = 30.0) -> dict[str, float]:
    """Each API server's CPU seconds as ``/metrics`` lists them, once it lists every server."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            found = {index: float(seconds) for index, seconds in CPU_METRIC.findall(response.read().decode())}
        if len(found) == servers or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def prompt(i: int, length: int) -> list[int]:
    return [3 + (i * 7919 + j * 31) % (VOCAB - 3) for j in range(length)]  # distinct: no prefix-cache hits


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def waves(url: str, args: argparse.Namespace, first: int, count: int) -> int:
    """``count`` waves of ``args.streams`` streams at once, each on a new connection; tokens delivered."""
    tokens = 0
    timeout = aiohttp.ClientTimeout(total=args.client_timeout)
    for wave in range(first, first + count):
        connector = aiohttp.TCPConnector(limit=args.streams, force_close=True)  # a connection per stream
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            bodies = [
                {"model": MODEL, "prompt": prompt(wave * args.streams + i, args.input_len),
                 "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
                for i in range(args.streams)
            ]  # fmt: skip
            tokens += (await run_wave(session, url, bodies, args.output_len))[0]
    return tokens


def measure(servers: int, args: argparse.Namespace, out: Path) -> dict:
    flags = ["--dtype", "float32", "--api-servers", str(servers), "--max-pending-requests", str(4 * args.streams)]
    (out / f"servers-{servers}").mkdir(parents=True, exist_ok=True)
    server = LaunchedServer("disaggregated", MODEL, flags, out / f"servers-{servers}", None)
    try:
        server.wait_ready(args.launch_timeout)
        asyncio.run(waves(server.url, args, 0, 1))  # warm-up
        time.sleep(2)  # every server's status reported since
        before, client_before, started = server_cpu(server.url, servers), client_cpu(), time.monotonic()
        tokens = asyncio.run(waves(server.url, args, 1, args.waves))
        wall = time.monotonic() - started
        time.sleep(2)
        after, client = server_cpu(server.url, servers), client_cpu() - client_before
        cpu = {index: after[index] - before.get(index, 0.0) for index in after}
        return {"servers": servers, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                "cpu_s": cpu, "us_per_token": sum(cpu.values()) / tokens * 1e6,
                "client_us_per_token": client / tokens * 1e6}  # fmt: skip
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-servers", default="1,2,4", help="server counts to run, comma-separated")
    parser.add_argument("--streams", type=int, default=128, help="streams at once")
    parser.add_argument("--waves", type=int, default=3, help="measured waves")
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--launch-timeout", type=float, default=600)
    parser.add_argument("--client-timeout", type=float, default=900, help="seconds a wave may take")
    parser.add_argument("--out", type=Path, default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="api-servers-"))
    rows = [measure(int(n), args, out) for n in args.api_servers.split(",")]
    print(f"\n{args.waves} waves of {args.streams} streams at once, {args.input_len}-token prompts, {args.output_len} "
          f"tokens each, {MODEL} float32, 1 prefill + 1 decode; {os.cpu_count()} cores; logs in {out}\n")  # fmt: skip
    print("| API servers | tokens | wall s | tokens/s | x 1 server | servers' CPU s (each) | us/token "
          "| client us/token |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    base = rows[0]["tokens_per_s"]
    for r in rows:
        each = ", ".join(f"{r['cpu_s'][i]:.1f}" for i in sorted(r["cpu_s"]))
        print(f"| {r['servers']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / base:.2f} | {sum(r['cpu_s'].values()):.1f} ({each}) | {r['us_per_token']:.0f} | "
              f"{r['client_us_per_token']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
