"""Paged attention decode on CUDA in Triton: one query token per sequence over its cached context,
K/V read in place from their cache slots through the block tables.

The compiled kernel (``attention.paged_decode``) needs a decode plan built on the host for each
batch; this one reads each sequence's position on the device and walks its context there, so one
launch serves any batch of the same size and can be captured in a CUDA graph: no host syncs, no
data-dependent Python, no allocation but the output.

Triton is optional: the module imports without it (``triton_available``), and the kernel is
compiled on first use, so ``TRITON_INTERPRET`` set any time before then is honoured (the tests
run the kernel on CPU in Triton's interpreter).
"""

import functools

import torch

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


def triton_available() -> bool:
    """Whether Triton imported, so ``paged_decode_triton`` can run."""
    return triton is not None


def supports_head_dim(dim: int) -> bool:
    """The kernel's head size is a ``tl.arange`` length: a power of two."""
    return dim > 0 and not dim & (dim - 1)


if triton is not None:

    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
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
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        DIM: tl.constexpr,
        TILE: tl.constexpr,
    ):
        """One program per (sequence, KV head): all query heads of the KV head's group at once, so
        each K/V row is read once for the group."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        member = tl.arange(0, GROUP_PAD)
        head_ok = member < GROUP  # the group padded to a power of two for tl.arange
        heads = kv_head * GROUP + member
        dims = tl.arange(0, DIM)

        # Scores in base 2 (exp2 is the hardware's): fold log2(e) into the scale once.
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
            mask=head_ok[:, None],
            other=0.0,
        ).to(tl.float32) * (scale * 1.4426950408889634)

        position = tl.load(positions_ptr + seq).to(tl.int64)
        oldest = tl.maximum(tl.load(oldest_ptr + seq).to(tl.int64), 0)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running maximum score
        total = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)  # running weighted sum of values

        # The bounds come from the device, so the launch is the same whatever the batch's contexts.
        # Start at the tile holding ``oldest``: a sliding window skips the tiles before it.
        for start in range(oldest // TILE * TILE, position + 1, TILE):
            tok = start + tl.arange(0, TILE)
            visible = (tok >= oldest) & (tok <= position)
            # Gathered per token: blocks of any size, smaller or larger than the tile, and the
            # table is never read past the sequence's position (its padding may be anything).
            block = tl.load(tables_ptr + seq * stride_tb + (tok // BLOCK_SIZE) * stride_tw, mask=visible, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
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
            # Broadcast products, not tl.dot: its 16-row minimum does not fit a group of 1 to 8
            # heads, and a decode is bound by reading K/V, not by arithmetic.
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, TILE]
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A tile with no visible token leaves m at -inf; subtracting 0 then keeps exp2 at 0
            # instead of NaN (-inf - -inf).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            weights = tl.exp2(scores - m_safe[:, None])
            rescale = tl.exp2(m - m_safe)  # 0 on the first tile, where m is -inf
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
            m = m_new

        # No visible token at all (oldest > position, e.g. a padding row): zeros rather than NaN.
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )


@functools.cache
def _kernel():
    # Jitted on first use rather than at import: triton.jit reads TRITON_INTERPRET when it runs.
    return triton.jit(_paged_decode_kernel)


def _launch_shape(group_pad: int, dim: int) -> tuple[int, int]:
    """The tile (tokens per iteration) and the warps per program."""
    tile = max(_MIN_TILE, min(_MAX_TILE, _TILE_ELEMENTS // dim))
    warps = min(_MAX_WARPS, max(1, group_pad * tile * dim // _ELEMENTS_PER_WARP))
    return tile, warps


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    oldest: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q ``[batch, heads, dim]`` over each sequence's context from ``oldest`` to ``positions``
    ``[batch]`` (inclusive), K/V ``[slots, kv_heads, dim]`` read in place through ``block_tables``
    ``[batch, width]``. Query head ``h`` reads KV head ``h // (heads // kv_heads)``. Returns
    ``[batch, heads, dim]`` in q's dtype."""
    if triton is None:
        raise RuntimeError("paged_decode_triton needs Triton, which is not installed")
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if not supports_head_dim(dim):
        raise ValueError(f"the Triton decode kernel needs a power-of-two head_dim, not {dim}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group evenly over {kv_heads} KV heads")
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    tile, warps = _launch_shape(group_pad, dim)
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    _kernel()[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        positions,
        oldest,
        scale,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        DIM=dim,
        TILE=tile,
        num_warps=warps,
    )
    return out
