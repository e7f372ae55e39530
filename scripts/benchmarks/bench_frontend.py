"""What the serving frontends cost: the same requests sent to one 1 prefill + 1 decode cluster
in process (``AsyncCluster.generate``, the baseline), through the gRPC client and through the
OpenAI HTTP API with SSE streaming. Clients run in a process of their own, as real ones do.

    python scripts/benchmarks/bench_frontend.py [--model tiny-llama] [--requests 20] [--concurrency 16]

Prints client-side TTFT and TPOT of one request at a time, and output tokens/s with
``--concurrency`` streams at once, each path as a ratio to the in-process baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

PROMPT_TOKENS = 64
MAX_TOKENS = 32


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + j) % 500 for j in range(PROMPT_TOKENS)]  # distinct: no prefix-cache hits


async def _timed(stream) -> tuple[float, list[float]]:
    """(TTFT, token arrival times) of one request whose outputs ``stream`` yields."""
    start = time.perf_counter()
    times = []
    async for new_tokens in stream:
        times.extend([time.perf_counter() - start] * new_tokens)
    return times[0], times


async def _grpc_tokens(client, i: int):
    async for chunk in client.generate(_prompt(i), max_tokens=MAX_TOKENS, ignore_eos=True):
        yield len(chunk.token_ids)


async def _http_tokens(session, url: str, i: int):
    body = {
        "prompt": _prompt(i),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                yield len(choice.get("token_ids") or [])


async def _measure(make_stream, requests: int, concurrency: int) -> dict:
    """Sequential requests for latency, then ``concurrency`` at a time for throughput."""
    ttfts, tpots = [], []
    for i in range(requests):
        ttft, times = await _timed(make_stream(i))
        ttfts.append(ttft)
        tpots.append((times[-1] - times[0]) / (len(times) - 1))
    start = time.perf_counter()
    runs = await asyncio.gather(*(_timed(make_stream(requests + i)) for i in range(concurrency * 2)))
    tokens = sum(len(times) for _, times in runs)
    return {
        "ttft_ms": statistics.median(ttfts) * 1e3,
        "tpot_ms": statistics.median(tpots) * 1e3,
        "tokens_per_s": tokens / (time.perf_counter() - start),
    }


async def _client_main(kind: str, address: str, requests: int, concurrency: int) -> dict:
    if kind == "grpc":
        from distserve.entrypoints.client import AsyncClient

        async with AsyncClient(address) as client:
            return await _measure(lambda i: _grpc_tokens(client, i), requests, concurrency)
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await _measure(lambda i: _http_tokens(session, address, i), requests, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--client", choices=("grpc", "http"), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(_client_main(args.client, args.address, args.requests, args.concurrency))))
        return

    import ray

    from distserve import SamplingParams
    from distserve.cluster.api import make_cluster_config
    from distserve.entrypoints.server import BackgroundServer
    from distserve.entrypoints.server_config import ServerConfig

    ray.init(include_dashboard=False, log_to_driver=False)
    config = make_cluster_config(model=args.model, num_kv_blocks=512, prefill={}, decode={})
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:

            async def in_process_tokens(i: int):
                async for output in server.cluster.generate(_prompt(i), params):
                    yield len(output.new_token_ids)

            results = {"in-process": server.loop.run(_measure(in_process_tokens, args.requests, args.concurrency))}
            for kind, address in (("grpc", server.grpc_address), ("http", server.http_url)):
                command = [
                    sys.executable,
                    __file__,
                    "--client",
                    kind,
                    "--address",
                    address,
                    "--requests",
                    str(args.requests),
                    "--concurrency",
                    str(args.concurrency),
                ]
                results[kind] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    finally:
        ray.shutdown()

    base = results["in-process"]
    print(
        f"{args.model}, {PROMPT_TOKENS}-token prompts, {MAX_TOKENS} output tokens; median of {args.requests} "
        f"sequential requests; throughput with {args.concurrency * 2} requests, {args.concurrency} at a time"
    )
    print(f"{'path':<11} {'TTFT ms':>8} {'x':>5} {'TPOT ms':>8} {'x':>5} {'tok/s':>7} {'x':>5}")
    for kind, r in results.items():
        print(
            f"{kind:<11} {r['ttft_ms']:>8.1f} {r['ttft_ms'] / base['ttft_ms']:>5.2f} {r['tpot_ms']:>8.2f} "
            f"{r['tpot_ms'] / base['tpot_ms']:>5.2f} {r['tokens_per_s']:>7.0f} "
            f"{r['tokens_per_s'] / base['tokens_per_s']:>5.2f}"
        )


if __name__ == "__main__":
    main()
