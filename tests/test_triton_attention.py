"""The Triton paged decode kernel against plain attention over each sequence's K/V gathered out of
its blocks: batches of one and more, grouped query heads, block sizes below, above and not a power
of two, contexts from one token to several tiles, sliding windows, float32 and bfloat16, and int8
and fp8 caches against the same attention over their dequantized K/V.

Without a GPU the kernel runs in Triton's interpreter (fp8 included); without Triton the module is
skipped."""

import os
import sys

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    # Triton reads this when it jits a function, its own standard library (tl.sum, tl.max) included
    # as triton.language is imported. Not on a GPU: there the kernel runs for real, and the other
    # tests' compiled kernels with it.
    if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "triton was imported (by torch.compile in an earlier test module) before TRITON_INTERPRET=1 "
            "could be set: run this module in a process of its own",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from distserve.core.kv_cache_dtype import slot_width  # noqa: E402
from distserve.model_executor.attention import NO_WINDOW, resolve_attention_backend  # noqa: E402
from distserve.model_executor.kv_quant import dequantize_kv, quantize_kv  # noqa: E402
from distserve.model_executor.triton_attention import (  # noqa: E402
    default_partition,
    paged_decode_triton,
    split_shape,
    supports_cache_dtype,
    triton_available,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EIGHT_BIT = [
    "int8",
    pytest.param(
        "fp8",
        marks=pytest.mark.skipif(
            not supports_cache_dtype("fp8", torch.device(DEVICE)), reason="Triton's fp8 needs compute capability 8.9"
        ),
    ),
]


@pytest.fixture(autouse=True)
def _interpreter_scalars(monkeypatch):
    """Triton 3.6's interpreter makes a Python int of a scalar (the context loop's bounds) with
    int() of a one-element array, which NumPy 2.4 refuses (triton-lang/triton#9171): read it with
    .item() instead, as the upstream fix does. Harmless where the interpreter has the fix."""
    if not INTERPRET:
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


def _reference(q, k_cache, v_cache, tables, positions, oldest, block_size, scale):
    """Per sequence: its visible tokens' slots from its block table, softmax(q k * scale) v in float64."""
    q, k_cache, v_cache = (t.cpu().double() for t in (q, k_cache, v_cache))
    tables = tables.cpu()
    batch, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for i in range(batch):
        tok = torch.arange(max(int(oldest[i]), 0), int(positions[i]) + 1)
        slots = tables[i, tok // block_size].long() * block_size + tok % block_size
        k = k_cache[slots].repeat_interleave(group, dim=1)  # [ctx, heads, dim]
        v = v_cache[slots].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[i] * scale, k), dim=-1)
        out[i] = torch.einsum("ht,thd->hd", weights, v)
    return out


def _case(
    lengths,
    heads,
    kv_heads,
    block_size,
    dim=16,
    window=None,
    dtype=torch.float32,
    table_dtype=torch.int32,
    cache_dtype="auto",
):
    """Random K/V in a cache whose blocks are handed out shuffled; tables padded with a random block."""
    gen = torch.Generator().manual_seed(len(lengths) * 1000 + heads * 10 + kv_heads + block_size)
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq) + 1  # at least one padding entry for every sequence
    tables = torch.empty(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(order[:n])
        tables[i, n:] = torch.randint(num_blocks, (width - n,), generator=gen)
        order = order[n:]
    slots = num_blocks * block_size
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    if cache_dtype != "auto":
        k_cache, v_cache = _quantized_cache(k_cache, v_cache, cache_dtype, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    positions = torch.tensor(lengths) - 1
    oldest = positions - (NO_WINDOW if window is None else window - 1)
    args = (q, k_cache, v_cache, tables.to(table_dtype), positions, oldest)
    return tuple(t.to(DEVICE) for t in args)


def _quantized_cache(k, v, cache_dtype, gen):
    """K/V rows given magnitudes from 1/8 to 8 (each row's scale matters), quantized into layer 1 of
    a ``[layers, 2, slots, kv_heads, dim + 4]`` cache as the engine holds it: K and V are views."""
    slots, kv_heads, dim = k.shape
    cache = torch.zeros(2, 2, slots, kv_heads, slot_width(dim, cache_dtype), dtype=torch.int8)
    for i, rows in enumerate((k, v)):
        magnitude = 2.0 ** (6 * torch.rand(slots, kv_heads, 1, generator=gen) - 3)
        cache[1, i] = quantize_kv(rows.float() * magnitude, cache_dtype)
    cache = cache.to(DEVICE)
    return cache[1, 0], cache[1, 1]


def _check(args, block_size, atol, rtol=0.0, partition=None, cache_dtype="auto"):
    scale = args[0].shape[-1] ** -0.5
    out = paged_decode_triton(*args, block_size, scale, partition=partition, cache_dtype=cache_dtype)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    if cache_dtype != "auto":  # the reference attends over the K/V the codes and scales stand for
        q, k_cache, v_cache, *rest = args
        args = (q, *(dequantize_kv(c, cache_dtype, torch.float32) for c in (k_cache, v_cache)), *rest)
    expected = _reference(*args, block_size, scale)
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


def test_available():
    assert triton_available()


@pytest.mark.parametrize("block_size", [16, 8, 5, 80])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (8, 2)])
def test_decode_matches_reference(block_size, heads, kv_heads):
    lengths = [1, 17, 300, block_size, block_size + 1, 64, 65]
    _check(_case(lengths, heads, kv_heads, block_size), block_size, atol=1e-4)


