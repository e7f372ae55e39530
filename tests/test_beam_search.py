"""Beam search in the engine: k beams that share their KV blocks copy on write, equal to
transformers' ``generate(num_beams=k, num_return_sequences=k, ...)`` in float32 (token ids and
sequence scores) on every tiny family, under KV pressure too (beams preempted together, recomputed
or swapped), with every block back at the end or on a cancel."""

import pytest
from conftest import FAMILIES, assert_engine_idle, random_prompts, reference_beams

from distserve import LLM, BeamSearchParams, RequestError, SamplingParams
from distserve.core.request_limits import RequestLimits

BLOCK = 8
SCORE_TOLERANCE = 1e-4  # the paged forward pass sums in another order than transformers'


@pytest.fixture(scope="module")
def llms():
    made = {}

    def get(family: str, **options) -> LLM:
        key = (family, tuple(sorted(options.items())))
        if key not in made:
            made[key] = LLM(family, **{"block_size": BLOCK, "dtype": "float32", **options})
        return made[key]

    yield get
    for llm in made.values():
        llm.shutdown()


def stop_ids(llm: LLM, params: SamplingParams) -> list[int]:
    return list(llm.engine.input_processor.resolve(params).all_stop_token_ids)


def assert_equal_to_reference(outputs, expected) -> None:
    assert [o.output_token_ids for o in outputs] == [tokens for tokens, _ in expected]
    for output, (_, score) in zip(outputs, expected):
        assert output.beam_score == pytest.approx(score, abs=SCORE_TOLERANCE)
        assert output.finished and output.finish_reason in ("stop", "length")


