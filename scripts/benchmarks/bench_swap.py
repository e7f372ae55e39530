"""Preemption by swap: a sequence's KV copied out to the host pool and back, against a raw copy of
the same bytes between the device and the host.

One rank's KV cache (``KVCache``) of a Llama-3-8B shape by default (32 layers, 8 KV heads of 128,
bfloat16, blocks of 16 tokens) with a host pool of the same size; on CUDA the pool is pinned and
the copies run on the cache's swap stream, as the engine makes them. For each sequence length the
sequence's blocks are taken two ways: consecutive (a sequence that got its blocks in one go, as
an allocation hands them out in order) and scattered (a sorted random sample of the cache's
blocks, a sequence that grew among others: every block a copy of its own). The swap out, then the
swap in, each timed from asking to done (on CUDA with the stream synchronized, and the copies'
own time on the device beside it), against one contiguous copy of the same bytes from the
device to a pinned host buffer and back (on CPU: between two host buffers). Medians of the
repeats, after one warm-up each.

    python scripts/benchmarks/bench_swap.py [--tokens 256,1024,4096] [--repeats 10] [--json swap.json]
    python scripts/benchmarks/bench_swap.py --device cpu --dtype float32 --num-layers 8 --num-blocks 600 \\
        --tokens 256,1024,4096 --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from distserve.kv_transfer.plan import KVCacheShape
from distserve.model_executor.kv_cache import KVCache


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="256,1024,4096", help="tokens of the swapped sequence, comma-separated")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024, help="blocks of the cache and of the host pool")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--threads", type=int, help="CPU: torch threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    return p.parse_args()


def timed(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``run`` from asking to done, after one warm-up."""
    seconds = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def device_seconds(cache: KVCache, out: bool, pairs: list[tuple[int, int]], repeats: int) -> float | None:
    """CUDA: median time on the device of the swap copies alone (their events)."""
    if cache.tensor.device.type != "cuda":
        return None
    seconds = []
    for _ in range(repeats):
        cache.swap(out, pairs)
        seconds.append(cache.swap_seconds())
    return statistics.median(seconds)


def raw_copies(cache: KVCache, num_bytes: int, repeats: int) -> dict[str, float]:
    """One contiguous copy of ``num_bytes`` of the cache to a host buffer (pinned on CUDA) and back."""
    device = cache.tensor.device
    numel, pinned = num_bytes // cache.tensor.element_size(), device.type == "cuda"
    host = torch.empty(numel, dtype=cache.tensor.dtype, pin_memory=pinned)
    part = cache.tensor.view(-1)[: host.numel()]
    out = timed(partial(host.copy_, part, non_blocking=True), device, repeats)
    back = timed(partial(part.copy_, host, non_blocking=True), device, repeats)
    return {"raw_out_s": out, "raw_in_s": back}


def swaps(cache: KVCache, blocks: list[int], repeats: int) -> dict[str, float | None]:
    """``blocks`` swapped out to the first host blocks and back, as the engine asks."""
    pairs = list(zip(blocks, range(len(blocks))))
    device = cache.tensor.device
    out = timed(partial(cache.swap, True, pairs), device, repeats)
    back = timed(partial(cache.swap, False, pairs), device, repeats)
    if device.type == "cuda":
        cache.swap_seconds()
    on_device = [device_seconds(cache, way, pairs, repeats) for way in (True, False)]
    return {"swap_out_s": out, "swap_in_s": back, "device_out_s": on_device[0], "device_in_s": on_device[1]}


def print_row(row: dict, num_bytes: int) -> None:
    out, back, raw_out, raw_in = row["swap_out_s"], row["swap_in_s"], row["raw_out_s"], row["raw_in_s"]
    dev = "-" if row["device_out_s"] is None else f"{row['device_out_s'] * 1e3:.2f}, {row['device_in_s'] * 1e3:.2f}"
    print(f"| {row['tokens']} {row['layout']} | {num_bytes / 2**20:.1f} | {row['blocks']} | {out * 1e3:.2f} "
          f"| {back * 1e3:.2f} | {num_bytes / out / 1e9:.1f}, {num_bytes / back / 1e9:.1f} | {dev} "
          f"| {raw_out * 1e3:.2f} | {raw_in * 1e3:.2f} | {raw_out / out:.2f}, {raw_in / back:.2f} |",
          flush=True)  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    shape = KVCacheShape(args.num_layers, args.num_kv_heads, args.head_dim, args.block_size, getattr(torch, args.dtype))
    cache = KVCache(shape, args.num_blocks, device, range(args.num_layers), num_host_blocks=args.num_blocks)
    for layer in cache.tensor:  # a layer at a time: one draw of the whole cache would pass 2**31 elements
        layer.normal_()
    cache.swap(True, [(0, 0)])  # makes the host pool
    if device.type == "cuda":
        cache.swap_seconds()
    rng = random.Random(0)
    rows = []
    print(f"device {device}, {args.dtype}, {args.num_layers} layers x {args.num_kv_heads} KV heads x {args.head_dim}, "
          f"blocks of {args.block_size}, torch threads {torch.get_num_threads()}")  # fmt: skip
    print("| tokens | MiB | blocks | swap out ms | swap in ms | GB/s (out, in) | device ms (out, in) "
          "| raw out ms | raw in ms | swap / raw speed (out, in) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        n = -(-tokens // args.block_size)
        if n > args.num_blocks:
            raise SystemExit(f"{tokens} tokens need {n} blocks; the cache has {args.num_blocks} (--num-blocks)")
        raw = raw_copies(cache, n * shape.bytes_per_block, args.repeats)
        scattered = sorted(rng.sample(range(args.num_blocks), n))
        for layout, blocks in (("consecutive", list(range(n))), ("scattered", scattered)):
            row = {"tokens": tokens, "layout": layout, "blocks": n, **swaps(cache, blocks, args.repeats), **raw}
            rows.append(row)
            print_row(row, n * shape.bytes_per_block)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
