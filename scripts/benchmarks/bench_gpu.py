"""The engine on one GPU against the GPU's own limits: decode steps against the memory roofline,
prefill against the bf16 matrix-product peak, and offline throughput, with decode replayed as
CUDA graphs and run eagerly, in one run.

The model is a Llama-3-8B shape with dummy weights (``--load-format dummy``), in bfloat16, with
the KV cache sized from the GPU's free memory. The peaks are measured in the same run, not taken
from a data sheet:

- copy bandwidth: a device-to-device copy of 4 GiB, bytes read plus bytes written per second;
- matrix-product peak: 8192 x 8192 x 8192 bf16 products.

A decode step must read every weight once (the embedding table aside: only the batch's rows)
and every sequence's K/V, so its floor is those bytes over the copy bandwidth (read plus
written: the memory's whole traffic); the report gives each batch size's step time as a share
of that floor. A step's time is the engine's whole step, scheduling and sampling included. A
prefill step's useful work is 2 FLOPs per weight per token plus the causal attention products.

Run (about 2 minutes on an H100):

    python scripts/benchmarks/bench_gpu.py --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from distserve import SamplingParams
from distserve.core.config import EngineConfig
from distserve.core.step_metrics import PHASES
from distserve.engine.llm_engine import LLMEngine
from distserve.model_executor import triton_attention

MODEL = "llama-3-8b"
UNSPLIT_PROGRAMS_PER_SM = triton_attention._UNSPLIT_PROGRAMS_PER_SM


def copy_bandwidth(num_bytes: int = 4 * 2**30, repeats: int = 10) -> float:
    """Bytes read plus written per second by a device-to-device copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del src, dst
    return 2 * num_bytes * repeats / seconds


def matmul_peak(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def build_engine(args: argparse.Namespace, enforce_eager: bool) -> tuple[LLMEngine, float]:
    start = time.perf_counter()
    config = EngineConfig.from_flat(
        model=MODEL,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        enforce_eager=enforce_eager,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config, max_step_records=1_000_000)
    return engine, time.perf_counter() - start


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> float:
    """Wall seconds to serve the requests to their end (EOS ignored)."""
    start = time.perf_counter()
    for prompt, n in zip(prompts, max_tokens):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def random_prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def model_bytes(engine: LLMEngine) -> tuple[int, int]:
    """(bytes a decode step reads of the weights, weights' parameter count less the embedding)."""
    model = engine.executor.worker.model
    embed = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters()) - embed.numel()
    return params * embed.element_size(), params


