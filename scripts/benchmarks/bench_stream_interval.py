"""What an instance's output batches cost its step loop, and what ``stream_interval`` gives back.

    python scripts/benchmarks/bench_stream_interval.py [--tokens 512] [--repeats 2]

1. One instance actor (``tiny-llama``, one torch thread) decodes one request at a time (40-token
   prompt, ``--tokens`` out) while a caller long-polls ``get_outputs`` as the orchestrator does,
   at each interval in turn, and once with no poll until the request is done: the engine's own
   step time (its timers, read in the actor), the polls that returned, and the wall time per token.
2. The same requests through a 1 prefill + 1 decode cluster with ``stream_interval`` 0 and the
   default, in turn: the median TPOT of requests sent one at a time, and output tokens per second
   with 16 in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import ray

from distserve import AsyncCluster, SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.cluster.config import ClusterConfig
from distserve.cluster.instance import launch_instance

PROMPT_TOKENS = 40
DEFAULT_INTERVAL = ClusterConfig.__dataclass_fields__["stream_interval"].default


def _engine_steps(instance) -> tuple[int, float]:
    """(steps, seconds in them) so far, read inside the actor."""
    stats = instance.engine.stats
    return stats.num_steps, sum(stats.totals.values())


def one_request(handle, prompt: list[int], tokens: int, interval: float | None) -> dict:
    """Decode one request while polling every ``interval`` (None: no poll until it is done)."""
    steps0, seconds0 = ray.get(handle.__ray_call__.remote(_engine_steps))
    start = time.perf_counter()
    ray.get(handle.add_request.remote(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)))
    received = polls = 0
    while received < tokens:
        if interval is None:
            time.sleep(tokens * 0.003)  # well past the request's end
        deltas = ray.get(handle.get_outputs.remote(1.0, interval or 0.0))
        received += sum(len(d.new_token_ids) for d in deltas)
        polls += 1
    wall = time.perf_counter() - start
    steps1, seconds1 = ray.get(handle.__ray_call__.remote(_engine_steps))
    step_ms = (seconds1 - seconds0) / (steps1 - steps0) * 1e3
    return {"step_ms": step_ms, "polls": polls, "wall_ms_per_token": wall / tokens * 1e3}


def step_cost(tokens: int, repeats: int, intervals: list[float]) -> None:
    config = make_cluster_config(model="tiny-llama", num_kv_blocks=1024, cpu_threads=1, colocated={"instances": 1})
    name, engine_config = config.instance_configs()[0]
    handle = launch_instance(engine_config, name)
    rng = random.Random(0)
    arms: list[float | None] = [*intervals, None]
    rows: dict = {arm: [] for arm in arms}
    one_request(handle, [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)], 64, 0.0)  # warm-up
    for _ in range(repeats):
        for arm in arms:
            prompt = [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]
            rows[arm].append(one_request(handle, prompt, tokens, arm))
    ray.kill(handle)
    base = statistics.median(r["step_ms"] for r in rows[None])
    print(f"\n1. One instance, one request of {PROMPT_TOKENS} + {tokens} tokens at a time (medians of {repeats})")
    print("| long poll | engine step ms | × no poll | polls | wall ms per token |")
    print("|---|---|---|---|---|")
    for arm in arms:
        step = statistics.median(r["step_ms"] for r in rows[arm])
        label = "none until done" if arm is None else "every step" if arm == 0 else f"interval {arm * 1e3:g} ms"
        polls = statistics.median(r["polls"] for r in rows[arm])
        wall = statistics.median(r["wall_ms_per_token"] for r in rows[arm])
        print(f"| {label} | {step:.3f} | {step / base:.2f} | {polls:.0f} | {wall:.3f} |")


async def serve(interval: float, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(median TPOT ms one at a time, output tokens per second 16 at a time) through a cluster."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    async with AsyncCluster(model="tiny-llama", cpu_threads=1, num_kv_blocks=1024, prefill={}, decode={},
                            stream_interval=interval) as cluster:  # fmt: skip
        tpots = []
        for prompt in prompts[:16]:
            outputs = [output async for output in cluster.generate(prompt, params)]
            tpots.append(outputs[-1].metrics.tpot)
        semaphore = asyncio.Semaphore(16)

        async def bounded(prompt: list[int]) -> None:
            async with semaphore:
                async for _ in cluster.generate(prompt, params):
                    pass

        start = time.perf_counter()
        await asyncio.gather(*(bounded(p) for p in prompts))
        throughput = len(prompts) * tokens / (time.perf_counter() - start)
    return statistics.median(tpots) * 1e3, throughput


def end_to_end(tokens: int, repeats: int) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(16, 64))] for _ in range(48)]
    results: dict = {0.0: [], DEFAULT_INTERVAL: []}
    for _ in range(repeats):
        for interval in results:
            results[interval].append(asyncio.run(serve(interval, prompts, tokens)))
    print(f"\n2. 1 prefill + 1 decode, prompts of 16-64 tokens, {tokens} out (each run)")
    print("| stream_interval | TPOT ms, one at a time | tok/s, 16 in flight |")
    print("|---|---|---|")
    for interval, runs in results.items():
        tpot = ", ".join(f"{t:.3f}" for t, _ in runs)
        rate = ", ".join(f"{r:.0f}" for _, r in runs)
        print(f"| {interval * 1e3:g} ms | {tpot} | {rate} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="output tokens per request in part 1")
    parser.add_argument("--serve-tokens", type=int, default=128, help="output tokens per request in part 2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--intervals", default="0,0.002,0.005,0.01", help="seconds, comma-separated")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        step_cost(args.tokens, args.repeats, [float(x) for x in args.intervals.split(",")])
        end_to_end(args.serve_tokens, args.repeats)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
