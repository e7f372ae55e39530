"""Paged attention decode on CUDA in Triton: one query token per sequence over its cached context,
K/V read in place from their cache slots through the block tables.

The compiled kernel (``attention.paged_decode``) needs a decode plan built on the host for each
batch; this one reads each sequence's position on the device and walks its context there, so one
launch serves any batch of the same size and can be captured in a CUDA graph: no host syncs, no
data-dependent Python, no allocation but the output.

An 8-bit cache (``core/kv_cache_dtype.py``: each row's one-byte codes, then its float32 scale) is
read in place too: the codes widen to float32 (fp8 through Triton's e4m3, compiled only for GPUs
of compute capability 8.9 and newer: ``supports_cache_dtype``), and each key's scale multiplies
its scores and each value's its softmax weights, so no dequantized copy is made.

Triton is optional: the module imports without it (``triton_available``), and the kernel is
compiled on first use, so ``TRITON_INTERPRET`` set any time before then is honoured (the tests
run the kernel on CPU in Triton's interpreter).
"""

import functools

import torch

from distserve.core.kv_cache_dtype import slot_width

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

# Sizes of the [group, tile, dim] product each program holds per iteration. On an H100 (bfloat16,
# head_dim 128, 2048-token contexts) a 16-token tile was fastest for groups of 1 to 8 heads
# (64 tokens: 10-30x slower for 8, the product spilling out of registers), with one warp per
# 8192 elements of the product: 1 warp for groups up to 4, 2 for 8.
_TILE_ELEMENTS = 2048  # tile * dim, the tile kept between the bounds below
_MAX_TILE = 64
_MIN_TILE = 16
_ELEMENTS_PER_WARP = 8192
_MAX_WARPS = 4
# Splitting contexts pays while the unsplit grid (a program per sequence and KV head) leaves the
# GPU short of programs. Measured on an H100 (Llama-3-8B's 32 over 8 heads of 128, bfloat16,
# contexts of 512 and 2048): split, 16 sequences read K/V 1.3-3.4x faster and 64 sequences
# 1.1-1.6x, while 128 sequences (1024 programs, 8 per multiprocessor) read 6-25% slower than
# unsplit. Partitions of 128 tokens were 11-16% faster than 256 at 16 sequences, 3-10% slower
# at 64.
_PARTITION = 256
_SMALL_PARTITION = 128  # for grids of at most 2 programs per multiprocessor
_UNSPLIT_PROGRAMS_PER_SM = 6
_MAX_SPLITS = 64  # a wider table gets longer partitions


def triton_available() -> bool:
    """Whether Triton imported, so ``paged_decode_triton`` can run."""
    return triton is not None


def supports_head_dim(dim: int) -> bool:
    """The kernel's head size is a ``tl.arange`` length: a power of two."""
    return dim > 0 and not dim & (dim - 1)


def supports_cache_dtype(cache_dtype: str, device: torch.device) -> bool:
    """Whether the kernel reads a ``cache_dtype`` cache on ``device``: Triton compiles its fp8 e4m3
    (``tl.float8e4nv``) only for compute capability 8.9 (Ada, Hopper) and newer."""
    if cache_dtype != "fp8" or device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


