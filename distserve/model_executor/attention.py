"""Paged attention plugged into transformers' attention interface.

A batch runs as one packed sequence ``[1, num_tokens]``: decode tokens first, then prompt chunks.
Each attention layer first writes the batch's new K/V into its cache slots, then attends. The
batch's metadata reaches the layers through a per-forward context, because transformers calls
the attention function with the model's own arguments only.

Four implementations, chosen by ``attention_backend``:

- ``cpp`` (the default on CPU, float32 or bfloat16): a hand-written C++ kernel (``cpu_kernel.py``) reads
  K/V where they sit through the block tables, for every query row of the batch (decode tokens,
  prompts, prompt chunks after a cached prefix) in one call per layer.
- ``compiled``: decode reads K/V in place in a kernel ``torch.compile`` builds once per model when
  the engine starts (any dtype); prefill as ``sdpa``.
- ``triton`` (the default on CUDA): decode reads K/V in place in a Triton kernel
  (``triton_attention.py``) that takes its context lengths from device tensors, so a decode step
  can be captured as a CUDA graph (``cuda_graph.py``); prefill as ``sdpa``.
- ``sdpa`` (the reference): decode copies each sequence's blocks into a
  padded buffer and runs one SDPA over the batch; a prompt chunk after a cached prefix gathers its
  blocks and runs SDPA with a causal mask, one sequence at a time.

At 57-64 sequences on CPU, the in-place kernels halve decode step time or better.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from distserve.core.kv_cache_dtype import is_quantized
from distserve.model_executor.cpu_kernel import KERNEL_DTYPES, kernel_available, load_kernel, paged_attention_cpu
from distserve.model_executor.kv_quant import dequantize_kv, quantize_kv

ATTN_IMPLEMENTATION = "distserve_paged"
NO_WINDOW = 1 << 30  # a sliding window wider than any context


@dataclass
class PrefillSeqMeta:
    """Where one sequence of a prefill batch sits in the packed tokens and the cache."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + new tokens
    block_ids: torch.Tensor | None  # the sequence's blocks when part of its context is cached, else None


def padded_block_tables(tables: list[list[int]]) -> list[list[int]]:
    """Block tables of one length, the longest one's, padded with block 0 (never read: past each
    sequence's context)."""
    width = max(map(len, tables))
    return [table + [0] * (width - len(table)) for table in tables]


@dataclass
class PagedQueries:
    """A batch's query rows by sequence, for the C++ kernel to attend over the cache in place (``cpp``)."""

    block_tables: torch.Tensor  # [seqs, max_blocks], padded with block 0
    query_starts: torch.Tensor  # [seqs] its first row in the packed batch
    query_lens: torch.Tensor  # [seqs] its rows: 1 when it decodes
    context_lens: torch.Tensor  # [seqs] its positions, the query rows' included (they are the last)

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int, int]], device) -> PagedQueries:
        """From each sequence's (block table, first row, rows, context length)."""
        tables = padded_block_tables([table for table, *_ in seqs])
        columns = [tables, *([entry[i] for entry in seqs] for i in (1, 2, 3))]
        return cls(*(torch.tensor(column, dtype=torch.long, device=device) for column in columns))


@dataclass
class DecodePlan:
    """A decode batch's context as (sequence, block) pairs: the compiled kernel works over the
    blocks that hold context only, not over every sequence padded to the longest one's blocks."""

    pair_seq: torch.Tensor  # [pairs] the sequence each pair belongs to
    pair_block: torch.Tensor  # [pairs] its cache block
    pair_first: torch.Tensor  # [pairs] position of the block's first token
    pair_index: torch.Tensor  # [batch, max_blocks] pair of each sequence's j-th block; past its end, ``pairs``

    @classmethod
    def build(cls, block_tables: list[list[int]], positions: list[int], block_size: int, device) -> DecodePlan:
        counts = [p // block_size + 1 for p in positions]
        width = max(counts)
        pair_seq = [i for i, n in enumerate(counts) for _ in range(n)]
        pair_block = [b for table, n in zip(block_tables, counts) for b in table[:n]]
        pair_first = [j * block_size for n in counts for j in range(n)]
        pairs, index, offset = len(pair_seq), [], 0
        for n in counts:
            index.append([*range(offset, offset + n), *[pairs] * (width - n)])
            offset += n
        plan = cls(
            *(torch.tensor(x, dtype=torch.long, device=device) for x in (pair_seq, pair_block, pair_first, index))
        )
        mark_sizes_dynamic(plan.pair_seq, plan.pair_block, plan.pair_first, plan.pair_index)
        torch._dynamo.decorators.mark_unbacked(plan.pair_index, 1)
        return plan


def mark_sizes_dynamic(*tensors: torch.Tensor) -> None:
    """Let the first dimension of each take any size in the compiled kernel. Unbacked, not
    merely dynamic: a dynamic size is still specialised when it is 1, and a process would compile
    up to four kernels (one sequence or many, one block or many) instead of one."""
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)