@pytest.mark.parametrize("lengths", [[1], [300], [2, 129]])
def test_batch_sizes(lengths):
    _check(_case(lengths, 4, 1, 16, dim=32, table_dtype=torch.int64), 16, atol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 37, 100])
def test_sliding_window(window):
    # Windows shorter than some contexts and longer than others; 37 and 100 leave whole tiles and
    # blocks out of the longest.
    lengths = [1, 5, 40, 150, 300]
    _check(_case(lengths, 8, 2, 5, window=window), 5, atol=1e-4)


@pytest.mark.parametrize("partition", [0, 64, 128])
@pytest.mark.parametrize("window", [None, 37, 100])
def test_partitions(partition, window):
    # Unsplit, and split in partitions of one tile and of two (dim 16: 64-token tiles), each
    # combined: contexts inside one partition, across several, ending on a partition's edge, and
    # windows that leave whole partitions out; a padding row with no visible token gives zeros.
    lengths = [1, 64, 65, 128, 129, 300]
    args = _case(lengths, 8, 2, 16, window=window)
    _check(args, 16, atol=1e-4, partition=partition)
    q, k_cache, v_cache, tables, positions, oldest = args
    empty = paged_decode_triton(q, k_cache, v_cache, tables, positions, positions + 1, 16, 1.0, partition=partition)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_split_shape():
    assert split_shape(4096, 16, 256) == (256, 16)
    assert split_shape(100, 16, 256) == (256, 1)
    assert split_shape(4096, 16, 0) == (4096, 1)
    assert split_shape(4096, 64, 100) == (128, 32)  # whole tiles
    assert split_shape(1 << 20, 16, 256) == (16384, 64)  # at most 64 partitions


def test_default_partition_splits_only_a_grid_short_of_programs():
    # 132 multiprocessors, 8 KV heads: 16 sequences (128 programs), 64 (512), 128 (1024)
    assert default_partition(16 * 8, 132) == 128
    assert default_partition(64 * 8, 132) == 256
    assert default_partition(128 * 8, 132) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    # Inputs rounded alike for both; what remains is the output's rounding to 8 (or 11) bits.
    _check(_case([1, 33, 250], 8, 2, 16, dim=32, dtype=dtype), 16, atol=2e-2, rtol=2e-2)


def test_strided_query():
    # Queries as attention.py holds them, [heads, batch, dim] seen transposed: read in place.
    q, *rest = _case([3, 70, 140], 8, 4, 8)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_t.is_contiguous()
    _check((q_t, *rest), 8, atol=1e-4)


def test_head_dim_must_be_a_power_of_two():
    args = _case([4], 2, 1, 16, dim=24)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_decode_triton(*args, 16, 1.0)


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize("partition", [0, 64])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (8, 2, 37)])
def test_8bit_cache_equals_attention_over_its_dequantized_kv(cache_dtype, partition, heads, kv_heads, window):
    # Codes and scales read in place: unsplit and split, a query head per KV head and groups of 4,
    # a window that leaves whole tiles out. The bound is float32's: a scale ignored, taken from
    # another row or misplaced by a row stride of head_dim (not head_dim + 4) is far outside it.
    lengths = [1, 17, 64, 65, 129, 300]
    args = _case(lengths, heads, kv_heads, 16, window=window, cache_dtype=cache_dtype)
    _check(args, 16, atol=5e-5, rtol=1e-5, partition=partition, cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
def test_8bit_cache_under_a_bfloat16_model(cache_dtype):
    # bfloat16 queries and output over an 8-bit cache, blocks of 5 and a window: the output's
    # rounding to 8 bits is all that differs.
    args = _case([1, 33, 250], 8, 2, 5, dim=32, window=100, dtype=torch.bfloat16, cache_dtype=cache_dtype)
    _check(args, 5, atol=1e-3, rtol=8e-3, cache_dtype=cache_dtype)


def test_a_cache_of_another_dtype_is_refused():
    q, k_cache, v_cache, *rest = _case([4], 2, 1, 16, cache_dtype="int8")
    with pytest.raises(ValueError, match="'auto' KV cache of head_dim 16 has rows of 16, not 20"):
        paged_decode_triton(q, k_cache, v_cache, *rest, 16, 1.0)


def test_fp8_on_a_gpu_older_than_8_9_is_refused_by_triton_and_auto_takes_sdpa(monkeypatch):
    # Triton compiles its e4m3 conversion for compute capability 8.9 and newer only; an A100 (8.0)
    # stood in by its capability, which is all the choice reads.
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="fp8 KV cache on GPUs of compute capability 8.9 or newer, not 8.0"):
        resolve_attention_backend("triton", cuda, torch.bfloat16, 128, "fp8")
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 128, "fp8") == "sdpa"
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 128, "int8") == "triton"
    assert resolve_attention_backend("triton", cuda, torch.bfloat16, 128, "int8") == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 128, "fp8") == "triton"
