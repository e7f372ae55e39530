"""The in-place paged attention kernels (C++ and compiled) against SDPA over each sequence's K/V
copied out of its blocks: decode, and (C++) prompt chunks after a cached prefix; grouped query
heads, sliding windows (leaving whole blocks out), contexts from one token to many blocks, blocks
anywhere; the C++ kernel in float32 and in bfloat16 (float32 SDPA over the same bfloat16 values is
the reference: the kernel computes in float32, so only the output's rounding to bfloat16 may
differ); how ``auto`` chooses, and what happens without a compiler; and the one compiled kernel an
engine builds at start-up."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from distserve import LLM, SamplingParams
from distserve.model_executor import cpu_kernel
from distserve.model_executor.attention import (
    NO_WINDOW,
    DecodePlan,
    _compiled_paged_decode,
    padded_block_tables,
    resolve_attention_backend,
)
from distserve.model_executor.cpu_kernel import KernelUnavailable, paged_attention_cpu
from distserve.model_executor.kv_quant import dequantize_kv, quantize_kv
from distserve.model_executor.triton_attention import triton_available

BLOCK_SIZE, NUM_BLOCKS, DIM = 16, 64, 32
LENGTHS = [1, 16, 17, 100, 250]


def _compiled(q, k_cache, v_cache, tables, positions, window, scale):
    plan = DecodePlan.build(tables, positions.tolist(), BLOCK_SIZE, "cpu")
    oldest = positions - (NO_WINDOW if window is None else window - 1)
    return _compiled_paged_decode(q, k_cache, v_cache, plan, positions, oldest, BLOCK_SIZE, scale)


def _padded(tables: list[list[int]]) -> torch.Tensor:
    return torch.tensor(padded_block_tables(tables))


def _cpp(q, k_cache, v_cache, tables, positions, window, scale):
    batch = len(tables)
    starts, lens = torch.arange(batch), torch.ones(batch, dtype=torch.long)
    window = NO_WINDOW if window is None else window
    return paged_attention_cpu(q, k_cache, v_cache, _padded(tables), starts, lens, positions + 1, BLOCK_SIZE, scale,
                               window)  # fmt: skip


def _cache(
    kv_heads: int, dim: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A random K and V cache, and its blocks in random order."""
    k_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    return k_cache, v_cache, torch.randperm(NUM_BLOCKS, generator=gen).tolist()


def _assert_close_to_float32(out: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    """``out`` equal to float32 ``expected`` up to float32 summation order, and, in bfloat16, up to
    rounding to the nearest bfloat16 (half a unit in the last place: 2^-8 of the value at most)."""
    rtol = 2**-8 if out.dtype == torch.bfloat16 else atol
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def _queries(tokens: int, heads: int, dim: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, heads, dim]`` as the model hands them over: a transposed view of ``[heads, tokens,
    dim]``, read by the kernel through its strides."""
    return torch.randn(heads, tokens, dim, generator=gen).to(dtype).transpose(0, 1)


def _gathered(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """A sequence's first ``length`` positions of ``cache``, as ``[kv_heads, length, dim]``."""
    return cache.view(-1, BLOCK_SIZE, *cache.shape[1:])[table].flatten(0, 1)[:length].transpose(0, 1)


@pytest.mark.parametrize(
    "kernel,dtype",
    [(_cpp, torch.float32), (_cpp, torch.bfloat16), (_compiled, torch.float32)],
    ids=["cpp", "cpp-bfloat16", "compiled"],
)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, DIM), (8, 2, DIM), (4, 2, 64), (2, 1, 128)])
@pytest.mark.parametrize("window", [None, 40])
def test_paged_decode_equals_sdpa_over_gathered_blocks(kernel, dtype, heads, kv_heads, dim, window):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, free = _cache(kv_heads, dim, gen, dtype)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in LENGTHS]
    positions = torch.tensor(LENGTHS) - 1
    q = _queries(len(LENGTHS), heads, dim, gen, dtype)
    if kernel is _compiled:
        q = q.contiguous()
    scale = dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, positions, window, scale)
    assert out.dtype == dtype
    for i, (n, table) in enumerate(zip(LENGTHS, tables)):
        first = 0 if window is None else max(0, n - window)
        k, v = (_gathered(cache, table, n)[:, first:].float() for cache in (k_cache, v_cache))
        expected = F.scaled_dot_product_attention(q[i][:, None].float(), k, v, scale=scale, enable_gqa=True)
        _assert_close_to_float32(out[i], expected[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, DIM), (8, 2, 64)])