def decode_sweep(engine: LLMEngine, args: argparse.Namespace, bandwidth: float, vocab: int) -> list[dict]:
    """Median decode step time at each batch size, every sequence at ``--context`` tokens or so."""
    rng = random.Random(0)
    shape = engine.executor.worker.kv_shape
    kv_per_token = shape.bytes_per_block // shape.block_size
    weight_bytes, _ = model_bytes(engine)
    rows = []
    for batch in args.batch_sizes:
        skip = len(engine.stats.records)
        run(engine, random_prompts(rng, [args.context] * batch, vocab), [args.decode_steps] * batch)
        steps = [r for r in list(engine.stats.records)[skip:] if not r.is_prefill and r.batch_size == batch]
        steps = steps[2:]  # the first steps may still be filling
        step_s = statistics.median(r.total for r in steps)
        kv_bytes = batch * (args.context + args.decode_steps // 2) * kv_per_token
        # The copy's bytes read plus written per second is what the memory moves; a step that
        # only reads moves its bytes at that rate at best.
        floor_s = (weight_bytes + kv_bytes) / bandwidth
        rows.append(
            {
                "batch": batch,
                "step_ms": step_s * 1e3,
                "floor_ms": floor_s * 1e3,
                "of_roofline": floor_s / step_s,
                "tokens_per_s": batch / step_s,
                # Host phases beside the forward: the GPU idles through them.
                "phases_ms": {p: statistics.median(r.seconds.get(p, 0.0) for r in steps) * 1e3 for p in PHASES},
            }
        )
    return rows


def attention_sweep(args: argparse.Namespace, bandwidth: float) -> list[dict]:
    """The Triton decode kernel alone at the model's attention shape (32 query heads over 8 KV
    heads of 128, bfloat16, blocks of 16): K/V read per second against the copy bandwidth, for
    each batch size, context and partition (0: unsplit), with tables as wide as the contexts
    (eager steps) and as wide as the model's 8192 tokens (what a captured graph's tables are)."""
    from distserve.model_executor.triton_attention import paged_decode_triton

    heads, kv_heads, dim, block = 32, 8, 128, 16
    rows = []
    for context in args.sweep_contexts:
        most = max(args.batch_sizes)
        blocks = most * context // block
        k_cache = torch.randn(blocks * block, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        for batch in args.batch_sizes:
            order = torch.randperm(blocks, device="cuda")[: batch * context // block].to(torch.int32)
            q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
            positions = torch.full((batch,), context - 1, dtype=torch.long, device="cuda")
            oldest = torch.zeros_like(positions)
            kv_bytes = 2 * batch * context * kv_heads * dim * 2
            for width in sorted({context // block, 8192 // block}):
                tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
                tables[:, : context // block] = order.view(batch, -1)
                call = partial(paged_decode_triton, q, k_cache, v_cache, tables, positions, oldest, block, 0.1)
                for partition in args.sweep_partitions:
                    seconds = cuda_seconds(partial(call, partition=partition))
                    rows.append(
                        {
                            "context": context,
                            "batch": batch,
                            "table_tokens": width * block,
                            "partition": partition,
                            "us": seconds * 1e6,
                            "GBps": kv_bytes / seconds / 1e9,
                            "of_copy": kv_bytes / seconds / bandwidth,
                        }
                    )
    return rows


def cuda_seconds(call: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of ``call`` on the GPU (CUDA events), after a warm-up that compiles it."""
    call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_table(prof: torch.profiler.profile) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)


def profile_prefill(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> str:
    """The CUDA kernels of one prefill step of ``--max-batched-tokens`` prompt tokens."""
    rng = random.Random(4)
    for prompt in random_prompts(rng, [args.prefill_len] * (args.max_batched_tokens // args.prefill_len), vocab):
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return kernel_table(prof)


def profile_decode(engine: LLMEngine, batch: int, context: int, vocab: int, steps: int = 5) -> str:
    """The CUDA kernels of ``steps`` decode steps at ``batch`` sequences, by total GPU time."""
    rng = random.Random(3)
    for prompt in random_prompts(rng, [context] * batch, vocab):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    while True:  # through the prefills, to the first step that decodes them all
        engine.step()
        last = engine.stats.records[-1]
        if not last.is_prefill and last.batch_size == batch:
            break
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return kernel_table(prof)


def prefill_rate(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> dict:
    """Useful TFLOP/s of prefill steps that each run ``--max-batched-tokens`` prompt tokens."""
    rng = random.Random(1)
    n = args.max_batched_tokens // args.prefill_len
    skip = len(engine.stats.records)
    run(engine, random_prompts(rng, [args.prefill_len] * (3 * n), vocab), [1] * (3 * n))
    steps = [r for r in list(engine.stats.records)[skip:] if r.is_prefill][1:]
    _, params = model_bytes(engine)
    hf = engine.executor.worker.model.config
    attention = 2 * 2 * hf.num_hidden_layers * hf.hidden_size * n * args.prefill_len**2 / 2  # causal QK and PV
    flops = 2 * params * n * args.prefill_len + attention
    step_s = statistics.median(r.total for r in steps)
    return {"tokens": n * args.prefill_len, "step_ms": step_s * 1e3, "tflops": flops / step_s / 1e12}


def offline(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(2)
    lengths = [rng.randint(*args.prompt_len) for _ in range(args.num_requests)]
    outputs = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    prompts = random_prompts(rng, lengths, vocab)
    run(engine, prompts[:8], [4] * 8)  # warm-up
    wall = run(engine, prompts, outputs)
    return {"requests": args.num_requests, "wall_s": wall, "output_tokens_per_s": sum(outputs) / wall}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each sequence of the decode sweep")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    p.add_argument(
        "--modes",
        default="graphs,unsplit,eager",
        help="decode as CUDA graphs, as graphs with the attention unsplit (one program per sequence and KV head), "
        "eagerly: any of them in turn",
    )
    p.add_argument("--sweep-contexts", type=int, nargs="*", default=[512, 2048], help="attention kernel sweep")
    p.add_argument("--sweep-partitions", type=int, nargs="*", default=[0, 64, 128, 256, 512])
    p.add_argument("--profile-batch", type=int, default=64, help="profile decode steps at this batch size (0: no)")
    p.add_argument("--json", help="write the figures to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu needs a CUDA device; none is visible.", file=sys.stderr)
        return 2
    bandwidth, peak = copy_bandwidth(), matmul_peak()
    torch.cuda.empty_cache()  # the probes' memory back to the GPU, where the KV cache is sized from
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_GBps": bandwidth / 1e9,
        "bf16_matmul_TFLOPs": peak / 1e12,
        "modes": {},
    }
    print(f"{report['device']}: copy {bandwidth / 1e9:.0f} GB/s (read+write), bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    if args.sweep_contexts:
        report["attention"] = attention_sweep(args, bandwidth)
        torch.cuda.empty_cache()
        print("\nTriton decode attention alone (K/V read per second, of the copy bandwidth):")
        print(f"  {'context':>7} {'batch':>5} {'table':>6} {'partition':>9} {'us':>8} {'GB/s':>7} {'of copy':>7}")
        for r in report["attention"]:
            print(f"  {r['context']:>7} {r['batch']:>5} {r['table_tokens']:>6} {r['partition']:>9} {r['us']:8.1f} "
                  f"{r['GBps']:7.0f} {r['of_copy']:7.1%}")  # fmt: skip
    for mode in args.modes.split(","):
        # Unsplit: no grid is short of programs (a knob of this benchmark alone).
        triton_attention._UNSPLIT_PROGRAMS_PER_SM = 0 if mode == "unsplit" else UNSPLIT_PROGRAMS_PER_SM
        engine, build_s = build_engine(args, enforce_eager=mode == "eager")
        worker = engine.executor.worker
        vocab = worker.model.config.vocab_size
        graphs = worker.decode_graphs
        entry = {
            "build_s": build_s,
            "kv_blocks": engine.executor.num_blocks,
            "graph_capture_s": graphs.capture_seconds if graphs else None,
            "attention_backend": worker.model_runner.attention_backend,
        }
        captured = f", {len(graphs.sizes)} graphs captured in {graphs.capture_seconds:.1f} s" if graphs else ""
        print(f"\n{mode}: engine built in {build_s:.1f} s, {entry['kv_blocks']} KV blocks, "
              f"backend {entry['attention_backend']}{captured}")  # fmt: skip
        entry["decode"] = decode_sweep(engine, args, bandwidth, vocab)
        print(f"  {'batch':>5} {'step ms':>8} {'floor ms':>9} {'of roofline':>11} {'tok/s':>8}")
        for row in entry["decode"]:
            phases = " ".join(f"{p} {ms:.2f}" for p, ms in row["phases_ms"].items() if ms >= 0.01)
            print(f"  {row['batch']:>5} {row['step_ms']:8.2f} {row['floor_ms']:9.2f} {row['of_roofline']:11.1%} "
                  f"{row['tokens_per_s']:8.0f}   ms: {phases}")  # fmt: skip
        entry["prefill"] = prefill_rate(engine, args, vocab)
        pf = entry["prefill"]
        print(f"  prefill: {pf['tokens']} tokens per step in {pf['step_ms']:.1f} ms, {pf['tflops']:.0f} TFLOP/s "
              f"({pf['tflops'] * 1e12 / peak:.0%} of the matmul peak)")  # fmt: skip
        if args.profile_batch and mode == "eager":  # eagerly, each kernel is seen under its own name
            print(f"  CUDA kernels of 5 decode steps at batch {args.profile_batch} ({mode}):")
            print(profile_decode(engine, args.profile_batch, args.context, vocab))
            print(f"  CUDA kernels of one prefill step of {args.max_batched_tokens} tokens:")
            print(profile_prefill(engine, args, vocab))
        entry["offline"] = offline(engine, args, vocab)
        off = entry["offline"]
        print(f"  offline: {off['requests']} requests in {off['wall_s']:.1f} s, "
              f"{off['output_tokens_per_s']:.0f} output tok/s")  # fmt: skip
        report["modes"][mode] = entry
        del engine, worker, graphs
        gc.collect()
        torch.cuda.empty_cache()
    modes = report["modes"]
    for other in ("unsplit", "eager"):
        if {"graphs", other} <= modes.keys():
            tok_s = modes["graphs"]["offline"]["output_tokens_per_s"] / modes[other]["offline"]["output_tokens_per_s"]
            print(f"\ngraphs / {other} offline throughput: {tok_s:.2f}x")
            for g, o in zip(modes["graphs"]["decode"], modes[other]["decode"]):
                print(f"  batch {g['batch']}: decode step {o['step_ms']:.2f} -> {g['step_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
