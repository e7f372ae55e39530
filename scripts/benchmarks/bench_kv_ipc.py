"""KV pulled in place between two processes, against a raw copy of the same bytes: over CUDA IPC
on one GPU, or (``--device cpu``) over shared memory.

Two spawned processes each hold one rank's KV cache of a Llama-3-8B shape (32 layers, 8 KV heads
of 128, bfloat16, blocks of 16 tokens): a prefill rank and a decode rank, joined by a KV channel,
which picks CUDA IPC (on CPU: shared memory, the prefill rank's cache in a memory file). For each
token count the decode rank pulls that many tokens from scattered blocks of the prefill rank's
cache into scattered blocks of its own, as the migrator asks it (``recv`` with both sides' slots,
timed on the decode rank until its copies are done: on CUDA one Triton gather-scatter over every
layer, on CPU a copy per run of consecutive slots), then the same through torch's per-layer
gather and scatter (the fallback without Triton), and then copies the same bytes in one
contiguous piece out of the prefill rank's cache through the same mapping (``recv_probe``): the
raw speed. The pull is timed with its check (``cache.kv_transfer_checksum``: the decode rank
digests what it received, inside ``recv``) and without; the prefill rank's digest of what it sent is
timed on the same slots. Medians of the repeats, after one warm-up each.

    python scripts/benchmarks/bench_kv_ipc.py [--tokens 512,2048,8192] [--repeats 10] [--json kv_ipc.json]
    python scripts/benchmarks/bench_kv_ipc.py --device cpu --dtype float32 --num-layers 8 --num-blocks 600 \
        --tokens 128,512,2048,4096 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import torch
import torch.multiprocessing as mp

from distserve.kv_transfer.channel import NCCL_MESSAGE_TOKENS, KVTransfer
from distserve.kv_transfer.checksum import kv_digest
from distserve.kv_transfer.plan import KVLayout, token_slots
from distserve.kv_transfer.shared_memory import shared_zeros
from distserve.kv_transfer.slot_copy import copy_slots
from distserve.model_executor.worker import keep_freed_memory

CHANNEL = "bench-prefill.0>bench-decode.0"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,2048,8192", help="tokens per pull, comma-separated")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="blocks of each rank's cache")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--threads", type=int, help="CPU: the decode rank's torch threads (default: torch's)")
    p.add_argument("--chunk-tokens", type=int, default=NCCL_MESSAGE_TOKENS, help="tokens of one layer per copy")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    return p.parse_args()


def make_rank(args: argparse.Namespace, seed: int, shared: bool) -> KVTransfer:
    """One rank's cache ``[layers, 2, slots, kv_heads, head_dim]`` on cuda:0 (or CPU, in shared
    memory if ``shared``), holding every layer and head, and its end of the KV channels."""
    layout = KVLayout(range(args.num_layers), range(args.num_kv_heads))
    shape = (args.num_layers, 2, args.num_blocks * args.block_size, args.num_kv_heads, args.head_dim)
    dtype, device = getattr(torch, args.dtype), "cuda:0" if args.device == "cuda" else "cpu"
    if args.device == "cpu" and shared:
        cache, file = shared_zeros(shape, dtype)
    else:
        cache, file = torch.empty(shape, dtype=dtype, device=device), None
    generator = torch.Generator(device).manual_seed(seed)
    for layer in cache:  # a layer at a time: one draw of the whole cache would pass 2**31 elements
        layer.normal_(generator=generator)
    # Checked: the pull is timed with its digest, as ``kv_transfer_checksum: on`` runs it in place.
    return KVTransfer(cache, layout, chunk_tokens=args.chunk_tokens, shared=file, checksum="on")


def source(args: argparse.Namespace, addresses: Queue, results: Queue, done: Event) -> None:
    """The prefill rank: hosts the store, connects, and keeps its cache until the run is done (the
    decode rank reads it in place; ``send`` moves nothing)."""
    try:
        transfer = make_rank(args, seed=1, shared=True)
        address = transfer.store_address()
        addresses.put(address)
        transfer.connect(CHANNEL, True, address)
        done.wait(args.timeout)
    except BaseException:
        results.put({"error": f"the prefill rank failed:\n{traceback.format_exc()}"})


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call`` after one warm-up; ``call`` returns once the copies are done."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_pull(transfer: KVTransfer, dst_slots: list[int], src_slots: list[int]) -> None:
    """The pull of ``recv`` with torch's per-layer copy in place of the kernel: every layer and head."""
    transport, peer = transfer._link(CHANNEL)
    src_cache = peer.tensor
    with transport._copying():
        index = torch.tensor(dst_slots, dtype=torch.long, device=transfer.device)
        src_index = torch.tensor(src_slots, dtype=torch.long, device=transfer.device)
        copy_slots(transfer.kv_tensor, index, src_cache, src_index, transfer.chunk_tokens, kernel=False)