@pytest.mark.parametrize("window", [None, 24])
def test_cpp_prompt_chunks_after_a_cached_prefix_equal_causal_sdpa(dtype, heads, kv_heads, dim, window):
    _check_prompt_chunks(dtype, heads, kv_heads, dim, window, "auto")


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, DIM), (8, 2, 64), (2, 1, 128), (4, 2, 20)])
def test_cpp_over_an_8_bit_cache_equals_sdpa_over_its_dequantized_values(cache_dtype, dtype, heads, kv_heads, dim):
    """Decode tokens and prompt chunks over a cache of codes and per-row scales: as SDPA over the
    values those codes and scales stand for (a kernel that left a scale out, or read a row at the
    wrong stride, would be off by the scale's size), in float32 and bfloat16, at head sizes the
    kernel vectorises (64, 128), does not (32), and not a multiple of 16 (20)."""
    _check_prompt_chunks(dtype, heads, kv_heads, dim, 24, cache_dtype)
    _check_prompt_chunks(dtype, heads, kv_heads, dim, None, cache_dtype)


def _check_prompt_chunks(dtype, heads, kv_heads, dim, window, cache_dtype):
    """Sequences of several query tokens (more than a tile of 16, fewer, one; a whole prompt, and
    chunks after cached ones), each the last of its context, packed with a decode token."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, free = _cache(kv_heads, dim, gen, dtype)
    values = k_cache, v_cache
    if cache_dtype != "auto":  # rows of a spread of sizes, so that scales differ from row to row
        sizes = torch.rand(k_cache.shape[:2], generator=gen)[..., None] * 4
        k_cache, v_cache = (quantize_kv(cache.float() * sizes, cache_dtype) for cache in (k_cache, v_cache))
        values = tuple(dequantize_kv(cache, cache_dtype, torch.float32) for cache in (k_cache, v_cache))
    chunks = [(1, 1), (1, 70), (5, 100), (16, 16), (40, 250), (17, 33)]  # (query tokens, context length)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for _, n in chunks]
    starts = [sum(c for c, _ in chunks[:i]) for i in range(len(chunks))]
    q = _queries(sum(c for c, _ in chunks), heads, dim, gen, dtype)
    scale = dim**-0.5
    lens, contexts = (torch.tensor(column) for column in zip(*chunks))
    out = paged_attention_cpu(q, k_cache, v_cache, _padded(tables), torch.tensor(starts), lens, contexts, BLOCK_SIZE,
                              scale, NO_WINDOW if window is None else window, cache_dtype)  # fmt: skip
    for (count, n), table, start in zip(chunks, tables, starts):
        query = torch.arange(n - count, n)[:, None]
        key = torch.arange(n)[None, :]
        mask = (key <= query) & (key > query - (window or NO_WINDOW))
        k, v = (_gathered(cache, table, n).float() for cache in values)
        qs = q[start : start + count].transpose(0, 1).float()
        expected = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        # An 8-bit cache's values run to 4x the others' (and its products are grouped differently):
        # float32 summation differs by a few units more; a scale left out is off by 30x or more.
        atol = 1e-5 if cache_dtype == "auto" else 1e-4
        _assert_close_to_float32(out[start : start + count], expected.transpose(0, 1), atol)


def test_auto_backend_is_cpp_for_float32_and_bfloat16_on_cpu_compiled_for_float16_and_triton_on_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention_backend("auto", cpu, torch.float32) == "cpp"
    assert resolve_attention_backend("auto", cpu, torch.bfloat16) == "cpp"
    assert resolve_attention_backend("auto", cpu, torch.float16) == "compiled"
    assert resolve_attention_backend("auto", cuda, torch.float32) == ("triton" if triton_available() else "sdpa")
    assert resolve_attention_backend("sdpa", cpu, torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="'cpp' runs on CPU in float32 or bfloat16"):
        resolve_attention_backend("cpp", cpu, torch.float16)
    with pytest.raises(ValueError, match="'triton' runs on CUDA"):
        resolve_attention_backend("triton", cpu, torch.float32)


@pytest.fixture
def fresh_kernel_build(tmp_path, monkeypatch):
    """The kernel built anew, into an empty cache, by whatever compiler the test leaves."""
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    cpu_kernel.load_kernel.cache_clear()
    cpu_kernel._warn_once.cache_clear()
    yield tmp_path
    cpu_kernel.load_kernel.cache_clear()


@pytest.mark.parametrize(
    "target",
    [("-mno-avx512bf16",), ("-mno-avx512f",)],
    ids=["avx512-without-bf16", "without-avx512"],
)
def test_the_kernel_built_for_cpus_without_avx512_bf16_attends_alike(fresh_kernel_build, monkeypatch, target):
    """The kernel as a CPU without AVX-512 BF16 (bfloat16 widened to float32, then multiplied) or
    without AVX-512 at all (the loops the compiler vectorises) builds it: equal to SDPA as above."""
    monkeypatch.setattr(cpu_kernel, "COMPILE_FLAGS", (*cpu_kernel.COMPILE_FLAGS, *target))
    for dtype in (torch.float32, torch.bfloat16):
        test_paged_decode_equals_sdpa_over_gathered_blocks(_cpp, dtype, 8, 2, 64, None)
        test_cpp_prompt_chunks_after_a_cached_prefix_equal_causal_sdpa(dtype, 8, 2, 64, 24)
        for cache_dtype in ("int8", "fp8"):
            _check_prompt_chunks(dtype, 8, 2, 64, 24, cache_dtype)


def test_the_kernel_is_built_once_into_the_cache(fresh_kernel_build):
    cpu_kernel.load_kernel()
    built = list((fresh_kernel_build / "kernels").glob("paged_attention-*.so"))
    assert len(built) == 1
    cpu_kernel.load_kernel.cache_clear()
    cpu_kernel.load_kernel()  # a second process finds it: nothing built
    assert list((fresh_kernel_build / "kernels").iterdir()) == built


def test_loading_the_kernel_leaves_the_process_floats_and_openmp_runtime_alone(fresh_kernel_build):
    """Built with -ffast-math but not linked with it: subnormal floats still exist afterwards, and
    the kernel runs on torch's OpenMP runtime, not a second one."""
    cpu_kernel.load_kernel()
    assert (torch.tensor([1e-38]) / 1000).item() > 0
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1


