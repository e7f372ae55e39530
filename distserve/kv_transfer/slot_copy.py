"""Copy the K/V of token slots from one cache to another on the same device, every layer at once.

A pull in place reads the source's cache where it lies (mapped into this process) and writes
the destination's: the whole transfer is one gather-scatter. In Triton it is one launch that
reads each byte once and writes it once. Without Triton it falls back to torch's gather into a
temporary chunk and scatter out of it, a pair of kernels per layer and chunk, which moves every
byte twice. On CPU (``copy_slot_runs``) slots consecutive on both sides move together, one
strided copy over every layer each: a pull's slots come in whole blocks, so a run is a block or
more, and each byte is read once and written once.

Triton is optional and compiled on first use, as in ``triton_attention.py`` (whose tests run
under ``TRITON_INTERPRET``, as these do).
"""

import functools

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

# Elements one program moves: 16 rows of 8 heads x 128 (bfloat16: 32 KiB read, 32 KiB written).
_PROGRAM_ELEMENTS = 16384


if triton is not None:

    def _copy_slots_kernel(
        src_ptr,
        dst_ptr,
        src_slots_ptr,
        dst_slots_ptr,
        num_tokens,
        src_stride_layer,
        src_stride_kv,
        src_stride_slot,
        dst_stride_layer,
        dst_stride_kv,
        dst_stride_slot,
        ROW: tl.constexpr,
        ROW_PAD: tl.constexpr,
        TOKENS: tl.constexpr,
    ):
        """One program per (chunk of ``TOKENS`` tokens, layer x K/V): their rows of ``ROW``
        contiguous elements (the heads moved, times head_dim) from source slots to destination slots."""
        tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
        layer = tl.program_id(1) // 2
        kv = tl.program_id(1) % 2
        ok = tok < num_tokens
        src_slot = tl.load(src_slots_ptr + tok, mask=ok, other=0).to(tl.int64)
        dst_slot = tl.load(dst_slots_ptr + tok, mask=ok, other=0).to(tl.int64)
        col = tl.arange(0, ROW_PAD)
        mask = ok[:, None] & (col < ROW)[None, :]
        src = src_ptr + layer * src_stride_layer + kv * src_stride_kv + src_slot[:, None] * src_stride_slot
        dst = dst_ptr + layer * dst_stride_layer + kv * dst_stride_kv + dst_slot[:, None] * dst_stride_slot
        tl.store(dst + col[None, :], tl.load(src + col[None, :], mask=mask), mask=mask)


@functools.cache
def _kernel():
    # Not specialized on the pull's length: each divisibility of it would be a compile of its own.
    return triton.jit(_copy_slots_kernel, do_not_specialize=["num_tokens"])


def _rows_contiguous(cache: torch.Tensor) -> bool:
    """A slot's heads x head_dim elements lie next to each other (a head slice of a whole cache)."""
    return cache.stride(4) == 1 and cache.stride(3) == cache.shape[4]


def copy_slots(
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    chunk_tokens: int,
    kernel: bool | None = None,
) -> None:
    """``dst[:, :, dst_slots] = src[:, :, src_slots]`` for caches ``[layers, 2, slots, heads,
    head_dim]`` (views of the same shape but for their slots), ``*_slots`` long tensors on their
    device. ``kernel``: the Triton copy (True), torch's per layer in chunks of ``chunk_tokens``
    tokens (False), or the first where it can run (None)."""
    _check_shapes(dst, src)
    usable = triton is not None and _rows_contiguous(src) and _rows_contiguous(dst)
    if kernel is None:
        kernel = usable and dst.is_cuda
    if kernel and not usable:
        raise ValueError("the Triton slot copy needs Triton and caches whose slot rows are contiguous")
    if not len(dst_slots):
        return
    if not kernel:
        for layer in range(dst.shape[0]):
            for start in range(0, len(dst_slots), chunk_tokens):
                chunk = slice(start, start + chunk_tokens)
                dst[layer].index_copy_(1, dst_slots[chunk], src[layer].index_select(1, src_slots[chunk]))
        return
    row = dst.shape[3] * dst.shape[4]
    row_pad = triton.next_power_of_2(row)
    tokens = max(1, _PROGRAM_ELEMENTS // row_pad)
    grid = (triton.cdiv(len(dst_slots), tokens), dst.shape[0] * 2)
    _kernel()[grid](
        src,
        dst,
        src_slots,
        dst_slots,
        len(dst_slots),
        *src.stride()[:3],
        *dst.stride()[:3],
        ROW=row,
        ROW_PAD=row_pad,
        TOKENS=tokens,
        num_warps=4,
    )


def copy_slot_runs(dst: torch.Tensor, dst_slots: list[int], src: torch.Tensor, src_slots: list[int]) -> None:
    """``dst[:, :, dst_slots] = src[:, :, src_slots]`` for caches as in ``copy_slots``, a run of
    slots consecutive on both sides at a time. Pulling 128-4096 tokens in blocks of 16 (float32,
    8 layers x 8 heads x 128, ``bench_kv_ipc.py --device cpu``) it moved 6-11 GB/s on 1-2 threads,
    1.8-2.5x torch's gather-scatter; with no two slots consecutive, 0.8x the gather-scatter."""
    _check_shapes(dst, src)
    if not dst_slots:
        return
    to, fro = np.asarray(dst_slots), np.asarray(src_slots)
    starts = np.flatnonzero((np.diff(to) != 1) | (np.diff(fro) != 1)) + 1
    for start, end in zip([0, *starts.tolist()], [*starts.tolist(), len(to)]):
        d, s = int(to[start]), int(fro[start])
        dst[:, :, d : d + end - start].copy_(src[:, :, s : s + end - start])


def _check_shapes(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape[:2] != src.shape[:2] or dst.shape[3:] != src.shape[3:]:
        raise ValueError(f"caches of shapes {tuple(src.shape)} and {tuple(dst.shape)} do not match")
