"""A first run: a 1 prefill + 1 decode cluster of a tiny model on a local Ray, a few requests
streamed through the gRPC client with their TTFT and TPOT, then a clean shutdown.

    python scripts/demo.py [--model tiny-llama] [--max-tokens 32]

The same cluster as a long-running service: ``distserve launch --model tiny-llama`` and, from
another terminal, ``distserve generate --server 127.0.0.1:50051 "The cache block"``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import ray

from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.client import AsyncClient
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig

PROMPTS = [
    "The cache block",
    "Prefill and decode run on",
    "A request's first token",
    "Once upon a time",
]


async def stream_all(address: str, max_tokens: int) -> list:
    """Send every prompt at once; print the first one's tokens as they arrive."""
    async with AsyncClient(address) as client:

        async def one(i: int, prompt: str):
            completion_chunks = []
            async for chunk in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
                completion_chunks.append(chunk)
                if i == 0:
                    print(chunk.text, end="", flush=True)
            return completion_chunks

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        print()
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        config = make_cluster_config(model=args.model, num_kv_blocks=256, prefill={}, decode={})
        print(f"starting 1 prefill + 1 decode instance of {args.model} on a local Ray cluster ...")
        with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
            print(f"gRPC on {server.grpc_address}, OpenAI HTTP on {server.http_url}/v1\n")
            print(f"{PROMPTS[0]!r} ->", end=" ")
            results = asyncio.run(stream_all(server.grpc_address, args.max_tokens))
            print(f"\n{'prompt':<28} {'tokens':>6} {'TTFT ms':>8} {'TPOT ms':>8} {'KV move ms':>10}")
            for prompt, chunks in zip(PROMPTS, results):
                last = chunks[-1]
                t = last.timings
                print(
                    f"{prompt:<28} {last.usage.completion_tokens:>6} {t.ttft * 1e3:>8.1f} {t.tpot * 1e3:>8.1f}"
                    f" {t.migration * 1e3:>10.1f}"
                )
            in_use = sum(i.num_blocks - i.num_free_blocks for i in server.info())
        print(f"\nshut down cleanly; KV blocks in use at the end: {in_use}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