if triton is not None:

    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        max_ptr,
        sum_ptr,
        tables_ptr,
        positions_ptr,
        oldest_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_ob,
        stride_oh,
        stride_od,
        stride_tb,
        stride_tw,
        num_heads,
        num_splits,
        partition,  # not a constexpr: tables of every width share one compiled kernel
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        DIM: tl.constexpr,
        TILE: tl.constexpr,
        SPLIT: tl.constexpr,
        CACHE_DTYPE: tl.constexpr,  # "auto", "int8" or "fp8": a branch compiled per cache dtype
    ):
        """One program per (sequence, KV head, partition of the context): all query heads of the KV
        head's group at once, so each K/V row is read once for the group.

        Unsplit (one partition) it writes the output. Split, it writes its partition's running
        maximum and sum (``[batch, heads, splits]``) and unnormalised values (``out_ptr``,
        ``[batch, heads, splits, dim]``, float32) for ``_combine_kernel``; a program whose partition
        holds no visible token writes nothing, and the combine reads nothing of it.

        An 8-bit cache's K/V rows are ``DIM`` codes and the row's float32 scale: the scores are the
        query times the codes, scaled per key, and the values weighted by softmax weights scaled
        per value row."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        member = tl.arange(0, GROUP_PAD)
        head_ok = member < GROUP  # the group padded to a power of two for tl.arange
        heads = kv_head * GROUP + member
        dims = tl.arange(0, DIM)

        position = tl.load(positions_ptr + seq).to(tl.int64)
        oldest = tl.maximum(tl.load(oldest_ptr + seq).to(tl.int64), 0)
        # This program's share of oldest..position: its partition's tokens.
        first = tl.maximum(oldest, split * partition)
        last = tl.minimum(position, split * partition + (partition - 1))
        if SPLIT:
            if first > last:
                return

        # Scores in base 2 (exp2 is the hardware's): fold log2(e) into the scale once.
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
            mask=head_ok[:, None],
            other=0.0,
        ).to(tl.float32) * (scale * 1.4426950408889634)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running maximum score
        total = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)  # running weighted sum of values

        # The bounds come from the device, so the launch is the same whatever the batch's contexts.
        # Start at the tile holding ``first``: a sliding window skips the tiles before it.
        for start in range(first // TILE * TILE, last + 1, TILE):
            tok = start + tl.arange(0, TILE)
            visible = (tok >= first) & (tok <= last)
            # Gathered per token: blocks of any size, smaller or larger than the tile, and the
            # table is never read past the sequence's position (its padding may be anything).
            block = tl.load(tables_ptr + seq * stride_tb + (tok // BLOCK_SIZE) * stride_tw, mask=visible, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
            if CACHE_DTYPE == "auto":
                k = tl.load(
                    k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :] * stride_kd,
                    mask=visible[:, None],
                    other=0.0,
                ).to(tl.float32)
                v = tl.load(
                    v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :] * stride_vd,
                    mask=visible[:, None],
                    other=0.0,
                ).to(tl.float32)
            else:
                # A row starts a multiple of 4 bytes in (the cache's rows are DIM + 4 wide): told
                # so, Triton loads its codes 4 at a time rather than byte by byte. Its scale's 4
                # bytes load as one float32.
                k_row = k_ptr + tl.multiple_of(slot * stride_ks + kv_head * stride_kh, 4)
                v_row = v_ptr + tl.multiple_of(slot * stride_vs + kv_head * stride_vh, 4)
                k = tl.load(k_row[:, None] + dims[None, :] * stride_kd, mask=visible[:, None], other=0)
                v = tl.load(v_row[:, None] + dims[None, :] * stride_vd, mask=visible[:, None], other=0)
                k_scale = tl.load((k_row + DIM * stride_kd).to(tl.pointer_type(tl.float32)), mask=visible, other=0.0)
                v_scale = tl.load((v_row + DIM * stride_vd).to(tl.pointer_type(tl.float32)), mask=visible, other=0.0)
                if CACHE_DTYPE == "fp8":
                    k = k.to(tl.float8e4nv, bitcast=True)
                    v = v.to(tl.float8e4nv, bitcast=True)
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            # Broadcast products, not tl.dot: its 16-row minimum does not fit a group of 1 to 8
            # heads, and a decode is bound by reading K/V, not by arithmetic.
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, TILE]
            if CACHE_DTYPE != "auto":
                scores = scores * k_scale[None, :]
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A tile with no visible token leaves m at -inf; subtracting 0 then keeps exp2 at 0
            # instead of NaN (-inf - -inf).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            weights = tl.exp2(scores - m_safe[:, None])
            rescale = tl.exp2(m - m_safe)  # 0 on the first tile, where m is -inf
            total = total * rescale + tl.sum(weights, axis=1)
            if CACHE_DTYPE != "auto":
                weights = weights * v_scale[None, :]
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
            m = m_new

        if SPLIT:
            row = (seq * num_heads + heads) * num_splits + split
            tl.store(max_ptr + row, m, mask=head_ok)
            tl.store(sum_ptr + row, total, mask=head_ok)
            tl.store(out_ptr + row[:, None] * DIM + dims[None, :], acc, mask=head_ok[:, None])
        else:
            # No visible token at all (oldest > position, e.g. a padding row): zeros, not NaN.
            out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
            tl.store(
                out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                out.to(out_ptr.dtype.element_ty),
                mask=head_ok[:, None],
            )

    def _combine_kernel(
        partial_ptr,
        max_ptr,
        sum_ptr,
        out_ptr,
        positions_ptr,
        oldest_ptr,
        stride_ob,
        stride_oh,
        stride_od,
        num_heads,
        num_splits,
        partition,
        DIM: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        """One program per (sequence, query head): the partitions' results weighted by how their
        maxima stand to the overall one, reading only the partitions that held visible tokens."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        position = tl.load(positions_ptr + seq).to(tl.int64)
        oldest = tl.maximum(tl.load(oldest_ptr + seq).to(tl.int64), 0)
        split = tl.arange(0, SPLITS_PAD)
        # The same test as the partition's program: oldest..position meets its tokens.
        written = (split < num_splits) & (split * partition <= position) & (split * partition + partition > oldest)
        # As a vector: Triton 3.9's interpreter refuses a mask that a scalar term made.
        written = written & (split * 0 + oldest <= position)
        row = (seq * num_heads + head) * num_splits + split
        m = tl.load(max_ptr + row, mask=written, other=float("-inf"))
        overall = tl.max(m, axis=0)
        overall = tl.where(overall == float("-inf"), 0.0, overall)
        weight = tl.where(written, tl.exp2(m - overall), 0.0)
        total = tl.sum(weight * tl.load(sum_ptr + row, mask=written, other=0.0), axis=0)
        dims = tl.arange(0, DIM)
        acc = tl.load(partial_ptr + row[:, None] * DIM + dims[None, :], mask=written[:, None], other=0.0)
        out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _kernels():
    # Jitted on first use rather than at import: triton.jit reads TRITON_INTERPRET when it runs.
    # Triton compiles a variant for each divisibility (by 16, equal to 1) of an integer argument;
    # the tables' width and the number of partitions change from one eager step to the next, and
    # each new variant would stall its step for a compile.
    return (
        triton.jit(_paged_decode_kernel, do_not_specialize=["stride_tb", "num_splits"]),
        triton.jit(_combine_kernel, do_not_specialize=["num_splits"]),
    )