def test_without_a_compiler_auto_falls_back_to_sdpa_and_cpp_says_why(fresh_kernel_build, tmp_path, monkeypatch, caplog):
    from torch._inductor import cpp_builder

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
    cpp_builder.cpp_compiler_search.cache_clear()  # inductor remembers the compiler it found
    try:
        assert resolve_attention_backend("auto", torch.device("cpu"), torch.float32) == "sdpa"
        assert "C++ paged attention kernel is not available" in caplog.text and "no C++ compiler" in caplog.text
        with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler found"):
            resolve_attention_backend("cpp", torch.device("cpu"), torch.float32)
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()


def test_a_failed_build_says_why(fresh_kernel_build, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(KernelUnavailable, match="building paged_attention.cpp failed"):
        cpu_kernel.load_kernel()
    assert not list((fresh_kernel_build / "kernels").glob("*.so"))  # no half-built library left


def test_one_kernel_built_at_start_up_serves_every_batch_shape():
    """Built by the engine's warm-up step; one sequence or many, one block or many, no rebuild."""
    llm = LLM("tiny-llama", dtype="float32", attention_backend="compiled", enable_prefix_caching=False)
    graphs = counters["stats"]["unique_graphs"]
    for batch, prompt_len in [(1, 3), (1, 40), (5, 20), (2, 70), (1, 1)]:
        prompts = [[5 + i] * (prompt_len + i) for i in range(batch)]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
        assert all(len(out.output_token_ids) == 20 for out in outputs)
    assert counters["stats"]["unique_graphs"] == graphs
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
