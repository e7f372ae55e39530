"""What the prefix tier costs a decode step, and what a read from it saves a prefill, on one engine.

    python scripts/benchmarks/bench_kv_tier.py [--seqs 16] [--prompt-len 200] [--max-tokens 96] [--rounds 3]

Two engines of the 58M dummy Llama in this process (``--threads`` torch threads each), one with a
tier store of this Ray node attached and one without, decode ``--seqs`` sequences of random
prompts of one length, so that they fill blocks in the same steps and a saving step saves one
block per sequence. Per round and engine: the mean decode step, and for steps that save, the
copies out to the tier (``tier`` phase) and the calls around the workers (``dispatch``, where a
call to the store before a step would show). Then the prefill of a prompt whose blocks the tier
holds, on a third engine with an empty cache, against computing it. The engines run in turn, each
round starting with the other.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import ray
import torch

from distserve.core.config import EngineConfig
from distserve.core.sampling_params import SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.kv_tier.client import TierClient
from distserve.kv_tier.store import start_tier_stores, tier_blocks
from distserve.kv_transfer.plan import KVCacheShape
from distserve.model_executor.model_loader import resolve_model
from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape


def decode(engine: LLMEngine, args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request([rng.randrange(10, 30_000) for _ in range(args.prompt_len)], params, f"{seed}-{i}")
    engine.stats.records.clear()
    while engine.has_unfinished_requests():
        engine.step()
    steps = [r for r in engine.stats.records if not r.is_prefill and r.batch_size == args.seqs]
    saving = [r for r in steps if "tier" in r.seconds]
    return {
        "step": _ms([r.total for r in steps]),
        "saving steps": len(saving),
        "tier": _ms([r.seconds["tier"] for r in saving]),
        "dispatch": _ms([r.seconds["dispatch"] for r in saving]),
    }


def _ms(seconds: list[float]) -> float:
    return statistics.mean(seconds) * 1e3 if seconds else 0.0


def prefill_seconds(engine: LLMEngine, prompt: list[int]) -> float:
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), f"p{time.monotonic()}")
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tier-space", type=float, default=0.5, help="GiB")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    model = str(write_llama_shape(tempfile.mkdtemp(), **BENCH_LLAMA_SHAPE))
    config = EngineConfig.from_flat(model=model, load_format="dummy", block_size=16, num_kv_blocks=2048,
                                    cpu_threads=args.threads)  # fmt: skip
    shape = resolve_model(config.model).shape
    geometry = KVCacheShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, 16, torch.float32)
    store = next(iter(start_tier_stores("bench", geometry, tier_blocks(args.tier_space, geometry)).values()))
    engines = {name: LLMEngine(config, max_step_records=100_000, name=name) for name in ("tier", "no tier", "reader")}
    for name in ("tier", "reader"):
        engines[name].attach_tier(TierClient(store, name))
    print(f"{args.seqs} sequences of {args.prompt_len} tokens, {args.max_tokens} steps, {args.threads} thread(s)")
    for round_ in range(args.rounds):
        for name in ("tier", "no tier") if round_ % 2 == 0 else ("no tier", "tier"):
            r = decode(engines[name], args, seed=round_)
            print(f"round {round_} {name:>7}: decode step {r['step']:.2f} ms; {r['saving steps']} saving steps: "
                  f"tier copies {r['tier']:.2f} ms, dispatch {r['dispatch']:.2f} ms", flush=True)  # fmt: skip
    prompt = [random.Random(7).randrange(10, 30_000) for _ in range(1024)]
    computed = prefill_seconds(engines["tier"], prompt)  # computes it and saves its blocks
    read = prefill_seconds(engines["reader"], prompt)  # an empty cache: all but its last block from the tier
    alone = prefill_seconds(engines["no tier"], prompt[::-1])  # another prompt of that length, computed
    hits = engines["reader"].block_manager.tier_hit_tokens
    print(f"prefill of {len(prompt)} tokens: computed {computed * 1e3:.0f} ms (no tier: {alone * 1e3:.0f} ms), "
          f"{hits} of them read from the tier {read * 1e3:.0f} ms")  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