# (beam width, length_penalty, early_stopping, whether a likely token is a stop token too)
CASES = [
    (2, 1.0, False, True),
    (4, 0.8, True, True),
    (4, 2.0, True, False),
    (8, 0.5, "never", True),
    (4, -1.0, False, False),
    (4, 1.5, "never", False),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("width, length_penalty, early_stopping, stop_likely", CASES)
def test_equal_to_transformers(llms, reference_model, family, width, length_penalty, early_stopping, stop_likely):
    llm, model = llms(family), reference_model(family)
    (prompt,) = random_prompts([11], model.config.vocab_size, seed=width)
    params = SamplingParams(
        max_tokens=10, beam_width=width, n=width, length_penalty=length_penalty, early_stopping=early_stopping
    )
    if stop_likely:  # one of the best beam's tokens, with which some returned hypothesis ends
        best = llm.generate([prompt], params)[0]
        for token in reversed(best.output_token_ids):
            params = SamplingParams(**{**vars(params), "stop_token_ids": [token]})
            expected = reference_beams(model, prompt, params, stop_ids(llm, params))
            if any(tokens[-1] == token for tokens, _ in expected):
                break
    else:
        expected = reference_beams(model, prompt, params, stop_ids(llm, params))
    outputs = llm.generate([prompt], params)
    assert_equal_to_reference(outputs, expected)
    if stop_likely:
        assert any(o.finish_reason == "stop" for o in outputs)
    assert_engine_idle(llm.engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("swap_space", [0.0, 0.01])
def test_equal_under_kv_pressure(llms, reference_model, family, swap_space):
    # 24 blocks of 4 tokens hold one search of 4 beams (18 blocks at most) but not three: the
    # newest searches' beams are preempted together, recomputed or swapped out.
    llm = llms(family, block_size=4, num_kv_blocks=24, swap_space=swap_space)
    model = reference_model(family)
    prompts = random_prompts([10, 9, 11], model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=12, beam_width=4, n=2, length_penalty=0.7)
    before = llm.engine.scheduler.num_preemptions
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > before
    if swap_space:
        assert llm.engine.scheduler.swap.num_swap_outs > 0
    for i, prompt in enumerate(prompts):
        assert_equal_to_reference(
            outputs[2 * i : 2 * i + 2], reference_beams(model, prompt, params, stop_ids(llm, params))
        )
    assert_engine_idle(llm.engine)


def test_equal_with_chunked_prefill(llms, reference_model):
    # Prompts in chunks beside decoding beams, and beams recomputed in chunks after preemption: a
    # beam that has its candidates runs its newest token again until its siblings have theirs.
    llm = llms("tiny-llama", block_size=4, num_kv_blocks=24, enable_chunked_prefill=True, max_num_batched_tokens=8)
    model = reference_model("tiny-llama")
    prompts = random_prompts([10, 19, 11], model.config.vocab_size, seed=8)
    params = SamplingParams(max_tokens=12, beam_width=4, n=4, early_stopping=True)
    before = llm.engine.scheduler.num_preemptions
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > before
    stops = stop_ids(llm, params)
    for i, prompt in enumerate(prompts):
        assert_equal_to_reference(outputs[4 * i : 4 * i + 4], reference_beams(model, prompt, params, stops))
    assert_engine_idle(llm.engine)


def test_beams_share_blocks_and_free_them(llms):
    llm = llms("tiny-llama")
    engine, bm = llm.engine, llm.engine.block_manager
    (prompt,) = random_prompts([24], 1000, seed=1)  # three full blocks
    width = 4
    params = SamplingParams(max_tokens=12, beam_width=width, ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    for _ in range(10):  # the prompt, then 9 steps: each beam has 9 or 10 tokens of its own
        engine.step()
    beams = engine.beam_searches[request_id].beams
    assert len(beams) == width
    in_use = bm.num_blocks - bm.num_free_blocks
    tables = [beam.block_table for beam in beams]
    assert in_use == len({block for table in tables for block in table})  # a shared block counts once
    assert all(table[:3] == tables[0][:3] for table in tables)  # the prompt's blocks, shared
    independent = width * bm.blocks_needed(beams[0].num_tokens)  # k sequences holding their own
    assert in_use <= 3 + width * 2 < independent
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(engine)


def test_cancel_mid_search_frees_every_block(llms):
    engine = llms("tiny-llama").engine
    (prompt,) = random_prompts([21], 1000, seed=2)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=30, beam_width=8, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert len(engine.beam_searches[request_id].beams) == 8
    engine.abort_request(request_id)
    assert_engine_idle(engine)


def test_llm_beam_search_as_vllm_names_it(llms, reference_model):
    llm, model = llms("tiny-qwen2"), reference_model("tiny-qwen2")
    prompts = random_prompts([7, 13], model.config.vocab_size, seed=4)
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=1.2)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(results) == 2
    for prompt, result in zip(prompts, results):
        sampling = params.sampling_params()
        expected = reference_beams(model, prompt, sampling, stop_ids(llm, sampling))
        assert [s.tokens for s in result.sequences] == [prompt + tokens for tokens, _ in expected]
        assert [s.score for s in result.sequences] == pytest.approx([score for _, score in expected], abs=1e-4)
        for seq in result.sequences:
            output = seq.tokens[len(prompt) :]
            assert seq.score == pytest.approx(seq.cum_logprob / len(output) ** 1.2, rel=1e-5)
    assert_engine_idle(llm.engine)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"beam_width": 0}, "beam_width must be an integer >= 1"),
        ({"beam_width": 2, "n": 3}, "n must be at most beam_width=2"),
        ({"length_penalty": 2.0}, "length_penalty and early_stopping apply only to beam search"),
        ({"early_stopping": True}, "length_penalty and early_stopping apply only to beam search"),
        ({"beam_width": 2, "early_stopping": "always"}, 'early_stopping must be true, false or "never"'),
        ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty must be a finite number"),
        (
            {"beam_width": 2, "logprobs": 1, "stop": ["x"]},
            r"stop does not apply to beam search \(beam_width\): leave out stop, logprobs",
        ),
        ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty does not apply to beam search"),
    ],
)
def test_refused_params(fields, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**fields)


def test_sampling_options_are_ignored(llms):
    # As vLLM's beam search: beams are scored by the model's own logprobs, whatever would pick among them.
    llm = llms("tiny-llama")
    (prompt,) = random_prompts([9], 1000, seed=6)
    plain = SamplingParams(max_tokens=6, beam_width=3, n=3)
    shaped = SamplingParams(max_tokens=6, beam_width=3, n=3, temperature=1.7, top_p=0.5, top_k=4, seed=1)
    assert [o.output_token_ids for o in llm.generate([prompt], plain)] == [
        o.output_token_ids for o in llm.generate([prompt], shaped)
    ]


def test_limits_bound_the_width(llms):
    with pytest.raises(RequestError, match=r"beam_width is 9, over the limit of 8 .*cluster.limits.max_n"):
        RequestLimits(max_n=8).check_params(SamplingParams(beam_width=9))
    llm = llms("tiny-llama", num_kv_blocks=16)
    with pytest.raises(RequestError, match="may hold 26 KV blocks, more than the cache's 16"):
        llm.generate([[5] * 8], SamplingParams(max_tokens=30, beam_width=5))
    assert_engine_idle(llm.engine)
