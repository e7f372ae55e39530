"""Structured outputs through the engine: every kind's output parses and validates, whatever the
batch, the prompt's chunks or a preemption; a bad spec is the request's fault."""

import pytest
from conftest import GRAMMAR, PROMPTS, SCHEMA, assert_engine_idle, check_structured

from distserve import LLM, SamplingParams
from distserve.core.errors import RequestError
from distserve.core.sampling_params import StructuredOutputsParams

SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


def _params(kind: str, seed: int, **options) -> SamplingParams:
    options = {"max_tokens": 300, **options}
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=SPECS[kind], **options)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", dtype="float32")


def test_every_kind_validates_in_one_mixed_batch(llm):
    """Each kind beside the others and beside unconstrained requests: every output is complete."""
    kinds = [kind for kind in SPECS for _ in range(2)]
    params = [_params(kind, seed) for seed, kind in enumerate(kinds)]
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=99)
    outputs = llm.generate([PROMPTS[i % 4] for i in range(len(kinds) + 1)], [*params, free])
    for kind, out in zip(kinds, outputs):
        if kind == "json_object" and out.finish_reason == "length":
            assert out.text.startswith("{")  # any object: a random model's strings may outlast max_tokens
            continue
        assert out.finish_reason == "stop", (kind, out.text)
        check_structured(kind, out.text)
    assert any(o.finish_reason == "stop" for k, o in zip(kinds, outputs) if k == "json_object")
    assert len(outputs[-1].output_token_ids) == 30  # the unconstrained one went its own way
    assert_engine_idle(llm.engine)


def test_outputs_survive_chunked_prompts_and_preemption():
    """A grammar's state is rebuilt from the tokens, so recomputing a preempted request (a small KV
    pool) or computing its prompt in chunks changes nothing: the same seeded outputs, all valid."""
    params = [_params("json", seed, max_tokens=150) for seed in range(4)]
    roomy = [o.text for o in LLM("tiny-llama", block_size=4, dtype="float32").generate(PROMPTS, params)]
    tight = LLM("tiny-llama", block_size=4, num_kv_blocks=50, dtype="float32")
    assert [o.text for o in tight.generate(PROMPTS, params)] == roomy
    assert tight.engine.scheduler.num_preemptions > 0
    chunked = LLM("tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=8, dtype="float32")
    assert [o.text for o in chunked.generate(PROMPTS, params)] == roomy
    for text in roomy:
        check_structured("json", text)
    assert_engine_idle(tight.engine)
    assert_engine_idle(chunked.engine)


def test_a_complete_output_ends_whatever_ignore_eos_and_min_tokens(llm):
    out = llm.generate(["Hello"], _params("choice", 0, ignore_eos=True, min_tokens=50))[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no", "maybe")


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "object", "properties": 5}}, "structured outputs' JSON schema is invalid"),
        ({"regex": "(unclosed"}, "structured outputs' regex is invalid"),
        ({"grammar": "root ::= missing"}, "structured outputs' EBNF grammar is invalid"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused(llm, spec, message):
    with pytest.raises(RequestError, match=message):
        llm.generate(["Hello"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert_engine_idle(llm.engine)
