"""What sets a colocated instance's TPOT under a served load: its steps, split into those that ran
prompt tokens and decode-only ones, against each request's time per output token.

    python scripts/experiments/exp_served_steps.py [--rate 2] [--requests 60] [--threads 2] [--no-packed] [--chunk 512]

One colocated instance of the 58M dummy Llama (``--threads`` torch threads), requests of 256 random
prompt tokens and 64 output tokens (EOS ignored) arriving as a Poisson process, as `vllm bench
serve --dataset-name random` sends them, but from this process through the cluster API (no HTTP).
Per request, its decode span (first to last token) is split into the time of the steps that ran a
prompt and the rest, read from the instance's step records.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

import ray

from distserve import AsyncCluster, SamplingParams
from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape
from placement.workload import arrival_times


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def serve(args: argparse.Namespace, model: str) -> tuple[list[tuple[float, float, int]], list]:
    """(first token, last token, tokens) per request, and the instance's step records with their
    wall-clock ends."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    options = dict(load_format="dummy", cpu_threads=args.threads, cpu_packed_linear=not args.no_packed)
    if args.chunk:
        options.update(enable_chunked_prefill=True, max_num_batched_tokens=args.chunk)
    async with AsyncCluster(model=model, colocated={"instances": 1}, **options) as cluster:
        handle = cluster.orchestrator.instances[0].handle
        await asyncio.gather(*[_one(cluster, [rng.randrange(3, 32000) for _ in range(256)], params) for _ in range(2)])
        first_step, _ = await handle.recent_steps.remote()
        start = time.time()

        async def request(at: float) -> tuple[float, float, int]:
            await asyncio.sleep(max(0.0, start + at - time.time()))
            return await _one(cluster, [rng.randrange(3, 32000) for _ in range(256)], params)

        spans = await asyncio.gather(*(request(at) for at in arrival_times(args.requests, args.rate, seed=1)))
        _, records = await handle.recent_steps.remote(first_step)
    return spans, records


async def _one(cluster: AsyncCluster, prompt: list[int], params: SamplingParams) -> tuple[float, float, int]:
    times = []
    async for output in cluster.generate(prompt, params):
        times += [time.time()] * len(output.new_token_ids)
    return times[0], times[-1], len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-packed", action="store_true", help="torch's linear instead of packed weights")
    parser.add_argument("--chunk", type=int, default=0, help="chunked prefill, up to this many tokens a step")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as scratch:
        model = str(write_llama_shape(scratch, **BENCH_LLAMA_SHAPE))
        spans, records = asyncio.run(serve(args, model))
    ray.shutdown()

    prompt_steps = [r for r in records if r.is_prefill]
    decode_steps = [r for r in records if not r.is_prefill]
    print(f"{args.requests} requests at {args.rate} req/s, {args.threads} threads, "
          f"{'torch linear' if args.no_packed else 'packed linear'}"
          f"{f', chunked prefill of {args.chunk} tokens' if args.chunk else ''}")  # fmt: skip
    for name, steps in (("steps with prompts", prompt_steps), ("decode-only steps", decode_steps)):
        ms = [r.total * 1000 for r in steps]
        sizes = [r.batch_size for r in steps]
        print(f"  {name:<19} {len(steps):>5}  median {statistics.median(ms):7.1f} ms  p90 {percentile(ms, 0.9):7.1f} ms"
              f"  total {sum(ms) / 1000:6.1f} s  batch mean {statistics.fmean(sizes):4.1f}")  # fmt: skip
    tpot = [(last - first) / (n - 1) * 1000 for first, last, n in spans]
    print(f"  TPOT p50 {statistics.median(tpot):.1f} ms, p90 {percentile(tpot, 0.9):.1f} ms")
    share = sum(r.total for r in prompt_steps) / sum(r.total for r in records)
    per_token_prompt = sum(r.total for r in prompt_steps) / max(1, len(decode_steps)) * 1000
    print(f"  steps with prompts: {share:.0%} of step time; spread over the decode steps, "
          f"{per_token_prompt:.1f} ms added to each")  # fmt: skip


if __name__ == "__main__":
    main()
