"""n samples of each prompt: one request of n samples, which share the prompt's KV, against n
requests of one sample each, with the prefix cache (how vLLM's engine shares a prompt between a
request's samples) and without it, on one engine.

    python scripts/benchmarks/bench_samples.py [--prompts 8] [--prompt-len 512] [--max-tokens 64] [--n 4]

The 58M dummy Llama, ``--threads`` torch threads, sampling at temperature 0.8 (seeded: sample i of
a prompt draws with seed + i in every mode, so all modes generate the same tokens; EOS ignored).
Per mode: wall seconds, output tokens/s, prompt tokens computed (allocated less prefix-cache hits),
the most KV blocks in use at once, and whether each sample's tokens equal the one-sample run's.
The modes run ``--rounds`` times, each round starting one mode later; medians are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time

from distserve import LLM, SamplingParams
from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape

MODES = ("shared", "separate+cache", "separate")


@dataclasses.dataclass
class Run:
    seconds: float
    output_tokens: int
    prompt_tokens_computed: int
    peak_blocks: int
    tokens: dict[tuple[int, int], list[int]]  # (prompt, sample) -> output tokens


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, mode: str) -> Run:
    engine = llm.engine
    bm = engine.block_manager
    bm.set_prefix_caching(False)  # forget what an earlier run cached
    bm.set_prefix_caching(mode != "separate")
    queried, hit = bm.prefix_cache_queried_tokens, bm.prefix_cache_hit_tokens
    owner: dict[str, int] = {}
    for p, prompt in enumerate(prompts):
        if mode == "shared":
            owner[engine.add_request(prompt, params)] = p
        else:
            for i in range(params.n):
                one = dataclasses.replace(params.sample_params(i), n=1)
                owner[engine.add_request(prompt, one)] = p * params.n + i
    tokens: dict[tuple[int, int], list[int]] = {}
    peak = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            key = owner[delta.request_id]
            key = (key, delta.index) if mode == "shared" else divmod(key, params.n)
            tokens.setdefault(key, []).extend(delta.new_token_ids)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    seconds = time.perf_counter() - start
    computed = (bm.prefix_cache_queried_tokens - queried) - (bm.prefix_cache_hit_tokens - hit)
    return Run(seconds, sum(map(len, tokens.values())), computed, peak, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, n=args.n, ignore_eos=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = str(write_llama_shape(scratch, **BENCH_LLAMA_SHAPE))
        llm = LLM(model, load_format="dummy", cpu_threads=args.threads, num_kv_blocks=4096, block_size=16)
        run(llm, prompts[:2], params, "shared")  # warm-up
        runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                runs[mode].append(run(llm, prompts, params, mode))
        llm.shutdown()

    print(f"{args.prompts} prompts of {args.prompt_len} tokens, n={args.n}, {args.max_tokens} tokens per sample, "
          f"{args.threads} threads, median of {args.rounds} rounds")  # fmt: skip
    print(f"{'mode':<16}{'seconds':>9}{'tok/s':>9}{'prompt tok computed':>21}{'peak blocks':>13}{'same tokens':>13}")
    reference = runs["separate"][0].tokens
    for mode in MODES:
        seconds = statistics.median(r.seconds for r in runs[mode])
        last = runs[mode][-1]
        same = all(r.tokens == reference for r in runs[mode])
        print(f"{mode:<16}{seconds:>9.2f}{last.output_tokens / seconds:>9.1f}{last.prompt_tokens_computed:>21}"
              f"{last.peak_blocks:>13}{str(same):>13}")  # fmt: skip


if __name__ == "__main__":
    main()
