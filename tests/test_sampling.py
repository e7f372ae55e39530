"""Sampling and stopping: seeds, greedy equivalents, top-k/top-p, stop strings and tokens, EOS."""

import pytest
import torch
from conftest import assert_engine_idle, random_prompts

from distserve import LLM, SamplingParams
from distserve.core.outputs import OutputBuilder
from distserve.model_executor import sampler as sampler_module
from distserve.model_executor.sampler import Sampler


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 40, 90, 17], 1024, seed=7)


def _tokens(llm, prompts, params):
    return [o.output_token_ids for o in llm.generate(prompts, params)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm, prompts):
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    together = _tokens(llm, prompts, params)
    alone = [_tokens(llm, [p], sp)[0] for p, sp in zip(prompts, params)]
    assert together == alone
    assert together == _tokens(llm, prompts, params)
    other_seed = _tokens(llm, prompts, [SamplingParams(max_tokens=20, temperature=1.0, seed=1)] * len(prompts))
    assert other_seed != together
    assert_engine_idle(llm.engine)


def test_seeded_sampling_survives_preemption(prompts):
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i) for i in range(len(prompts))]
    roomy = LLM("tiny-llama", block_size=4)
    tight = LLM("tiny-llama", block_size=4, num_kv_blocks=32)
    assert _tokens(roomy, prompts, params) == _tokens(tight, prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=1)])
def test_greedy_equivalents(llm, prompts, params):
    params.max_tokens = 15
    greedy = _tokens(llm, prompts, SamplingParams(max_tokens=15, temperature=0.0))
    assert _tokens(llm, prompts, params) == greedy


def test_unseeded_sampling_differs_from_greedy(llm, prompts):
    sampled = _tokens(llm, prompts, SamplingParams(max_tokens=15, temperature=1.5))
    assert sampled != _tokens(llm, prompts, SamplingParams(max_tokens=15, temperature=0.0))


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)
    top_k = sampler(logits, [SamplingParams(temperature=1.0, top_k=2)] * 400, list(range(400)))
    assert set(top_k) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, ...: top_p=0.8 keeps the first two
    assert probs[0] < 0.8 < probs[:2].sum()
    top_p = sampler(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 400, list(range(400)))
    assert set(top_p) == {0, 1}
    tiny_p = sampler(logits[:50], [SamplingParams(temperature=1.0, top_p=0.01)] * 50, list(range(50)))
    assert set(tiny_p) == {0}
    full = sampler(logits, [SamplingParams(temperature=1.0)] * 400, list(range(400)))
    assert set(full) == {0, 1, 2, 3, 4}


def test_sampling_follows_the_distribution():
    sampler = Sampler(seed=0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    picks = torch.tensor(sampler(logits, [SamplingParams(temperature=1.0)] * 4000, [0] * 4000))
    freq = torch.bincount(picks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


@pytest.mark.parametrize(
    "options",
    [{"top_p": 0.9}, {"top_k": 50}, {"top_k": 50, "top_p": 0.5}, {"top_k": 3000, "top_p": 0.8}, {"top_k": 3000}],
    ids=["top-p", "top-k", "both", "wide-k-top-p", "wide-k"],
)
@pytest.mark.parametrize("scale", [1.0, 3.0, 6.0], ids=["flat", "mostly-peaked", "peaked"])
def test_filters_keep_the_same_tokens_from_the_likeliest_candidates_as_from_a_full_sort(monkeypatch, options, scale):
    """Top-k and top-p look among the likeliest tokens first (a partial sort) and over the whole
    vocabulary only where those cannot hold what a row keeps: the tokens kept and their
    probabilities are those of a full sort either way."""
    logits = torch.randn(8, 8000, generator=torch.Generator().manual_seed(1)) * scale
    params = [SamplingParams(temperature=1.0, **options)] * 8

    def kept() -> list[dict[int, float]]:
        probs, ids = Sampler._filtered(logits, params)
        return [{int(t): float(p) for t, p in zip(row_ids, row) if p > 0} for row, row_ids in zip(probs, ids)]

    partial = kept()
    width = Sampler._filtered(logits, params)[0].shape[-1]
    # Among the candidates where the row's top-k is within them, or, without a top-k, its top-p
    # mass is (peaked); a top-k past them but short of the vocabulary orders the vocabulary.
    small_k = options.get("top_k", 8000) <= sampler_module.TOP_CANDIDATES
    top_p_only = "top_k" not in options
    assert (width == sampler_module.TOP_CANDIDATES) == (small_k or (scale > 1 and top_p_only))
    monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", logits.shape[-1])
    full = kept()
    assert [row.keys() for row in partial] == [row.keys() for row in full]
    for a, b in zip(partial, full):
        assert torch.allclose(torch.tensor(list(a.values())), torch.tensor([b[t] for t in a]), atol=1e-6)


def test_a_vanishing_temperature_samples_greedily():
    """A temperature that would overflow the scaled logits (inf / inf = NaN) is greedy, and NaN
    logits never make a token outside the vocabulary."""
    sampler = Sampler(seed=0)
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2)) * 10
    tiny = sampler(logits, [SamplingParams(temperature=3.9e-105)] * 4, [0] * 4)
    assert tiny == logits.argmax(dim=-1).tolist()
    nan = sampler(torch.full((4, 1000), float("nan")), [SamplingParams(temperature=1.0)] * 4, [0] * 4)
    assert all(0 <= t < 1000 for t in nan)


