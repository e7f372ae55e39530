"""Chunked prefill on a colocated instance: prompts split over many steps beside decoding
sequences give greedy output equal to transformers' generate(), with prefix caching and
preemption, and every block freed."""

from collections import deque

import pytest
from conftest import FAMILIES, assert_engine_idle, random_prompts, reference_greedy

from distserve import LLM, SamplingParams
from distserve.core.config import EngineConfig
from distserve.core.sequence import Sequence
from distserve.engine.llm_engine import LLMEngine
from distserve.scheduling.scheduler import StepMode

LENGTHS = [1, 7, 16, 33, 64, 101, 150, 200]
MAX_TOKENS = [12, 30, 5, 40, 17, 25, 9, 33]


def _check(llm, model, prompts, max_tokens=MAX_TOKENS):
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    for prompt, n, out in zip(prompts, max_tokens, llm.generate(prompts, params)):
        assert out.output_token_ids == reference_greedy(model, prompt, n), f"prompt of {len(prompt)} tokens"
    assert_engine_idle(llm.engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [16, 61, 512])
def test_chunked_prefill_equals_transformers(family, budget, reference_model):
    model = reference_model(family)
    llm = LLM(
        family, enable_chunked_prefill=True, max_num_batched_tokens=budget, enable_prefix_caching=False, dtype="float32"
    )
    llm.engine.stats.records = deque(maxlen=10_000)  # every step, to check what they mixed
    _check(llm, model, random_prompts(LENGTHS, model.config.vocab_size))
    records = llm.engine.stats.records
    assert max(r.num_tokens for r in records) <= max(budget, len(LENGTHS))  # decode tokens run even past it
    if budget < max(LENGTHS):  # prompts longer than the budget ran over several steps, beside decodes
        assert any(r.is_prefill and r.num_tokens > 1 and r.batch_size > 1 for r in records)


def test_prompts_split_across_steps_share_cached_prefixes(reference_model):
    """A prompt whose prefix another prompt is still computing must not read those blocks early:
    blocks join the prefix cache only once their KV is in it."""
    model = reference_model("tiny-llama")
    vocab = model.config.vocab_size
    prefix = random_prompts([96], vocab, seed=1)[0]
    prompts = [prefix + suffix for suffix in random_prompts([3, 20, 41, 7, 64, 1, 30, 12], vocab, seed=2)]
    llm = LLM("tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=8, dtype="float32")
    _check(llm, model, prompts)
    hits = llm.engine.block_manager.prefix_cache_hit_tokens
    _check(llm, model, prompts)  # again: now every prompt finds its full blocks cached
    assert llm.engine.block_manager.prefix_cache_hit_tokens - hits >= 8 * 96


def test_a_preempted_half_computed_prompt_leaves_no_uncomputed_block_in_the_prefix_cache(reference_model):
    """Prompts sharing a 64-token prefix in a pool so small that prompts are preempted half-way:
    had their blocks joined the prefix cache when allocated, a later prompt would read the KV of
    blocks never computed (this pool and these prompts show it for one request)."""
    model = reference_model("tiny-llama")
    vocab = model.config.vocab_size
    prefix = random_prompts([64], vocab, seed=1)[0]
    prompts = [prefix + suffix for suffix in random_prompts([3, 20, 41, 7, 64, 1, 30, 12], vocab, seed=2)]
    llm = LLM(
        "tiny-llama",
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        block_size=8,
        num_kv_blocks=24,
        dtype="float32",
    )
    _check(llm, model, prompts, [40, 30, 35, 40, 17, 25, 30, 33])
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-opt"])
def test_small_kv_pool_preempts_chunked_prompts_and_recomputes(family, reference_model):
    model = reference_model(family)
    llm = LLM(
        family, enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=8, num_kv_blocks=30, dtype="float32"
    )
    _check(llm, model, random_prompts(LENGTHS, model.config.vocab_size, seed=3))
    assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_the_same_chunked_or_not():
    prompts = random_prompts([5, 80, 33, 140], 1000, seed=5)
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=i) for i in range(len(prompts))]
    whole = LLM("tiny-qwen2", dtype="float32").generate(prompts, params)
    chunked = LLM("tiny-qwen2", enable_chunked_prefill=True, max_num_batched_tokens=24, dtype="float32").generate(
        prompts, params
    )
    assert [o.output_token_ids for o in chunked] == [o.output_token_ids for o in whole]


def test_chunked_prefill_applies_while_an_instance_is_colocated():
    engine = LLMEngine(
        EngineConfig.from_flat(model="tiny-llama", role="prefill", enable_chunked_prefill=True, dtype="float32")
    )
    assert engine.scheduler.mode is StepMode.PREFILL_ONLY
    assert engine.change_role("colocated") == []
    assert engine.scheduler.mode is StepMode.CHUNKED
    engine.shutdown()


