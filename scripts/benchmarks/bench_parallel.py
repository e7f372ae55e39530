"""Step time of one instance at different tensor/pipeline parallel layouts.

One dummy Llama-shaped model (random weights drawn per full tensor, so every layout serves the
same model) runs batches of B requests with P-token prompts: the first step prefills all B
prompts at once, then the script times decode steps of batch B. Layouts are TPxPP; a layout of
more than one rank runs one Ray actor per rank (gloo on CPU, NCCL on CUDA), TP=PP=1 runs in
this process. Ratios are against TP=1 in the same run; ``dispatch`` is the time a step spends
outside the driver rank's own prepare/forward/sample (Ray calls, hidden-state transfers, other
ranks).

Run (about 3 minutes on 2 CPU cores):

    DISTSERVE_CACHE_DIR=/tmp/dscache python scripts/benchmarks/bench_parallel.py
    python scripts/benchmarks/bench_parallel.py --layouts 1x1,2x1 --batch-sizes 1,16 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from transformers.utils import logging as hf_logging

from distserve import SamplingParams
from distserve.core.config import EngineConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.model_executor.tiny_models import write_llama_shape


@dataclass
class Timing:
    layout: str
    batch_size: int
    prefill_ms: float
    decode_ms: float
    decode_dispatch_ms: float
    outputs: list[list[int]]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="1x1,2x1,1x2", help="comma-separated TPxPP layouts; the first is the baseline")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def write_model_dir(root: Path, args: argparse.Namespace) -> Path:
    """config.json and a tokenizer, no weights: the engine draws dummy weights from the shapes."""
    return write_llama_shape(
        root / "bench-parallel-llama",
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3 // 64 * 64,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=args.hidden_size // 128,
        max_position_embeddings=4096,
    )


def run_layout(model_dir: Path, layout: str, args: argparse.Namespace) -> list[Timing]:
    tp, pp = (int(x) for x in layout.split("x"))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    largest = max(batch_sizes)
    steps = args.decode_steps + 2
    blocks = largest * (-(-(args.prompt_len + steps + 1) // 16)) + 16
    config = EngineConfig.from_flat(
        model=str(model_dir),
        load_format="dummy",
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=blocks,
        max_num_seqs=largest,
        max_num_batched_tokens=largest * args.prompt_len,
        enable_prefix_caching=False,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    engine = LLMEngine(config, max_step_records=100_000, name=f"bench-{layout}")
    rng = random.Random(args.seed)
    timings = []
    try:
        for batch_size in [batch_sizes[0], *batch_sizes]:  # the first round warms up
            prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(batch_size)]
            params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
            ids = [engine.add_request(p, params) for p in prompts]
            skip = len(engine.stats.records)
            outputs: dict[str, list[int]] = {i: [] for i in ids}
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    outputs[delta.request_id] += delta.new_token_ids
            records = list(engine.stats.records)[skip:]
            prefill = [r for r in records if r.is_prefill]
            decode = [r for r in records if not r.is_prefill and r.batch_size == batch_size][2:]
            timings.append(
                Timing(
                    layout,
                    batch_size,
                    sum(r.total for r in prefill) * 1e3,
                    statistics.fmean(r.total for r in decode) * 1e3,
                    statistics.fmean(r.seconds["dispatch"] for r in decode) * 1e3,
                    [outputs[i] for i in ids],
                )
            )
    finally:
        engine.shutdown()
    return timings[1:]


def main() -> None:
    args = parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ray.init(include_dashboard=False, log_to_driver=False)
    layouts = [layout.strip() for layout in args.layouts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), args)
        results: dict[str, list[Timing]] = {}
        for layout in layouts:
            start = time.perf_counter()
            results[layout] = run_layout(model_dir, layout, args)
            print(f"{layout}: {time.perf_counter() - start:.1f} s including startup", flush=True)
    base = {t.batch_size: t for t in results[layouts[0]]}
    print(
        f"\nmodel: Llama-shaped, hidden {args.hidden_size}, {args.num_layers} layers, {args.dtype} on {args.device}; "
        f"prompts of {args.prompt_len} tokens\n"
    )
    print("| TPxPP | batch | prefill ms | vs base | decode step ms | vs base | decode dispatch ms | greedy = base |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in layouts:
        for t in results[layout]:
            b = base[t.batch_size]
            same = sum(x == y for x, y in zip(t.outputs, b.outputs))
            print(
                f"| {layout} | {t.batch_size} | {t.prefill_ms:.1f} | {b.prefill_ms / t.prefill_ms:.2f}x "
                f"| {t.decode_ms:.1f} | {b.decode_ms / t.decode_ms:.2f}x | {t.decode_dispatch_ms:.2f} "
                f"| {same}/{len(t.outputs)} |"
            )


if __name__ == "__main__":
    main()