@dataclass
class AttentionMetadata:
    is_prefill: bool  # whether prompt tokens run; with chunked prefill the first num_decode_tokens decode
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    prefill_seqs: list[PrefillSeqMeta] | None = None
    num_decode_tokens: int = 0  # in a prefill batch: decode tokens packed before the prompts' tokens
    decode_block_tables: torch.Tensor | None = None  # [batch, max_blocks], padded (sdpa, triton)
    decode_mask: torch.Tensor | None = None  # [batch, 1, 1, max_blocks * block_size] valid positions (sdpa)
    decode_positions: torch.Tensor | None = None  # [batch] position of each query token
    decode_plan: DecodePlan | None = None  # the compiled kernel's view of the decode context (compiled)
    paged: PagedQueries | None = None  # every row of the batch, by sequence (cpp)


class GatherBuffers:
    """Reused destinations for K/V gathered block by block.

    A decode step gathers the whole batch's context once per layer; allocating those many-MiB
    tensors afresh costs page faults that take longer than the copy itself.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_ids`` (any shape), as ``[*block_ids.shape, block_size, kv_heads, dim]``."""
        row = block_size * k_cache.shape[1] * k_cache.shape[2]
        n = block_ids.numel()
        if self._k is None or self._k.numel() < n * row or self._k.dtype != k_cache.dtype:
            self._k = torch.empty(n * row, dtype=k_cache.dtype, device=k_cache.device)
            self._v = torch.empty_like(self._k)
        shape = (*block_ids.shape, block_size, *k_cache.shape[1:])
        out = []
        for cache, buffer in ((k_cache, self._k), (v_cache, self._v)):
            dest = buffer[: n * row].view(n, row)
            torch.index_select(cache.view(-1, row), 0, block_ids.reshape(-1), out=dest)
            out.append(dest.view(shape))
        return out[0], out[1]


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer index -> (k, v) of [slots, kv_heads, slot_width]
    buffers: GatherBuffers
    attention_backend: str = "sdpa"  # a resolved attention backend: cpp, compiled, triton or sdpa
    cache_dtype: str = "auto"  # what the cache stores (``core/kv_cache_dtype.py``)


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    global _context
    previous, _context = _context, context
    try:
        yield
    finally:
        _context = previous


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query ``[1, heads, tokens, dim]``, key/value ``[1, kv_heads, tokens, dim]`` -> ``[1, tokens, heads, dim]``."""
    if _context is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called outside a distserve forward pass")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by distserve's paged attention")
    meta = _context.metadata
    k_cache, v_cache = _context.kv_caches[module.layer_idx]
    new_k = key[0].transpose(0, 1)  # [tokens, kv_heads, dim]
    new_v = value[0].transpose(0, 1)
    cache_dtype = _context.cache_dtype
    if is_quantized(cache_dtype):
        new_k, new_v = quantize_kv(new_k, cache_dtype), quantize_kv(new_v, cache_dtype)
    k_cache.index_copy_(0, meta.slot_mapping, new_k)
    v_cache.index_copy_(0, meta.slot_mapping, new_v)
    gqa = query.shape[1] != key.shape[1]
    q = query[0]
    if _context.attention_backend == "cpp":  # every row in one call, over the cache the new K/V are in
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        window = NO_WINDOW if sliding_window is None else sliding_window
        p = meta.paged
        out = paged_attention_cpu(q.transpose(0, 1), k_cache, v_cache, p.block_tables, p.query_starts, p.query_lens,
                                  p.context_lens, meta.block_size, scale, window, cache_dtype)  # fmt: skip
    elif not meta.is_prefill:
        out = _decode_attention(q, k_cache, v_cache, scaling, sliding_window, gqa)
    else:
        out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
        _prefill_attention(q, key[0], value[0], k_cache, v_cache, scaling, sliding_window, gqa, out)
        if meta.num_decode_tokens:  # chunked prefill: decode tokens first, as one batched call
            q_decode = q[:, : meta.num_decode_tokens]
            out[: meta.num_decode_tokens] = _decode_attention(q_decode, k_cache, v_cache, scaling, sliding_window, gqa)
    return out.unsqueeze(0), None


def _prefill_attention(q, k, v, k_cache, v_cache, scaling, sliding_window, gqa, out: torch.Tensor) -> None:
    """Causal attention of each prompt's new tokens over its whole context, into their rows of
    ``out`` ``[tokens, heads, dim]``."""
    meta = _context.metadata
    for s in meta.prefill_seqs:
        cached = s.context_len > s.query_len
        end = s.query_start + s.query_len
        qs = q[:, s.query_start : end]
        if not cached:  # the fresh K/V are the whole context
            ks, vs = k[:, s.query_start : end], v[:, s.query_start : end]
        else:
            ks, vs = _gather_values(k_cache, v_cache, s.block_ids, q.dtype)
            ks = ks.flatten(0, 1)[: s.context_len].transpose(0, 1)
            vs = vs.flatten(0, 1)[: s.context_len].transpose(0, 1)
        # With a batch dimension: SDPA's fused kernels (flash on CUDA) take 4-D inputs only, and
        # 3-D ones fell back to its math path, which on an H100 multiplied bfloat16 prompts in
        # float32 GEMMs (a fifth of a prefill step's GPU time).
        qs, ks, vs = qs[None], ks[None], vs[None]
        if sliding_window is None and not cached:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            mask = _causal_mask(s.query_len, s.context_len, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[s.query_start : end] = o[0].transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, scaling, sliding_window, gqa) -> torch.Tensor:
    """One query token per sequence over its cached context. Returns ``[batch, heads, dim]``."""
    meta = _context.metadata
    if _context.attention_backend == "triton":
        from distserve.model_executor.triton_attention import paged_decode_triton

        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        positions = meta.decode_positions
        if sliding_window is None:
            oldest = torch.zeros_like(positions)
        else:
            oldest = (positions - (sliding_window - 1)).clamp_min(0)
        q = q.transpose(0, 1)  # [batch, heads, dim], read in place through its strides
        tables = meta.decode_block_tables
        return paged_decode_triton(
            q, k_cache, v_cache, tables, positions, oldest, meta.block_size, scale, cache_dtype=_context.cache_dtype
        )
    if _context.attention_backend == "compiled":
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        positions = meta.decode_positions
        oldest = positions - (NO_WINDOW if sliding_window is None else sliding_window - 1)
        # A fresh contiguous copy (small): with one sequence, the transposed view's strides differ
        # from those of a larger batch, and the kernel would be compiled again for them.
        q = q.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        mark_sizes_dynamic(q, positions, oldest)
        plan, size = meta.decode_plan, meta.block_size
        return _compiled_paged_decode(q, k_cache, v_cache, plan, positions, oldest, size, scale, _context.cache_dtype)
    qs = q.transpose(0, 1).unsqueeze(2)  # [batch, heads, 1, dim]
    ks, vs = _gather_values(k_cache, v_cache, meta.decode_block_tables, q.dtype)
    ks = ks.flatten(1, 2).transpose(1, 2)  # [batch, kv_heads, ctx, dim]
    vs = vs.flatten(1, 2).transpose(1, 2)
    mask = meta.decode_mask
    if sliding_window is not None:
        ctx = torch.arange(ks.shape[2], device=q.device)
        mask = mask & (ctx > meta.decode_positions[:, None] - sliding_window)[:, None, None, :]
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return o.squeeze(2)


def _gather_values(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``block_ids`` as values in ``dtype`` (an 8-bit cache's dequantized), as
    ``[*block_ids.shape, block_size, kv_heads, head_dim]``."""
    ks, vs = _context.buffers.gather(k_cache, v_cache, block_ids, _context.metadata.block_size)
    cache_dtype = _context.cache_dtype
    if not is_quantized(cache_dtype):
        return ks, vs
    return dequantize_kv(ks, cache_dtype, dtype), dequantize_kv(vs, cache_dtype, dtype)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    positions: torch.Tensor,
    oldest: torch.Tensor,
    block_size: int,
    scale: float,
    cache_dtype: str = "auto",
) -> torch.Tensor:
    """q ``[batch, heads, dim]`` over each sequence's context from ``oldest`` to ``positions``
    ``[batch]``, K/V ``[slots, kv_heads, dim]`` read in place block by block (``plan``).

    Split by block, as flash-decoding splits the context: each block's scores give a partial
    softmax (its maximum, sum and weighted values), and the partials of a sequence are combined
    rescaled to their common maximum. Plain tensor ops for ``torch.compile``, which fuses the
    block indexing into the products, so the context is read where it is and never copied."""
    batch, heads, dim = q.shape
    kv_heads, width = k_cache.shape[1], k_cache.shape[2]
    # [pairs, kv_heads, block, dim]
    k = k_cache.view(-1, block_size, kv_heads, width)[plan.pair_block].permute(0, 2, 1, 3)
    v = v_cache.view(-1, block_size, kv_heads, width)[plan.pair_block].permute(0, 2, 1, 3)
    if is_quantized(cache_dtype):
        k, v = dequantize_kv(k, cache_dtype, q.dtype), dequantize_kv(v, cache_dtype, q.dtype)
    q = (q * scale).view(batch, kv_heads, heads // kv_heads, dim)[plan.pair_seq]  # heads grouped by their KV head
    # Products written as broadcast sums, not einsums: inductor's loops over them were 2.3x
    # faster with grouped query heads (8:2), and as fast without.
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)  # [pairs, kv_heads, group, block]
    token = plan.pair_first[:, None] + torch.arange(block_size, device=q.device)[None, :]
    hidden = (token > positions[plan.pair_seq, None]) | (token < oldest[plan.pair_seq, None])
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    block_max = scores.amax(-1)  # -inf for a block wholly outside the window
    weights = torch.exp(scores - torch.where(block_max == float("-inf"), 0.0, block_max)[..., None])
    block_sum = weights.sum(-1)
    block_out = (weights[..., None] * v[:, :, None, :, :]).sum(3)  # [pairs, kv_heads, group, dim]
    # Combine each sequence's blocks: [batch, max_blocks, kv_heads, group], padding masked out.
    present = plan.pair_index < plan.pair_seq.shape[0]
    index = torch.where(present, plan.pair_index, 0)
    maxes = torch.where(present[:, :, None, None], block_max[index], float("-inf"))
    rescale = torch.exp(maxes - maxes.amax(1, keepdim=True))
    total = (rescale * block_sum[index]).sum(1)
    out = (rescale[..., None] * block_out[index]).sum(1) / total[..., None]
    return out.view(batch, heads, dim)