def destination(args: argparse.Namespace, addresses: Queue, results: Queue) -> None:
    """The decode rank: connects, then for each token count pulls from scattered blocks and copies
    the same bytes contiguously; puts its figures (or its error) on ``results``."""
    try:
        if args.device == "cpu":  # as a worker: its temporaries reused, not faulted in afresh
            keep_freed_memory()
        if args.threads:
            torch.set_num_threads(args.threads)
        transfer = make_rank(args, seed=2, shared=False)
        transfer.connect(CHANNEL, False, addresses.get(timeout=args.timeout))
        expected = "ipc" if args.device == "cuda" else "shm"
        if transfer.transport(CHANNEL) != expected:
            raise RuntimeError(f"the channel chose {transfer.transport(CHANNEL)}, not {expected}")
        layers, heads = range(args.num_layers), range(args.num_kv_heads)
        rng = random.Random(0)
        rows = []
        for tokens in [int(x) for x in args.tokens.split(",")]:
            num_blocks = math.ceil(tokens / args.block_size)
            # Blocks drawn at random on each side: a pull from and into a fragmented cache.
            src_slots = token_slots(rng.sample(range(args.num_blocks), num_blocks), tokens, args.block_size)
            dst_slots = token_slots(rng.sample(range(args.num_blocks), num_blocks), tokens, args.block_size)
            num_bytes = transfer.recv(CHANNEL, dst_slots, layers, heads, src_slots).num_bytes
            # A check of what arrived, first and last layer: the source's cache is mapped here.
            src_cache = transfer._link(CHANNEL)[1].tensor
            for layer in (0, args.num_layers - 1):
                if not torch.equal(transfer.kv_tensor[layer][:, dst_slots], src_cache[layer][:, src_slots]):
                    raise RuntimeError(f"layer {layer} of a {tokens}-token pull differs from the source")
            pull_once = partial(transfer.recv, CHANNEL, dst_slots, layers, heads, src_slots)
            pull = median_seconds(pull_once, args.repeats)
            transfer.checksum = "off"
            unchecked = median_seconds(pull_once, args.repeats)
            transfer.checksum = "on"
            source_digest = median_seconds(partial(kv_digest, src_cache, src_slots), args.repeats)
            fallback = median_seconds(partial(torch_pull, transfer, dst_slots, src_slots), args.repeats)
            raw = median_seconds(partial(transfer.recv_probe, CHANNEL, num_bytes), args.repeats)
            row = {"tokens": tokens, "bytes": num_bytes, "pull_seconds": pull, "torch_seconds": fallback}
            check = {"unchecked_seconds": unchecked, "source_digest_seconds": source_digest}
            rows.append(row | check | {"raw_seconds": raw})
        if args.device == "cuda":
            where = f"{torch.cuda.get_device_name(0)}, two processes on one GPU over CUDA IPC"
        else:
            where = f"CPU, two processes over shared memory, {torch.get_num_threads()} torch thread(s) pulling"
        results.put({"device": where, "rows": rows})
    except BaseException:
        results.put({"error": f"the decode rank failed:\n{traceback.format_exc()}"})


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kv_ipc.py needs a CUDA device, and none is visible.", file=sys.stderr)
        sys.exit(2)
    most = max(int(x) for x in args.tokens.split(","))
    if most > args.num_blocks * args.block_size:
        sys.exit(f"{most} tokens do not fit in {args.num_blocks} blocks of {args.block_size}")
    ctx = mp.get_context("spawn")
    addresses, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    processes = [
        ctx.Process(target=source, args=(args, addresses, results, done), daemon=True),
        ctx.Process(target=destination, args=(args, addresses, results), daemon=True),
    ]
    for p in processes:
        p.start()
    try:
        answer = results.get(timeout=args.timeout)
    except queue.Empty:
        answer = {"error": f"no figures within {args.timeout:.0f} s"}
    finally:
        done.set()
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if "error" in answer:
        sys.exit(answer["error"])

    print(
        f"\n{answer['device']}: {args.num_layers} layers, {args.num_kv_heads} KV heads of {args.head_dim}, "
        f"{args.dtype}, blocks of {args.block_size}; medians of {args.repeats}\n"
    )
    print(
        "| tokens | KV MiB | pull ms | GB/s | unchecked pull ms | source digest ms | check's share | "
        "torch per-layer ms | raw copy ms | raw GB/s | pull / raw speed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in answer["rows"]:
        pull, raw, num_bytes = row["pull_seconds"], row["raw_seconds"], row["bytes"]
        unchecked, source_digest = row["unchecked_seconds"], row["source_digest_seconds"]
        # Both ends' digests against the pull without them (the source's runs in its own process,
        # but the pull waits for its answer).
        share = (pull - unchecked + source_digest) / unchecked
        row.update(pull_gb_per_s=num_bytes / pull / 1e9, raw_gb_per_s=num_bytes / raw / 1e9, ratio=raw / pull)
        row.update(check_share=share)
        print(
            f"| {row['tokens']} | {num_bytes / 2**20:.1f} | {pull * 1e3:.2f} | {row['pull_gb_per_s']:.1f} "
            f"| {unchecked * 1e3:.2f} | {source_digest * 1e3:.2f} | {share:.0%} "
            f"| {row['torch_seconds'] * 1e3:.2f} | {raw * 1e3:.2f} | {row['raw_gb_per_s']:.1f} | {row['ratio']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": answer["device"], "args": vars(args), "rows": answer["rows"]}, f, indent=2)


if __name__ == "__main__":
    main()
