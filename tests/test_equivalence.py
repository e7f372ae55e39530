"""Greedy output token-for-token equal to transformers' generate() on the same weights."""

import pytest
from conftest import FAMILIES, assert_engine_idle, random_prompts, reference_greedy

from distserve import LLM, SamplingParams

# Mixed lengths from 1 to 200 tokens, each with its own output length.
LENGTHS = [1, 7, 16, 33, 64, 101, 150, 200]
MAX_TOKENS = [12, 30, 5, 40, 17, 25, 9, 33]


def _check(llm, model, prompts, max_tokens):
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    for prompt, n, out in zip(prompts, max_tokens, outputs):
        assert out.output_token_ids == reference_greedy(model, prompt, n), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason in ("length", "stop")
    assert_engine_idle(llm.engine)
    return outputs


@pytest.mark.parametrize("attention_backend", ["cpp", "compiled", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_plain_batch(family, attention_backend, reference_model):
    model = reference_model(family)
    llm = LLM(family, enable_prefix_caching=False, attention_backend=attention_backend, dtype="float32")
    _check(llm, model, random_prompts(LENGTHS, model.config.vocab_size), MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefixes_hit_the_prefix_cache(family, reference_model):
    model = reference_model(family)
    vocab = model.config.vocab_size
    prefix = random_prompts([48], vocab, seed=1)[0]
    suffixes = random_prompts([1, 5, 16, 20, 31, 40, 70, 100], vocab, seed=2)
    prompts = [prefix + s for s in suffixes]
    llm = LLM(family, block_size=16, dtype="float32")
    _check(llm, model, prompts, MAX_TOKENS)
    bm = llm.engine.block_manager
    # All eight prompts share 3 full prefix blocks; the first computes them, the other seven hit.
    assert bm.prefix_cache_hit_tokens >= 7 * 48
    hits_before = bm.prefix_cache_hit_tokens
    # The same prompts again find even their own full blocks cached after being freed.
    _check(llm, model, prompts, MAX_TOKENS)
    assert bm.prefix_cache_hit_tokens - hits_before > 8 * 48


@pytest.mark.parametrize("family", FAMILIES)
def test_small_kv_pool_preempts_and_recomputes(family, reference_model):
    model = reference_model(family)
    llm = LLM(family, block_size=8, num_kv_blocks=30, dtype="float32")  # the longest request needs 30
    _check(llm, model, random_prompts(LENGTHS, model.config.vocab_size, seed=3), MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("policy", ["sjf", "priority"])
def test_policies_keep_outputs(policy, reference_model):
    model = reference_model("tiny-llama")
    llm = LLM("tiny-llama", policy=policy, max_num_batched_tokens=128, num_kv_blocks=48, block_size=8, dtype="float32")
    _check(llm, model, random_prompts(LENGTHS, model.config.vocab_size, seed=4), MAX_TOKENS)


def test_text_prompts_and_detokenized_text(reference_model):
    model = reference_model("tiny-qwen2")
    llm = LLM("tiny-qwen2", dtype="float32")
    prompts = ["The cache block", "Hello world, the server is fast.", "a"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, out in zip(prompts, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.output_token_ids == reference_greedy(model, ids, 24)
        assert out.text == llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    assert_engine_idle(llm.engine)