def _launch_shape(group_pad: int, dim: int) -> tuple[int, int]:
    """The tile (tokens per iteration) and the warps per program."""
    tile = max(_MIN_TILE, min(_MAX_TILE, _TILE_ELEMENTS // dim))
    warps = min(_MAX_WARPS, max(1, group_pad * tile * dim // _ELEMENTS_PER_WARP))
    return tile, warps


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # Triton's interpreter: an H100's count, so tests split as that GPU would
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_partition(programs: int, multiprocessors: int) -> int:
    """Tokens per partition for an unsplit grid of ``programs`` (0: unsplit)."""
    if programs >= _UNSPLIT_PROGRAMS_PER_SM * multiprocessors:
        return 0
    return _SMALL_PARTITION if programs <= 2 * multiprocessors else _PARTITION


def split_shape(width_tokens: int, tile: int, partition: int) -> tuple[int, int]:
    """(tokens per partition, partitions) for block tables ``width_tokens`` wide.

    The split follows the tables' width, known on the host, never the contexts, which only the
    device knows: a captured graph serves every context its tables can hold, and a partition past
    a sequence's position costs a program that returns at once. ``partition`` 0 means unsplit."""
    if partition == 0:
        return width_tokens, 1
    size = max(partition, -(-width_tokens // _MAX_SPLITS))
    size = -(-size // tile) * tile
    return size, -(-width_tokens // size)


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    oldest: torch.Tensor,
    block_size: int,
    scale: float,
    partition: int | None = None,
    cache_dtype: str = "auto",
) -> torch.Tensor:
    """q ``[batch, heads, dim]`` over each sequence's context from ``oldest`` to ``positions``
    ``[batch]`` (inclusive), K/V ``[slots, kv_heads, dim]`` read in place through ``block_tables``
    ``[batch, width]`` (an 8-bit ``cache_dtype``: int8 ``[slots, kv_heads, dim + 4]``, codes and
    scale). Query head ``h`` reads KV head ``h // (heads // kv_heads)``. Returns
    ``[batch, heads, dim]`` in q's dtype.

    Each context is split in partitions of ``partition`` tokens (unsplit when 0; when None, as
    ``default_partition`` says for the batch and the GPU) read by programs of their own and
    combined by a second kernel, so a batch of few sequences still puts the whole GPU to reading
    K/V."""
    if triton is None:
        raise RuntimeError("paged_decode_triton needs Triton, which is not installed")
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if not supports_head_dim(dim):
        raise ValueError(f"the Triton decode kernel needs a power-of-two head_dim, not {dim}")
    width = slot_width(dim, cache_dtype)
    if k_cache.shape[2] != width:
        raise ValueError(f"a {cache_dtype!r} KV cache of head_dim {dim} has rows of {width}, not {k_cache.shape[2]}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group evenly over {kv_heads} KV heads")
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    tile, warps = _launch_shape(group_pad, dim)
    if partition is None:
        partition = default_partition(batch * kv_heads, _multiprocessors(q.device))
    size, splits = split_shape(block_tables.shape[1] * block_size, tile, partition)
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    if splits == 1:
        partial = maxima = sums = out  # not read: the kernel writes the output itself
    else:
        partial = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=q.device)
        maxima = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxima)
    decode, combine = _kernels()
    decode[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        out if splits == 1 else partial,
        maxima,
        sums,
        block_tables,
        positions,
        oldest,
        scale,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        heads,
        splits,
        size,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        DIM=dim,
        TILE=tile,
        SPLIT=splits > 1,
        CACHE_DTYPE=cache_dtype,
        num_warps=warps,
    )
    if splits > 1:
        combine[(batch, heads)](
            partial,
            maxima,
            sums,
            out,
            positions,
            oldest,
            *out.stride(),
            heads,
            splits,
            size,
            DIM=dim,
            SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=max(1, min(4, triton.next_power_of_2(splits) * dim // 1024)),
        )
    return out
