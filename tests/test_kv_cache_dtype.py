"""An 8-bit KV cache (``cache.kv_cache_dtype``) wherever its blocks go: swapped out and back, through
a copy-on-write fork, handed over from a prefill to a decode instance, saved to the prefix tier and
read from it. Each sequence's rows are computed alike whatever the batch, and the codes and scales
travel as bytes, so the same requests give the same tokens and bit-equal logprobs however their KV
moved; only the quantization itself (measured in docs/experiments/kv-cache-dtype.md) separates them
from an unquantized cache. The model runs in bfloat16 here, where a row's result does not depend on
its batch (in float32 it did, in the last bits of a logprob, between a swapping and a roomy pool)."""

import asyncio
from dataclasses import replace

import pytest
import torch
from conftest import random_prompts, wait_nothing_in_use_async

from distserve import LLM, AsyncCluster, SamplingParams
from distserve.core.kv_cache_dtype import check_kv_cache_dtype, kv_value_bytes, slot_width
from distserve.kv_transfer.plan import KVCacheShape

# tiny-llama: 2 layers, 2 KV heads of 16 dims; an 8-bit cache stores 16 codes and a 4-byte scale a row
INT8_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * (16 + 4)


def _params(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)


def _assert_same(outputs, expected) -> None:
    for out, want in zip(outputs, expected, strict=True):
        assert out.output_token_ids == want.output_token_ids
        assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in want.logprobs]


def test_an_8_bit_cache_holds_about_twice_a_bfloat16_cache_s_tokens_in_the_same_bytes():
    bf16 = KVCacheShape(32, 8, 128, 16, torch.bfloat16)
    int8 = KVCacheShape(32, 8, 128, 16, torch.bfloat16, "int8")
    assert int8.dims(4) == (32, 2, 64, 8, 132) and int8.storage_dtype == torch.int8
    assert bf16.bytes_per_block / int8.bytes_per_block == pytest.approx(2 * 128 / 132)
    assert kv_value_bytes(128, "fp8", 2) == 132 / 128 and kv_value_bytes(128, "auto", 2) == 2
    assert slot_width(64, "auto") == 64
    with pytest.raises(ValueError, match="multiple of 4, not 18"):
        check_kv_cache_dtype("int8", 18)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_8_bit_kv_swapped_out_and_back_and_forked_is_bit_for_bit(cache_dtype):
    """A pool too small for the load swaps sequences out and back: the tokens and bit-equal
    logprobs of a pool with room for it all. Parallel samples share their prompt's blocks and fork
    the last one on write: each sample as the same request alone with its seed."""
    prompts = random_prompts([40, 90, 17, 120, 64, 8, 100, 33], 1024, seed=3)
    options = {"dtype": "bfloat16", "block_size": 8, "kv_cache_dtype": cache_dtype}
    swapping = LLM("tiny-llama", num_kv_blocks=30, swap_space=0.01, **options)
    roomy = LLM("tiny-llama", num_kv_blocks=300, **options)
    _assert_same(swapping.generate(prompts, _params()), roomy.generate(prompts, _params()))
    swap = swapping.engine.scheduler.swap
    assert swap.num_swap_outs > 0 and roomy.engine.scheduler.num_preemptions == 0
    samples = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=5)
    copied = roomy.engine.block_manager.num_copied_blocks
    forked = roomy.generate([prompts[1]], samples)  # 90 tokens: the last block is shared, then copied
    assert roomy.engine.block_manager.num_copied_blocks > copied
    alone = [roomy.generate([prompts[1]], replace(samples.sample_params(i), n=1))[0] for i in range(3)]
    assert [o.output_token_ids for o in forked] == [o.output_token_ids for o in alone]


def test_int8_kv_is_not_the_unquantized_cache_and_stays_close_to_it():
    """The quantized path really runs: teacher-forced logprobs differ from an unquantized cache's,
    by little."""
    prompt = random_prompts([200], 1024, seed=8)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logprobs = {}
    for cache_dtype in ("auto", "int8"):
        llm = LLM("tiny-llama", dtype="float32", block_size=8, num_kv_blocks=64, kv_cache_dtype=cache_dtype)
        out = llm.generate([prompt], params)[0]
        logprobs[cache_dtype] = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    difference = (logprobs["int8"] - logprobs["auto"]).abs()
    assert 0 < difference.max() < 0.3 and difference.mean() < 0.05


async def _serve(cluster, prompts, second_turns) -> list:
    """The prompts at once, then each second turn (its first turn's prompt, answer and more)."""

    async def final(prompt, params):
        async for output in cluster.generate(prompt, params):
            last = output
        return last

    first = await asyncio.gather(*(final(p, _params()) for p in prompts))
    seconds = [p + out.output_token_ids + more for p, out, more in zip(prompts, first, second_turns)]
    second = await asyncio.gather(*(final(p, _params(10)) for p in seconds[:2]))
    return [*first, *second]


def test_disaggregated_int8_kv_through_swap_and_the_tier_equals_colocated(ray_cluster):
    """1 prefill + 1 decode with int8 KV, the decode pool small enough to swap and a prefix tier,
    against a colocated cluster of the same options: equal tokens and bit-equal logprobs. Second
    turns find their history in the tier (the answer's KV, computed on the decode instance, is read
    by the prefill instance). A pull moves (16 + 4) bytes a K or V row."""
    prompts = random_prompts([60, 100, 80, 90, 70], 1024, seed=11)
    more = random_prompts([5, 9], 1024, seed=12)
    options = {"model": "tiny-llama", "dtype": "bfloat16", "block_size": 8, "kv_cache_dtype": "int8",
               "kv_tier_space": 0.01, "swap_space": 0.01}  # fmt: skip

    async def scenario():
        results = {}
        for layout in ({"prefill": {}, "decode": {"num_kv_blocks": 40}}, {"colocated": {"num_kv_blocks": 40}}):
            cluster = await AsyncCluster.start(**options, **layout)
            try:
                results[next(iter(layout))] = await _serve(cluster, prompts, more)
                infos = {info.role: info for info in await cluster.info()}
                if "decode" in infos:
                    assert infos["decode"].num_swap_outs > 0
                    assert sum(info.tier_hit_tokens for info in infos.values()) > 0
                    pulls = infos["decode"].kv_pulls_from[infos["prefill"].name]
                    pulled_tokens = sum(len(p) for p in prompts) + sum(
                        len(p) + 40 + len(m) for p, m in zip(prompts, more)
                    )
                    assert pulls.num_bytes <= INT8_KV_BYTES_PER_TOKEN * pulled_tokens
                    assert pulls.num_bytes % INT8_KV_BYTES_PER_TOKEN == 0
                await wait_nothing_in_use_async(cluster)
            finally:
                await cluster.shutdown()
        return results

    results = asyncio.run(scenario())
    _assert_same(results["prefill"], results["colocated"])