# The batch, pair and block counts are symbolic (``mark_sizes_dynamic``) while the model's
# shapes, block size and scale stay constants: one kernel per model. With every size symbolic
# (dynamic=True) the kernel was 2.7x slower.
_compiled_paged_decode = torch.compile(paged_decode)


def resolve_attention_backend(
    backend: str, device: torch.device, dtype: torch.dtype, head_dim: int = 64, cache_dtype: str = "auto"
) -> str:
    """``auto``: on CPU the C++ kernel for float32 and bfloat16 (1.5x the compiled kernel's speed
    alone in float32, and no compile at start-up) when it builds, else the compiled kernel when inductor finds the C++
    compiler it needs; on CUDA the Triton kernel when Triton is installed, the head size is a
    power of two and the GPU reads the cache dtype (fp8: compute capability 8.9); SDPA elsewhere.
    ``cpp`` or ``triton`` where it cannot run is an error."""
    if backend == "triton":
        from distserve.model_executor.triton_attention import supports_cache_dtype, supports_head_dim, triton_available

        if device.type != "cuda" or not triton_available():
            raise ValueError(f"attention_backend 'triton' runs on CUDA with Triton installed, not on {device.type}")
        if not supports_head_dim(head_dim):
            raise ValueError(f"attention_backend 'triton' needs a power-of-two head size, not {head_dim}")
        if not supports_cache_dtype(cache_dtype, device):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"attention_backend 'triton' reads an fp8 KV cache on GPUs of compute capability 8.9 or newer, "
                f"not {major}.{minor}: use kv_cache_dtype 'int8', or attention_backend 'sdpa'"
            )
        return backend
    if backend == "cpp":
        if device.type != "cpu" or dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"attention_backend 'cpp' runs on CPU in float32 or bfloat16, not {device.type} in {dtype}"
            )
        load_kernel()  # raises KernelUnavailable with the compiler's message
        return backend
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from distserve.model_executor.triton_attention import supports_cache_dtype, supports_head_dim, triton_available

        usable = triton_available() and supports_head_dim(head_dim) and supports_cache_dtype(cache_dtype, device)
        return "triton" if usable else "sdpa"
    if device.type != "cpu":
        return "sdpa"
    if dtype in KERNEL_DTYPES and kernel_available():
        return "cpp"
    from torch._inductor import cpp_builder, exc  # imported here: 0.7 s that other backends need not pay

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return "sdpa"
    return "compiled"


def _causal_mask(query_len: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """``[query_len, context_len]``: query i sits at position ``context_len - query_len + i``."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _no_mask(*args, **kwargs) -> None:
    """The paged attention function builds its own masks from the forward context."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