# TPOT-aware chunking ---------------------------------------------------------------------------


def test_step_time_model_learns_the_line_of_its_steps():
    from distserve.scheduling.step_time import MIN_STEPS, StepTimeModel

    model = StepTimeModel()
    for _ in range(MIN_STEPS):  # decode steps alone: all about one size, no slope to tell
        model.observe(3, 0.020)
    assert model.line() is None and model.tokens_within(1.0) is None
    for tokens in (64, 1, 200, 2, 128, 3, 32, 1):  # 10 ms a step and 1 ms a token
        model.observe(tokens, 0.010 + 0.001 * tokens)
    for _ in range(300):  # the old steps' weight decays away
        for tokens in (64, 1, 200, 2):
            model.observe(tokens, 0.010 + 0.001 * tokens)
    fixed, per_token = model.line()
    assert fixed == pytest.approx(0.010, abs=1e-4) and per_token == pytest.approx(0.001, rel=1e-3)
    assert model.tokens_within(0.050) in (39, 40)  # (50 - 10) / 1, give or take rounding
    assert model.tokens_within(0.005) == 0  # even an empty step takes longer
    for _ in range(300):  # steps cut to one size: the line they were cut by stands
        model.observe(40, 0.052)
    assert model.line()[1] == pytest.approx(0.001, rel=0.05)
    late = StepTimeModel()  # first asked after a long stretch of decode steps alone: the line stands
    for tokens in (64, 1, 200, 2, 128, 3, 32, 1):
        late.observe(tokens, 0.010 + 0.001 * tokens)
    for _ in range(300):
        late.observe(1, 0.011)
    assert late.line() == pytest.approx((0.010, 0.001))


@pytest.mark.parametrize(
    "aware, tpot_slo, cut",
    [(True, 1e-6, True), (True, 100.0, False), (False, 1e-6, False), (True, None, False)],
    ids=["tight", "loose", "off", "no-slo"],
)
def test_prompt_chunks_beside_a_request_with_a_tight_tpot_slo_are_cut_to_a_block(aware, tpot_slo, cut, reference_model):
    """A request decodes while a 600-token prompt prefills beside it in 256-token steps. With
    ``tpot_aware_chunking`` and a TPOT SLO nothing fits, each of the prompt's chunks is one block
    while it decodes, and full-size again once it ends; a loose SLO, none, or the option off: full
    chunks. Outputs stay greedy and every block is freed."""
    model = reference_model("tiny-llama")
    config = EngineConfig.from_flat(
        model="tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=256, block_size=8,
        tpot_aware_chunking=aware, dtype="float32",
    )  # fmt: skip
    engine = LLMEngine(config, max_step_records=10_000)
    decoding, prompt = random_prompts([100, 600], model.config.vocab_size, seed=7)
    params = {name: SamplingParams(max_tokens=n, temperature=0.0) for name, n in (("decoding", 120), ("prompt", 4))}
    engine.add_sequence(engine.make_sequence(decoding, params["decoding"], "decoding", tpot_slo=tpot_slo))
    outputs: dict[str, list[int]] = {"decoding": [], "prompt": []}
    chunks_while_decoding, chunks_after = [], []
    added = False
    while engine.has_unfinished_requests():
        # Once the step times of its prefill and decode steps are known: one slow step among the
        # first few can hide the slope a while.
        if not added and engine.step_time.line() is not None:
            engine.add_sequence(engine.make_sequence(prompt, params["prompt"], "prompt"))
            added = True
        decoding_now = 0 < len(outputs["decoding"]) < 120
        deltas = engine.step()
        step = engine.stats.records[-1]
        if step.is_prefill and step.batch_size > 1:
            (chunks_while_decoding if decoding_now else chunks_after).append(step.num_tokens - 1)
        for delta in deltas:
            outputs[delta.request_id] += delta.new_token_ids
    assert added, "the step times never became known while the request decoded"
    assert outputs["decoding"] == reference_greedy(model, decoding, 120)
    assert outputs["prompt"] == reference_greedy(model, prompt, 4)
    assert_engine_idle(engine)
    assert chunks_while_decoding and not chunks_after  # the prompt ran beside the decoding request
    if cut:
        assert set(chunks_while_decoding) == {8}, str(chunks_while_decoding)
    else:
        assert chunks_while_decoding[:2] == [255, 255], chunks_while_decoding


def test_a_handed_over_request_keeps_its_tpot_slo():
    engine = LLMEngine(EngineConfig.from_flat(model="tiny-llama", role="prefill", block_size=8, dtype="float32"))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_sequence(engine.make_sequence(list(range(3, 40)), params, "r", tpot_slo=0.05))
    (delta,) = engine.step()
    assert delta.handover.tpot_slo == 0.05 and Sequence.from_handover(delta.handover).tpot_slo == 0.05
    assert [d.finish_reason for d in engine.abort_request("r")] == ["abort"]
