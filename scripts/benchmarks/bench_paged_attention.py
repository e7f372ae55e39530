"""One attention layer over a paged KV cache: the C++ kernel (``attention_backend: cpp``) against
the reference path (``sdpa``: blocks gathered into a buffer, then SDPA), on the same cache and
queries, in one process.

Shapes: a decode step (one token for each of 64 sequences of 32-700 tokens), prompt chunks after
a cached prefix (the chunks of chunked prefill, or a prompt whose prefix the cache held), and whole
prompts with nothing cached (SDPA over their own fresh K/V, causal, as the reference runs them).
Prints the mean time of each path, their ratio, and the largest difference between their outputs,
for each of ``--dtypes`` (the cache, queries and outputs in that dtype), and the C++ kernel's time
in each dtype against its time in the first.

    python scripts/benchmarks/bench_paged_attention.py [--threads 2] [--heads 8 --kv-heads 8 --head-dim 64]
    python scripts/benchmarks/bench_paged_attention.py --threads 1 --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from distserve.model_executor.attention import NO_WINDOW, GatherBuffers, _causal_mask, padded_block_tables
from distserve.model_executor.cpu_kernel import load_kernel, paged_attention_cpu

BLOCK_SIZE = 16
# (label, [(query tokens, context length) per sequence])
SHAPES = [
    ("decode, 64 sequences", None),
    ("chunk 256 after 256 cached", [(256, 512)]),
    ("chunk 256 after 512 cached", [(256, 768)]),
    ("4 chunks of 64 after 636 cached", [(64, 700)] * 4),
    ("8 chunks of 16 after 584 cached", [(16, 600)] * 8),
    ("prompt of 768, nothing cached", [(768, 768)]),
    ("prompt of 256, nothing cached", [(256, 256)]),
    ("4 prompts of 64, nothing cached", [(64, 64)] * 4),
    ("2 prompts of 512, nothing cached", [(512, 512)] * 2),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch (and OpenMP) threads")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    args = p.parse_args()
    args.dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    return args


def mean_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


class Layer:
    """A cache holding ``seqs`` (query tokens, context length) in blocks in random order, and queries."""

    def __init__(self, seqs: list[tuple[int, int]], args: argparse.Namespace, dtype: torch.dtype, seed: int) -> None:
        self.seqs, self.scale = seqs, args.head_dim**-0.5
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-n // BLOCK_SIZE) for _, n in seqs)
        shape = (num_blocks * BLOCK_SIZE, args.kv_heads, args.head_dim)
        self.k_cache, self.v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for _, n in seqs]
        self.q = torch.randn(sum(count for count, _ in seqs), args.heads, args.head_dim, generator=gen).to(dtype)
        self.starts = [sum(count for count, _ in seqs[:i]) for i in range(len(seqs))]
        self.buffers = GatherBuffers()
        # A prompt with nothing cached attends over the K/V its layer just computed: no gather.
        self.fresh = [
            tuple(x.clone() for x in self._gathered(table, n)) if count == n else None
            for (count, n), table in zip(seqs, self.tables)
        ]

    def _gathered(self, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.buffers.gather(self.k_cache, self.v_cache, torch.tensor(table), BLOCK_SIZE)
        return tuple(x.flatten(0, 1)[:n].transpose(0, 1) for x in (k, v))

    def cpp(self) -> torch.Tensor:
        tables = torch.tensor(padded_block_tables(self.tables))
        lens, contexts = (torch.tensor(column) for column in zip(*self.seqs))
        return paged_attention_cpu(self.q, self.k_cache, self.v_cache, tables, torch.tensor(self.starts), lens,
                                   contexts, BLOCK_SIZE, self.scale, NO_WINDOW)  # fmt: skip

    def sdpa(self) -> torch.Tensor:
        """As the ``sdpa`` backend: a decode step in one batched call over a padded gather; a
        prompt per sequence, over its fresh K/V or over K/V gathered from its blocks."""
        if all(count == 1 for count, _ in self.seqs):
            return self._sdpa_decode()
        out = torch.empty_like(self.q)
        for (count, n), table, start, fresh in zip(self.seqs, self.tables, self.starts, self.fresh):
            q = self.q[start : start + count].transpose(0, 1)
            if fresh is not None:
                k, v = fresh
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                k, v = self._gathered(table, n)
                mask = _causal_mask(count, n, None, "cpu")
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + count] = o.transpose(0, 1)
        return out

    def _sdpa_decode(self) -> torch.Tensor:
        tables = torch.tensor(padded_block_tables(self.tables))
        width = tables.shape[1]
        k, v = self.buffers.gather(self.k_cache, self.v_cache, tables, BLOCK_SIZE)
        k, v = (x.flatten(1, 2).transpose(1, 2) for x in (k, v))
        positions = torch.tensor([n - 1 for _, n in self.seqs])
        mask = (torch.arange(width * BLOCK_SIZE)[None, :] <= positions[:, None])[:, None, None, :]
        q = self.q.unsqueeze(2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True).squeeze(2)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_kernel()
    gen = torch.Generator().manual_seed(0)
    decode = [(1, n) for n in torch.randint(32, 700, (64,), generator=gen).tolist()]
    first = str(args.dtypes[0]).removeprefix("torch.")
    print(f"{args.heads} query heads, {args.kv_heads} KV heads, head size {args.head_dim}, {args.threads} threads")
    print(f"{'shape':<34} {'dtype':>9} {'cpp ms':>8} {'sdpa ms':>8} {'sdpa/cpp':>9} {'max diff':>9} "
          f"{f'cpp {first}/this':>19}")  # fmt: skip
    for seed, (label, seqs) in enumerate(SHAPES):
        baseline = None
        for dtype in args.dtypes:
            layer = Layer(seqs or decode, args, dtype, seed)  # the same values, rounded to each dtype
            diff = (layer.cpp().float() - layer.sdpa().float()).abs().max().item()
            cpp, sdpa = mean_ms(layer.cpp, args.repeats), mean_ms(layer.sdpa, args.repeats)
            baseline = baseline or cpp
            name = str(dtype).removeprefix("torch.")
            print(f"{label:<34} {name:>9} {cpp:>8.2f} {sdpa:>8.2f} {sdpa / cpp:>8.2f}x {diff:>9.1e} "
                  f"{baseline / cpp:>18.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
