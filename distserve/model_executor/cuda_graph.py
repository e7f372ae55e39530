"""Decode steps replayed as CUDA graphs.

A decode step of a large model on a GPU is a few hundred small kernels (per layer: norms, four
projections, rotary, the cache write, attention, the MLP), each launched from Python. At small
batches the launches take longer than the kernels, so the GPU idles between them. A graph
captured once per batch size replays all of them with one launch.

A graph replays fixed addresses and shapes, so a step's inputs are copied into static buffers
sized for the largest batch, a batch runs as the smallest captured size that holds it, and the
rows past its end are padding: they write their K/V into a scratch block that no sequence owns
and their logits are dropped. Attention must read its context through device tensors only (the
block tables and positions), with no size that depends on the batch's contents: the ``triton``
backend does (``triton_attention.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from distserve.model_executor.attention import AttentionMetadata
from distserve.model_executor.model_runner import SeqInput

logger = logging.getLogger(__name__)

# Batch sizes captured up to the largest the scheduler runs: every small size, then steps of 16
# (a batch pads at most 15 rows, under 10% of its work above 160 sequences).
SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in SMALL_SIZES if s < max_batch]
    sizes += range(SIZE_STEP, max_batch, SIZE_STEP)
    return sorted({*sizes, max_batch})


ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """One CUDA graph per batch size, over static input buffers, sharing one memory pool.

    ``forward(input_ids, positions, meta)`` runs the model and returns the logits of every row;
    ``scratch_block`` is a block of the KV cache outside the block manager's range.
    """

    def __init__(
        self,
        forward: ForwardFn,
        device: torch.device,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
    ) -> None:
        self.forward = forward
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_batch)
        n = self.sizes[-1]
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:size],
            decode_positions=self.positions[:size],
            decode_block_tables=self.block_tables[:size],
        )

    def _run(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its pool. The buffers
        hold padding while capturing: warm-up runs write to the scratch block only."""
        start = time.perf_counter()
        pool = None
        side = torch.cuda.Stream(self.input_ids.device)
        for size in reversed(self.sizes):
            # Warm-up off the capturing stream: Triton compiles its kernels and cuBLAS picks its
            # algorithms here, neither of which may happen inside a capture.
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._run(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.input_ids.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode graphs (batch %s) in %.1f s", len(self.sizes), self.sizes, self.capture_seconds)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def run(self, seqs: list[SeqInput]) -> torch.Tensor:
        """The logits ``[batch, vocab]`` of one decode step of ``seqs``."""
        b = len(seqs)
        size = next(s for s in self.sizes if s >= b)
        bs = self.block_size
        positions = [seq.start for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        width = max(map(len, tables))
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        host = torch.tensor([[seq.input_token_ids[-1] for seq in seqs], positions, slots], dtype=torch.long)
        self.input_ids[:b].copy_(host[0])
        self.positions[:b].copy_(host[1])
        self.slot_mapping[:b].copy_(host[2])
        # Padding rows write to the scratch block and read from position 0 of whatever block
        # their table row names: a stale row from an earlier, larger batch is a valid block.
        self.positions[b:size].zero_()
        self.slot_mapping[b:size].fill_(self.scratch_slot)
        # Only the columns that hold context are read; those past a row's end may be stale.
        padded = [t + [t[-1]] * (width - len(t)) for t in tables]
        self.block_tables[:b, :width].copy_(torch.tensor(padded, dtype=torch.int32))
        self.graphs[size].replay()
        return self.logits[size][:b]
