"""One rank of an instance: its shard of the model, its KV cache, and one step of a batch.

The instance (through an executor) calls the same method on every rank with the same batch;
ranks exchange activations among themselves (all-reduce inside a stage, send/recv between
stages) and only the driver rank, TP rank 0 of the last stage, samples and answers.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distserve.core.config import EngineConfig
from distserve.core.cpu_cores import bind_process
from distserve.core.errors import RequestFault
from distserve.core.kv_cache_dtype import check_kv_cache_dtype
from distserve.core.outputs import TokenLogprobs
from distserve.core.step_metrics import StepTimer
from distserve.kv_connector.base import KVConnectorWorker
from distserve.kv_connector.swap import SwapConnectorWorker, SwapMetadata
from distserve.kv_connector.tier import TierConnectorWorker, TierMetadata
from distserve.kv_transfer.channel import KVTransfer
from distserve.kv_transfer.plan import KVCacheShape, rank_layout
from distserve.model_executor.attention import resolve_attention_backend
from distserve.model_executor.cpu_linear import can_pack, pack_linears
from distserve.model_executor.cuda_graph import DecodeGraphs
from distserve.model_executor.isolated_sampling import sample_step
from distserve.model_executor.kv_cache import KVCache, determine_num_blocks
from distserve.model_executor.model_loader import choose_dtype, load_model, resolve_device, resolve_model
from distserve.model_executor.model_runner import BatchInput, ModelRunner
from distserve.model_executor.sampler import Sampler
from distserve.parallel.process_group import create_store, init_process_group
from distserve.parallel.ranks import ParallelRank
from distserve.parallel.tensor_parallel import local_kv_heads

if TYPE_CHECKING:
    from distserve.kv_transfer.shared_memory import SharedFile

logger = logging.getLogger(__name__)


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the OS.

    A prefill step allocates and frees activations of tens of MiB. By default glibc returns them
    to the OS, and the next step faults every page in again: measured, prefill steps of 4096
    tokens took 1.15-1.53 s with up to 1.6 million page faults per run, and 1.14-1.22 s with this.
    The process keeps its peak activation memory, which the next step needs anyway.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator has its own policy
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_trim_threshold, 2**31 - 1)
    libc.mallopt(m_mmap_threshold, 1 << 30)


@dataclass
class ModelOutput:
    sampled_token_ids: list[int]  # one per sequence of the batch that samples (n at a prompt's end of n samples)
    seconds: dict[str, float] = field(default_factory=dict)  # prepare / forward / sample on the driver rank
    logprobs: list[TokenLogprobs | None] | None = None  # per sampled token, where its request asks
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None  # per sequence of the batch
    # Sequences (by index in the batch) whose own part of the step failed: their tokens are
    # placeholders, and they end with the fault (``isolated_sampling``).
    faults: dict[int, RequestFault] = field(default_factory=dict)
    # Beam search: each beam's best next tokens and their logprobs, by index in the batch.
    beam_candidates: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        parallel = config.parallel
        self.config = config
        self.rank = ParallelRank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, rank)
        self.device = resolve_device(config.model.device)
        self._store: dist.TCPStore | None = None
        # Connectors' worker halves, by the name their steps' metadata carries.
        self.kv_connectors: dict[str, KVConnectorWorker] = {SwapMetadata.connector: SwapConnectorWorker()}
        if self.device.type == "cpu":
            # Ray pins actors to one thread. One batch is in flight at a time, so only the TP ranks
            # of one stage compute at once: unbound, they share the machine's cores.
            cores = parallel.rank_cores(rank)
            if cores:
                bind_process(cores)
            threads = parallel.worker_threads() or (os.cpu_count() or 1) // self.rank.tp_size
            torch.set_num_threads(max(1, threads))
            keep_freed_memory()

    def create_store(self) -> tuple[str, int]:
        """Rank 0 hosts the instance's rendezvous store; returns its address for the other ranks."""
        self._store = create_store(self.rank.world_size)
        return self._store.host, self._store.port

    def init_model(self, host: str | None = None, port: int | None = None) -> None:
        """Join the instance's group (when there is more than one rank) and load this rank's shard."""
        tp_group = None
        if self.rank.world_size > 1:
            tp_group = init_process_group(self.rank, self.device, host, port, self._store)
        resolved = resolve_model(self.config.model)
        choice = choose_dtype(self.config.model.dtype, resolved.hf_config, self.device)
        (logger.warning if choice.slow else logger.info)("dtype: %s", choice)
        self.dtype = choice.dtype
        model, stage = load_model(
            resolved,
            self.device,
            self.dtype,
            self.config.model.load_format,
            self.config.model.seed,
            self.rank,
            tp_group,
        )
        shape = resolved.shape
        check_kv_cache_dtype(self.config.cache.kv_cache_dtype, shape.head_dim)
        self.kv_layout = rank_layout(shape.num_layers, shape.num_kv_heads, self.rank)
        self.layers = self.kv_layout.layers
        self.max_model_len = resolved.max_model_len
        self.hidden_size = shape.hidden_size
        self.kv_shape = KVCacheShape(
            len(self.layers),
            local_kv_heads(shape.num_kv_heads, self.rank.tp_size),
            shape.head_dim,
            self.config.cache.block_size,
            self.dtype,
            self.config.cache.kv_cache_dtype,
        )
        if self.config.model.cpu_packed_linear and can_pack(self.device, self.dtype):
            pack_linears(model)
        self.model, self.stage = model, stage
        self.sampler = Sampler(self.config.model.seed)

    def determine_num_blocks(self, max_useful_tokens: int) -> int:
        return determine_num_blocks(
            self.config.cache, self.kv_shape, self.device, max_useful_tokens, self.rank.world_size
        )

    def num_swap_blocks(self) -> int:
        """Blocks of this rank's part of the KV that ``cache.swap_space`` holds in host memory."""
        return int(self.config.cache.swap_space * 2**30) // self.kv_shape.bytes_per_block

    def init_kv_cache(self, num_blocks: int) -> None:
        shape = self.kv_shape
        backend = resolve_attention_backend(
            self.config.model.attention_backend, self.device, self.dtype, shape.head_dim, shape.cache_dtype
        )
        # CUDA graphs replay a whole step on one rank; a group's collectives are not captured.
        use_graphs = (
            self.device.type == "cuda"
            and backend == "triton"
            and not self.config.model.enforce_eager
            and self.rank.world_size == 1
        )
        in_place = self.config.cache.kv_transport == "auto"  # and so, on CPU, in shared memory
        # With graphs, one block past the scheduler's takes the padding rows' K/V.
        self.kv_cache = KVCache(
            self.kv_shape,
            num_blocks + (1 if use_graphs else 0),
            self.device,
            self.layers,
            shared=in_place,
            num_host_blocks=self.num_swap_blocks(),
        )
        block_size = self.config.cache.block_size
        self.model_runner = ModelRunner(self.model, self.kv_cache, block_size, self.stage, backend)
        self.kv_transfer = KVTransfer(
            self.kv_cache.tensor,
            self.kv_layout,
            shared=self.kv_cache.shared,
            in_place=in_place,
            checksum=self.config.cache.kv_transfer_checksum,
        )
        self.decode_graphs = None
        if use_graphs:
            runner = self.model_runner
            self.decode_graphs = DecodeGraphs(
                lambda ids, positions, meta: runner.forward(ids, positions, meta, None),
                self.device,
                max_batch=self.config.scheduler.max_num_seqs,
                max_blocks=-(-self.max_model_len // block_size) + 1,
                block_size=block_size,
                scratch_block=num_blocks,
            )
            self.decode_graphs.capture()

    def attach_tier(self, geometry: KVCacheShape, shared: SharedFile) -> None:
        """Map the node's prefix tier pool, this rank's layers and heads of it (``TierConnectorWorker.attach``)."""
        tier = TierConnectorWorker.attach(geometry, shared, self.kv_shape, self.kv_layout)
        self.kv_connectors[TierMetadata.connector] = tier

    def kv(self, method: str, *args):
        """A KV transfer call (``KVTransfer.<method>``); it runs beside the steps, on another thread."""
        return getattr(self.kv_transfer, method)(*args)

    def execute_model(self, batch: BatchInput) -> ModelOutput | None:
        """Run this rank's part of one step; the driver rank returns the sampled tokens."""
        timer = StepTimer()
        moves = [(self.kv_connectors[meta.connector], meta) for meta in batch.kv_connectors]
        for connector, meta in moves:  # each connector's time is its phase of the step
            connector.start_load_kv(self.kv_cache, meta)
            timer.lap(meta.connector)
        self.kv_cache.copy_blocks(batch.block_copies)  # after the loads: one may fill a block swapped out
        graphs = self.decode_graphs
        if graphs is not None and not batch.is_prefill and graphs.fits(len(batch.seqs)):
            out = graphs.run(batch.seqs)
        else:
            out = self._forward(batch, timer)
        if self.device.type == "cuda" and out is not None and self.rank.is_driver:
            torch.cuda.synchronize(self.device)  # so the forward's time is not booked to sampling
        timer.lap("forward")
        for connector, meta in moves:
            if copies := connector.get_finished(self.kv_cache):  # ran on the device before the forward pass
                timer.seconds[meta.connector] += copies
                timer.seconds["forward"] = max(0.0, timer.seconds["forward"] - copies)
            connector.wait_for_save(self.kv_cache, meta)  # every rank's part, before the answer says it is there
            timer.lap(meta.connector)
        if out is None or not self.rank.is_driver:
            return None
        sampled = sample_step(self.sampler, out, batch)  # a request's fault there is its own
        timer.lap("sample")
        return ModelOutput(
            sampled.token_ids, timer.seconds, sampled.logprobs, sampled.prompt_logprobs, sampled.faults,
            sampled.beam_candidates,
        )  # fmt: skip

    def _forward(self, batch: BatchInput, timer: StepTimer) -> torch.Tensor | None:
        """Run the batch eagerly: the logits on the last stage, None on an earlier one (its
        hidden states are sent to the next)."""
        runner = self.model_runner
        input_ids, positions, meta, logit_rows = runner.prepare(batch)
        timer.lap("prepare")
        received = None
        if not self.rank.is_first_stage:
            received = torch.empty(len(input_ids), self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(received, src=self.rank.peer_in_stage(self.rank.pp_rank - 1))
        out = runner.forward(input_ids, positions, meta, logit_rows, received)
        if not self.rank.is_last_stage:
            dist.send(out.contiguous(), dst=self.rank.peer_in_stage(self.rank.pp_rank + 1))
            return None
        return out

    def ping(self) -> int:
        return os.getpid()

    def process(self) -> tuple[str, int]:
        """This rank's Ray node id and pid: where fencing its instance kills it."""
        import ray  # a worker runs in a Ray actor; the offline engine's single rank never asks

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
