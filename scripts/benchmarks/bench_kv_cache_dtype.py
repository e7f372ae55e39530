"""An 8-bit KV cache (``cache.kv_cache_dtype`` int8, fp8) against the unquantized cache, in one
run: the tokens a pool of the same bytes holds, decode step time at long contexts, and the bytes
and time of a prefill-to-decode hand-over of the same prompts.

    python scripts/benchmarks/bench_kv_cache_dtype.py [--threads 2] [--contexts 1024,2048,4096] [--batch 8]
    python scripts/benchmarks/bench_kv_cache_dtype.py --handover-lens 1024,2048,4096 --skip-steps

The model: a Llama shape with dummy weights (``--load-format dummy``), 8 layers of hidden size
1,024 with 8 query and 8 KV heads of 128 (``--num-layers`` ...), for each model dtype of
``--dtypes`` and each KV cache dtype of ``--cache-dtypes`` (``auto``: the model's).

- Pool: the blocks (and tokens) a pool of ``--pool-gib`` holds, from ``KVCacheShape.bytes_per_block``
  (the engine sizes its pool from it: ``kv_cache.determine_num_blocks``).
- Decode steps: one engine per (model dtype, cache dtype), all built first; each holds ``--batch``
  sequences of each context length in blocks in random order, filled with random K/V (quantized,
  in an 8-bit cache: random codes would make random scales). A step is ``Worker.execute_model`` on a
  decode batch of one token per sequence (prepare, forward, sampling: an engine step without its
  scheduler), timed on the wall clock; the engines take turns, a context length at a time, for
  ``--rounds`` rounds, and each cell is the median of its ``--steps`` steps x rounds.
- Hand-over: a 1 prefill + 1 decode cluster (Ray, this machine) per (model dtype, cache dtype)
  runs prompts of ``--handover-lens`` tokens one at a time and reads the decode instance's pull
  records: the bytes it received and the pull's time (from asking both sides to move the
  request's token slots until both answered). ``--kv-transport`` is the clusters': ``auto`` reads
  the prefill instance's cache in place over shared memory, ``group`` moves it over gloo.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from bench_migration import write_model_dir
from transformers.utils import logging as hf_logging

from distserve import LLM, Cluster, SamplingParams
from distserve.core.config import KV_TRANSPORTS, CacheConfig
from distserve.core.kv_cache_dtype import is_quantized
from distserve.kv_transfer.plan import KVCacheShape
from distserve.model_executor.kv_quant import quantize_kv
from distserve.model_executor.model_runner import BatchInput, SeqInput

BLOCK_SIZE = 16
HEAD_DIM = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engines")
    p.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, comma-separated")
    p.add_argument("--cache-dtypes", default="auto,int8,fp8", help="KV cache dtypes, comma-separated")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--pool-gib", type=float, default=4.0, help="the pool's bytes (the CPU engine's cap: 4 GiB)")
    p.add_argument("--contexts", default="1024,2048,4096", help="decode context lengths, comma-separated")
    p.add_argument("--batch", type=int, default=8, help="sequences of a decode step")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps of an engine per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--handover-lens", default="1024,2048,4096", help="hand-over prompt lengths, comma-separated")
    p.add_argument("--handover-repeats", type=int, default=3)
    p.add_argument("--kv-transport", default="auto", choices=KV_TRANSPORTS, help="the hand-over clusters' own")
    p.add_argument("--skip-steps", action="store_true", help="only the pool and the hand-over")
    p.add_argument("--skip-handover", action="store_true", help="only the pool and the decode steps")
    args = p.parse_args()
    args.dtypes, args.cache_dtypes = args.dtypes.split(","), args.cache_dtypes.split(",")
    args.contexts = [int(n) for n in args.contexts.split(",")]
    args.handover_lens = [int(n) for n in args.handover_lens.split(",")]
    return args


def label(dtype: str, cache_dtype: str) -> str:
    return f"{dtype} model, {cache_dtype if is_quantized(cache_dtype) else dtype} KV"


# Pool ------------------------------------------------------------------------------------------------


def pool_table(args: argparse.Namespace) -> None:
    budget = int(args.pool_gib * 2**30)
    print(f"\nTokens a pool of {args.pool_gib:g} GiB holds ({args.num_layers} layers, {args.num_kv_heads} KV heads of "
          f"{HEAD_DIM}, blocks of {BLOCK_SIZE})\n")  # fmt: skip
    print("| model dtype | KV cache | bytes per token | blocks | tokens | against the model dtype's cache |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        base = None
        for cache_dtype in args.cache_dtypes:
            CacheConfig(kv_cache_dtype=cache_dtype)  # checks the name
            shape = KVCacheShape(args.num_layers, args.num_kv_heads, HEAD_DIM, BLOCK_SIZE, getattr(torch, dtype),
                                 cache_dtype)  # fmt: skip
            blocks = budget // shape.bytes_per_block
            base = base or blocks
            print(f"| {dtype} | {cache_dtype if is_quantized(cache_dtype) else dtype} "
                  f"| {shape.bytes_per_block // BLOCK_SIZE:,} | {blocks:,} | {blocks * BLOCK_SIZE:,} "
                  f"| {blocks / base:.2f}x |")  # fmt: skip


# Decode steps ----------------------------------------------------------------------------------------


class StepEngine:
    """An offline engine whose worker runs decode steps over sequences placed in its cache directly."""

    def __init__(self, model: Path, args: argparse.Namespace, dtype: str, cache_dtype: str) -> None:
        blocks = args.batch * max(args.contexts) // BLOCK_SIZE + args.batch
        self.llm = LLM(str(model), load_format="dummy", dtype=dtype, kv_cache_dtype=cache_dtype,
                       attention_backend=args.attention_backend, num_kv_blocks=blocks, block_size=BLOCK_SIZE,
                       cpu_threads=args.threads, max_num_seqs=args.batch)  # fmt: skip
        self.worker = self.llm.engine.executor.worker
        self.cache_dtype, self.num_blocks = cache_dtype, blocks
        self.backend = self.worker.model_runner.attention_backend
        self._fill()
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables = [order[i :: args.batch] for i in range(args.batch)]  # scattered, as a busy pool's
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20)

    def _fill(self) -> None:
        """Random K/V in every slot, drawn per layer (an 8-bit cache's as codes and their scales)."""
        cache = self.worker.kv_cache.tensor  # [layers, 2, slots, kv_heads, slot width]
        gen = torch.Generator().manual_seed(1)
        head_dim = self.worker.kv_shape.head_dim
        for layer in cache:
            for kv in layer:
                values = torch.randn(kv.shape[0], kv.shape[1], head_dim, generator=gen)
                kv.copy_(quantize_kv(values, self.cache_dtype) if is_quantized(self.cache_dtype) else values)

    def batch(self, context: int) -> BatchInput:
        seqs = [SeqInput([5], context - 1, table, self.params, 1) for table in self.tables]
        return BatchInput(is_prefill=False, seqs=seqs)

    def step_ms(self, batch: BatchInput, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.worker.execute_model(batch)
            times.append((time.perf_counter() - start) * 1e3)
        return times


def step_table(model: Path, args: argparse.Namespace) -> None:
    engines = {(d, c): StepEngine(model, args, d, c) for d in args.dtypes for c in args.cache_dtypes}
    times: dict[tuple, list[float]] = {(key, n): [] for key in engines for n in args.contexts}
    for _ in range(args.rounds):
        for context in args.contexts:
            for key, engine in engines.items():
                batch = engine.batch(context)
                engine.step_ms(batch, 1)  # warm-up: the first step of a shape
                times[key, context] += engine.step_ms(batch, args.steps)
    backends = sorted({e.backend for e in engines.values()})
    print(f"\nDecode step ms, batch of {args.batch}, attention backend {'/'.join(backends)}, "
          f"{torch.get_num_threads()} threads; median of {args.steps} steps x {args.rounds} rounds, and its speed "
          f"against the first cache dtype's\n")  # fmt: skip
    head = " | ".join(f"{n} tokens" for n in args.contexts)
    print(f"| model dtype | KV cache | KV read per step at {args.contexts[-1]} (MiB) | {head} |")
    print("|---|---|---|" + "---|" * len(args.contexts))
    for dtype in args.dtypes:
        base = None
        for cache_dtype in args.cache_dtypes:
            key, engine = (dtype, cache_dtype), engines[dtype, cache_dtype]
            medians = [statistics.median(times[key, n]) for n in args.contexts]
            base = base or medians  # the first cache dtype's (the model dtype's, by default)
            kv_bytes = args.batch * args.contexts[-1] * engine.worker.kv_shape.bytes_per_block / BLOCK_SIZE
            cells = " | ".join(f"{m:.1f} ({b / m:.2f}x)" for m, b in zip(medians, base))
            kv = cache_dtype if is_quantized(cache_dtype) else dtype
            print(f"| {dtype} | {kv} | {kv_bytes / 2**20:,.0f} | {cells} |")
    for engine in engines.values():
        engine.llm.shutdown()


# Hand-over -------------------------------------------------------------------------------------------


@dataclass
class Pull:
    tokens: int
    num_bytes: int
    seconds: float
    transport: str


def handover_pulls(model: Path, args: argparse.Namespace, dtype: str, cache_dtype: str) -> list[Pull]:
    """Each hand-over length's pulls (median time) on a 1P+1D cluster of this dtype and cache dtype."""
    longest = max(args.handover_lens)
    cluster = Cluster(model=str(model), load_format="dummy", device="cpu", dtype=dtype, kv_cache_dtype=cache_dtype,
                      attention_backend=args.attention_backend, num_kv_blocks=(longest + 64) // BLOCK_SIZE * 2 + 16,
                      max_num_batched_tokens=longest, kv_transport=args.kv_transport,
                      prefill={}, decode={})  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pulls = []
    try:
        decode = cluster._async.orchestrator.instances[1].handle
        cluster.generate([[5] * 64], params)  # warm-up: the first channel, the first steps
        for length in args.handover_lens:
            outputs = []
            for i in range(args.handover_repeats):
                # A prompt of its own each time, so that no prefix is cached on either side.
                outputs += cluster.generate([[(11 * i + 7 * j + length) % 30000 + 3 for j in range(length)]], params)
            records = {run.rsplit("-", 1)[0]: r for run, r in ray.get(decode.migrations.remote()).items()}
            mine = [records[o.request_id] for o in outputs]
            pulls.append(Pull(length, mine[-1].num_bytes, statistics.median(r.end - r.start for r in mine),
                              "+".join(sorted({r.transport for r in mine}))))  # fmt: skip
    finally:
        cluster.shutdown()
    return pulls


def handover_table(model: Path, args: argparse.Namespace) -> None:
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        runs = {(d, c): handover_pulls(model, args, d, c) for d in args.dtypes for c in args.cache_dtypes}
    finally:
        ray.shutdown()
    transports = sorted({p.transport for pulls in runs.values() for p in pulls})
    print(f"\nHand-over of a prompt's KV, prefill instance to decode instance ({'/'.join(transports)}), median of "
          f"{args.handover_repeats}\n")  # fmt: skip
    print("| model dtype | KV cache | prompt tokens | MiB moved | pull ms | bytes against the model dtype's "
          "| time against the model dtype's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        base = runs[dtype, args.cache_dtypes[0]]
        for cache_dtype in args.cache_dtypes:
            for pull, ref in zip(runs[dtype, cache_dtype], base):
                kv = cache_dtype if is_quantized(cache_dtype) else dtype
                print(f"| {dtype} | {kv} | {pull.tokens} | {pull.num_bytes / 2**20:.1f} | {pull.seconds * 1e3:.1f} "
                      f"| {pull.num_bytes / ref.num_bytes:.3f} | {pull.seconds / ref.seconds:.2f} |")  # fmt: skip


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model dtypes {', '.join(args.dtypes)}; "
          f"KV cache dtypes {', '.join(args.cache_dtypes)}")  # fmt: skip
    pool_table(args)
    with tempfile.TemporaryDirectory() as scratch:
        max_positions = max(args.contexts + args.handover_lens) + 1024
        model = write_model_dir(Path(scratch), args, "bench-kv-dtype-llama", max_positions)
        if not args.skip_steps:
            step_table(model, args)
        if not args.skip_handover:
            handover_table(model, args)


if __name__ == "__main__":
    main()
