"""Penalties, biases, bans and logprobs against references computed from transformers' logits on
the same weights."""

import pytest
import torch
from conftest import assert_engine_idle, random_prompts

from distserve import LLM, SamplingParams
from distserve.core.errors import RequestError

VOCAB = 1024


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", dtype="float32")


@pytest.fixture(scope="module")
def model(reference_model):
    return reference_model("tiny-llama")


@pytest.fixture(scope="module")
def prompts():
    # Short alphabets make repeats, so that penalties change what greedy picks.
    rng = random_prompts([12, 30, 45], 40, seed=3)
    return [[3 + t for t in p] for p in rng]


def _reference(model, prompt: list[int], max_tokens: int, shape) -> list[int]:
    """Greedy tokens of the model's full-sequence logits after ``shape(logits, prompt, outputs)``."""
    outputs: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + outputs])).logits[0, -1].float()
            outputs.append(int(shape(logits, prompt, outputs).argmax()))
    return outputs


def _greedy(llm, prompts, **options) -> list[list[int]]:
    params = SamplingParams(max_tokens=20, temperature=0.0, **options)
    return [o.output_token_ids for o in llm.generate(prompts, params)]


def test_repetition_penalty_equals_transformers_generate(llm, model, prompts):
    got = _greedy(llm, prompts, repetition_penalty=1.8)
    with torch.inference_mode():
        want = [
            model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, repetition_penalty=1.8)[0, len(p) :]
            for p in prompts
        ]
    assert got == [w.tolist() for w in want]
    assert got != _greedy(llm, prompts), "the penalty changed nothing: the test shows nothing"
    assert_engine_idle(llm.engine)


def test_presence_and_frequency_penalties_equal_a_reference(llm, model, prompts):
    def shape(logits, prompt, outputs):
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - 0.9 * counts - 1.5 * (counts > 0).float()

    got = _greedy(llm, prompts, presence_penalty=1.5, frequency_penalty=0.9)
    assert got == [_reference(model, p, 20, shape) for p in prompts]
    assert got != _greedy(llm, prompts)


def test_logit_bias_allowed_tokens_and_bad_words(llm, model, prompts):
    plain = _greedy(llm, prompts)
    favourite = plain[0][3]
    biased = _greedy(llm, prompts, logit_bias={str(favourite): 100})
    assert all(t == favourite for out in biased for t in out)
    allowed = [plain[1][0], 7, 9]
    assert {t for out in _greedy(llm, prompts, allowed_token_ids=allowed) for t in out} <= set(allowed)
    # A bad word of one token: banned everywhere (the reference bans the same ids).
    word = llm.tokenizer.decode([plain[2][0]])
    banned = llm.engine.input_processor.resolve(SamplingParams(bad_words=[word])).bad_words_token_ids
    single = {ids[0] for ids in banned if len(ids) == 1}
    assert plain[2][0] in single

    def ban(logits, prompt, outputs):
        logits[list(single)] = float("-inf")
        return logits

    got = _greedy(llm, prompts, bad_words=[word])
    assert got == [_reference(model, p, 20, ban) for p in prompts]
    assert all(t not in single for out in got for t in out)
    assert_engine_idle(llm.engine)


def test_min_tokens_holds_back_stop_tokens(llm, prompts):
    plain = _greedy(llm, prompts[:1])[0]
    stop = plain[1]
    early = llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop]))[0]
    assert early.output_token_ids == plain[:2] and early.finish_reason == "stop"
    held = llm.generate(
        prompts[:1], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop], min_tokens=6)
    )[0]
    assert len(held.output_token_ids) >= 6 and stop not in held.output_token_ids[:6]
    assert held.output_token_ids[:1] == plain[:1]


def test_min_p_of_one_is_greedy(llm, prompts):
    sampled = _greedy(llm, prompts, min_p=0.0)  # temperature 0: greedy whatever min_p
    params = SamplingParams(max_tokens=20, temperature=1.5, min_p=1.0, seed=4)
    assert [o.output_token_ids for o in llm.generate(prompts, params)] == sampled


def test_features_do_not_leak_across_a_batch(llm, prompts):
    mixed = [
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.8),
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=2.0, logprobs=2),
    ]
    together = [o.output_token_ids for o in llm.generate(prompts, mixed)]
    alone = [llm.generate([p], sp)[0].output_token_ids for p, sp in zip(prompts, mixed)]
    assert together == alone


def test_logprobs_equal_transformers_log_softmax(llm, model):
    prompts = random_prompts([9, 33], VOCAB, seed=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        with torch.inference_mode():
            full = model(torch.tensor([prompt + out.output_token_ids])).logits[0].float().log_softmax(-1)
        assert len(out.logprobs) == len(out.output_token_ids) == 6
        for i, (token, lp) in enumerate(zip(out.output_token_ids, out.logprobs)):
            row = full[len(prompt) - 1 + i]
            assert lp.token_id == token and abs(lp.logprob - row[token].item()) < 1e-4
            assert lp.rank == 1  # greedy picks the likeliest
            top = row.topk(5)
            assert lp.top_token_ids == top.indices.tolist()
            assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) < 1e-4
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position, lp in enumerate(out.prompt_logprobs[1:], start=1):
            row = full[position - 1]
            assert lp.token_id == prompt[position] and abs(lp.logprob - row[prompt[position]].item()) < 1e-4
            assert lp.rank == int((row > row[prompt[position]]).sum()) + 1
            assert lp.top_token_ids == row.topk(3).indices.tolist()


def test_prompt_logprobs_whatever_the_chunks_and_the_prefix_cache(llm):
    prompt = random_prompts([70], VOCAB, seed=6)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1, logprobs=1)
    whole = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]  # its blocks are in the prefix cache now
    chunked = LLM("tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=8, dtype="float32")
    pieces = chunked.generate([prompt], params)[0]
    for other in (again, pieces):
        assert other.output_token_ids == whole.output_token_ids
        assert [lp and lp.token_id for lp in other.prompt_logprobs] == [
            lp and lp.token_id for lp in whole.prompt_logprobs
        ]
        got = [lp.logprob for lp in other.prompt_logprobs[1:]]
        want = [lp.logprob for lp in whole.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert_engine_idle(chunked.engine)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    for options in ({"logit_bias": {VOCAB: 1.0}}, {"allowed_token_ids": [VOCAB + 5]}):
        with pytest.raises(RequestError, match="outside the vocabulary"):
            llm.generate(["hello"], SamplingParams(**options))
    assert_engine_idle(llm.engine)
