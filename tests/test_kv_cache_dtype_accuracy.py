"""An 8-bit KV cache against the unquantized cache on the same weights (float32), on two families
and both CPU attention paths that read it (the C++ kernel, and SDPA over dequantized values):

- teacher-forced: prompts run in chunks of one block with ``prompt_logprobs``, so that every row
  after the first chunk attends over K/V read back from the cache (its own chunk's included); the
  logprob of each forced token and the top token at each position, against the unquantized run;
- decoding: greedy outputs with their logprobs, compared up to where the two runs' outputs part
  (until there both decode the same context, every step reading the cache).

The bounds hold int8 to about 3x what it measures (docs/experiments/kv-cache-dtype.md) and fail
a read that drops the scale, scales by another KV head's scale, scales 1.25x, or reads the token
before its own (each measured far past them). fp8 (3 mantissa bits) is 5x less exact, so its
bounds are looser: they catch a dropped or wrong scale and codes read as int8; reading another
row is the int8 checks' to catch (the same indexing reads both).
"""

import statistics
from dataclasses import dataclass

import pytest
import torch

from distserve import LLM, SamplingParams
from distserve.model_executor.cpu_kernel import kernel_available
from distserve.model_executor.tiny_models import VOCAB_SIZE, ensure_tiny_model

BLOCK_SIZE = 16
FAMILIES = ("tiny-llama", "tiny-gpt2")  # grouped query heads and RoPE; one query head per KV head, learned positions
BACKENDS = ("cpp", "sdpa")


@dataclass
class Bounds:
    forced_max: float  # |logprob difference| of a forced token, largest
    forced_mean: float
    top_same: float  # share of positions whose top token is the unquantized run's, at least
    decode_mean: float | None = None  # |logprob difference| of an output token before outputs part, mean


# Measured (4 x 240 forced positions, 4 x 31 decoded): int8 largest 0.03-0.07, mean 0.004-0.011,
# top token 98-99%, decode mean 0.004-0.010; fp8 largest 0.12-0.43, mean 0.02-0.06, top 90-96%.
BOUNDS = {
    "int8": Bounds(forced_max=0.25, forced_mean=0.03, top_same=0.95, decode_mean=0.02),
    "fp8": Bounds(forced_max=1.0, forced_mean=0.12, top_same=0.85),
}


def _sequences() -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    forced = [torch.randint(3, VOCAB_SIZE, (256,), generator=gen).tolist() for _ in range(4)]
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (40, 100, 170, 300)]
    return forced, prompts


def _run(family: str, backend: str, cache_dtype: str) -> tuple[list, list]:
    """(forced: per sequence (logprobs, top tokens) of the rows past the first chunk; decoded: per
    prompt (output tokens, their logprobs))."""
    forced, prompts = _sequences()
    model = str(ensure_tiny_model(family))
    common = {"dtype": "float32", "attention_backend": backend, "kv_cache_dtype": cache_dtype, "block_size": BLOCK_SIZE}
    llm = LLM(model, enable_chunked_prefill=True, max_num_batched_tokens=BLOCK_SIZE, **common)
    storage = llm.engine.executor.worker.kv_cache.tensor.dtype
    assert storage == (torch.float32 if cache_dtype == "auto" else torch.int8)
    outs = llm.generate(forced, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    llm.shutdown()
    # prompt_logprobs[i] is token i's, predicted by row i - 1: rows from BLOCK_SIZE on read the cache
    rows = [o.prompt_logprobs[BLOCK_SIZE + 1 :] for o in outs]
    forced_out = [([p.logprob for p in r], [p.top_token_ids[0] for p in r]) for r in rows]
    llm = LLM(model, **common)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0))
    llm.shutdown()
    return forced_out, [(list(o.output_token_ids), [p.logprob for p in o.logprobs]) for o in outs]


@pytest.fixture(scope="module")
def runs():
    found: dict[tuple[str, str, str], tuple[list, list]] = {}

    def get(family: str, backend: str, cache_dtype: str) -> tuple[list, list]:
        if backend == "cpp" and not kernel_available():
            pytest.skip("no C++ compiler for the kernel")
        key = (family, backend, cache_dtype)
        if key not in found:
            found[key] = _run(*key)
        return found[key]

    return get


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_logprobs_close_to_unquantized(runs, family, backend, cache_dtype):
    (ref, _), (got, _) = runs(family, backend, "auto"), runs(family, backend, cache_dtype)
    diffs = [abs(a - b) for (ref_lp, _), (lp, _) in zip(ref, got) for a, b in zip(ref_lp, lp, strict=True)]
    same = [a == b for (_, ref_top), (_, top) in zip(ref, got) for a, b in zip(ref_top, top, strict=True)]
    bounds = BOUNDS[cache_dtype]
    assert len(diffs) == 4 * (255 - BLOCK_SIZE)
    # The quantized cache was read: float32 rounding alone moves logprobs by about 1e-6.
    assert statistics.fmean(diffs) > 1e-4
    assert max(diffs) < bounds.forced_max
    assert statistics.fmean(diffs) < bounds.forced_mean
    assert statistics.fmean(same) >= bounds.top_same


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_logprobs_close_to_unquantized(runs, family, backend):
    (_, ref), (_, got) = runs(family, backend, "auto"), runs(family, backend, "int8")
    diffs = []
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, got):
        part = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), len(ids))
        diffs += [abs(a - b) for a, b in zip(ref_lp[1:part], lp[1:part])]  # the first token is the prompt's
    # Most steps decode the same context in both runs (measured: 103-124 of 124): enough to compare.
    assert len(diffs) >= 60
    assert 1e-4 < statistics.fmean(diffs) < BOUNDS["int8"].decode_mean
