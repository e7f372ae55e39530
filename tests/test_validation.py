"""Bad input fails early with a ValueError that says what to fix; the engine keeps serving."""

import shutil

import pytest
from conftest import assert_engine_idle

from distserve import LLM, SamplingParams
from distserve.model_executor.tiny_models import ensure_tiny_model


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-gpt2", max_model_len=64)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"seed": "1", "n": 2}, "seed must be an integer"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 30, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ],
)
def test_bad_sampling_params(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "the prompt is empty"),
        ([], "the prompt is empty"),
        ([5] * 64, "the prompt has 64 tokens but the model's context is 64: shorten it to at most 63"),
        ([5, 10**6], r"prompt token ids must be in \[0, 1024\)"),
    ],
)
def test_bad_prompts_then_engine_still_serves(llm, prompt, message):
    good = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", prompt], good)
    assert_engine_idle(llm.engine)  # the good prompt of the failed call was never queued
    out = llm.generate("still serving", good)[0]
    assert len(out.output_token_ids) == 4
    assert_engine_idle(llm.engine)


def test_generation_stops_at_the_context_limit(llm):
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4 and out.finish_reason == "length"


def test_request_larger_than_the_kv_cache():
    small = LLM("tiny-llama", num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="more than the KV cache's 8: lower max_tokens"):
        small.generate([[5] * 6], SamplingParams(max_tokens=5))
    assert small.generate([[5] * 3], SamplingParams(max_tokens=5))[0].output_token_ids


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request("a", SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request("b", SamplingParams(max_tokens=2), request_id="dup")
    engine.abort_request("dup")
    assert_engine_idle(llm.engine)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"model": "no-such-model"}, "unknown model 'no-such-model': pass a local model directory"),
        ({"model": "/nonexistent/dir"}, "unknown model '/nonexistent/dir'"),
        ({"model": "llama-2-7b"}, "'llama-2-7b' is a preset .* add --load-format dummy"),
        ({"model": "tiny-llama", "max_model_len": 5000}, "exceeds the model's context of 1024"),
        ({"model": "tiny-llama", "block_size": 0}, "block_size must be at least 1"),
        ({"model": "tiny-llama", "policy": "lifo"}, "policy must be one of fcfs, sjf, priority, deadline,"),
        ({"model": "tiny-llama", "dtype": "int3"}, "dtype must be one of"),
        ({"model": "tiny-llama", "bogus": 1}, "unknown engine option 'bogus'"),
    ],
)
def test_bad_engine_options(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(**options)


def test_missing_tokenizer(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(ensure_tiny_model("tiny-llama"), model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model_dir / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="no tokenizer found in .*: add the tokenizer files or pass --tokenizer"):
        LLM(str(model_dir))
    # With an explicit tokenizer the same directory loads.
    llm = LLM(str(model_dir), tokenizer=str(ensure_tiny_model("tiny-llama")))
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].output_token_ids


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))


def test_prompt_forms(llm):
    """Text, token ids, and vLLM's TextPrompt and TokensPrompt dicts, alone or in a list."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ids = llm.tokenizer.encode("hello there")
    plain = [o.output_token_ids for o in llm.generate(["hello there", ids], params)]
    forms = [{"prompt": "hello there"}, {"prompt_token_ids": ids}]
    assert [o.output_token_ids for o in llm.generate(forms, params)] == plain
    assert llm.generate(forms[1], params)[0].output_token_ids == plain[1]
    with pytest.raises(ValueError, match="a prompt dict must be"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {}}], params)
    assert_engine_idle(llm.engine)