def test_tokens_without_probability_are_never_drawn():
    """A draw is placed in the rows' cumulative probabilities: tokens of probability 0 (masked to
    -inf) on either side of the allowed ones, or between them, never come out."""
    sampler = Sampler(seed=0)
    inf = float("inf")
    logits = torch.tensor([[-inf, 0.0, -inf, 0.0, -inf, -inf]]).repeat(3000, 1)
    picks = sampler(logits, [SamplingParams(temperature=1.0)] * 3000, list(range(3000)))
    assert set(picks) == {1, 3}


def test_a_draw_across_chunks_follows_the_weights_and_never_takes_an_empty_entry():
    """``draw`` finds the chunk, then the entry: weights on both sides of chunk boundaries (255,
    256), in the last, padded chunk (999 of 1,000), none anywhere else, not normalized."""
    weights = torch.zeros(20_000, 1000)
    chosen = {0: 1.0, 255: 3.0, 256: 2.0, 511: 0.5, 999: 3.5}
    for entry, weight in chosen.items():
        weights[:, entry] = weight
    uniform = torch.rand(20_000, 1, generator=torch.Generator().manual_seed(3))
    picks = sampler_module.draw(weights, uniform)
    freq = torch.bincount(picks, minlength=1000).float() / len(picks)
    assert set(picks.tolist()) == set(chosen)
    expected = torch.tensor([chosen[e] for e in sorted(chosen)]) / sum(chosen.values())
    assert torch.allclose(freq[sorted(chosen)], expected, atol=0.015)


def test_stop_token_ids_and_max_tokens(llm, prompts):
    greedy = _tokens(llm, prompts[:1], SamplingParams(max_tokens=20, temperature=0.0))[0]
    stop_at = greedy[6]
    first = greedy.index(stop_at)
    out = llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.output_token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    out = llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.output_token_ids == greedy[:3] and out.finish_reason == "length"


def test_eos_stops_unless_ignored(llm, prompts):
    eos = llm.tokenizer.eos_token_id
    greedy = _tokens(llm, prompts[:1], SamplingParams(max_tokens=20, temperature=0.0))[0]
    # Make the model's own 4th greedy token count as EOS by treating it as a stop token of the engine.
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({greedy[3]})
    try:
        stopped = llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0.0))[0]
        ignored = llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.output_token_ids == greedy[: greedy.index(greedy[3]) + 1]
    assert stopped.finish_reason == "stop"
    assert ignored.output_token_ids == greedy and ignored.finish_reason == "length"
    assert eos in saved


def test_stop_strings_cut_the_text(llm):
    prompt = "The cache block"
    full = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0))[0]
    visible = full.text.replace("\ufffd", "")
    stop = visible[5:8]
    assert len(stop) == 3 and stop in full.text
    cut = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(
        prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=stop, include_stop_str_in_output=True)
    )[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    assert len(cut.output_token_ids) < len(full.output_token_ids)
    assert_engine_idle(llm.engine)


def test_streamed_text_never_shows_a_stop_string(llm):
    """Text is streamed as it is decoded, yet what was streamed is exactly the final (cut) text: a
    stop string that spans several steps never shows its first characters before it completes."""
    engine = llm.engine
    prompt = "The cache block"
    full = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0))[0]
    visible = full.text.replace("\ufffd", "")
    for start in range(2, 12):
        stop = visible[start : start + 4]
        engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]), "streamed")
        builder, streamed = OutputBuilder("streamed", prompt, []), ""
        while engine.has_unfinished_requests():
            for delta in engine.step():
                streamed += builder.add(delta).new_text
                assert stop not in streamed
        assert streamed == full.text[: full.text.index(stop)]
    assert_engine_idle(llm.engine)


def test_streamed_text_adds_up(llm):
    engine = llm.engine
    engine.add_request("Hello world, the server", SamplingParams(max_tokens=25, temperature=0.0), "stream")
    builder = OutputBuilder("stream", None, [])
    pieces, tokens = [], []
    final = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out = builder.add(delta)
            pieces.append(out.new_text)
            tokens.extend(out.new_token_ids)
            final = out
    assert "".join(pieces) == final.text
    assert tokens == final.output_token_ids
    assert final.text == llm.tokenizer.decode(final.output_token_ids, skip_special_tokens=True)
