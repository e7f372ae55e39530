"""Structured outputs with the real grammar library on the tiny model's tokenizer: random walks that
only take allowed tokens end in valid text, a replayed matcher masks as the live one did at every
step, invalid specs are the request's fault, and apply_bitmask masks exactly what the bitmask bans."""

from __future__ import annotations

import ast
import json
import random
import re
import threading

import jsonschema  # a dependency of ray
import pytest
import torch

from distserve.core.config import ModelConfig
from distserve.core.errors import RequestError
from distserve.core.sampling_params import StructuredOutputsParams
from distserve.engine.structured_output import GrammarCompiler, GrammarMatcher
from distserve.model_executor.model_loader import load_tokenizer, resolve_model
from distserve.model_executor.token_bitmask import _apply_bitmask_torch, allocate_bitmask, apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},  # xgrammar's length-bounded strings take raw \t, \x01
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
CHOICE = ["yes", "no", 'say "maybe"\n', "日本😀"]
GRAMMAR = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= "0" | [1-9] [0-9]*
"""
CASES = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICE),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


def check_text(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    else:
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
        assert all(isinstance(node, allowed) for node in ast.walk(ast.parse(text, mode="eval"))), text


@pytest.fixture(scope="module")
def model():
    resolved = resolve_model(ModelConfig(model="tiny-llama"))
    return load_tokenizer(resolved), resolved.hf_config.vocab_size


@pytest.fixture(scope="module")
def compiler(model):
    tokenizer, vocab_size = model
    return GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """Row ``row`` of ``bitmask`` as a bool per token."""
    return (((bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1) == 1).flatten()[:vocab_size]


@pytest.fixture(scope="module")
def token_classes(model):
    """Per token: whether it closes a string or nesting, opens one, or shows anything but whitespace."""
    tokenizer, vocab_size = model
    texts = [tokenizer.decode([t]) for t in range(vocab_size)]
    return (
        torch.tensor([bool(set('"}])') & set(t)) for t in texts]),
        torch.tensor([bool(set("{[(") & set(t)) for t in texts]),
        torch.tensor([bool(t.strip()) for t in texts]),
    )


def random_walk(compiler, compiled, classes, eos: int, seed: int, limit: int = 300):
    """Sample uniformly among allowed tokens (EOS once allowed; after 40 tokens, closing tokens if
    any, else visible non-opening ones, so every walk ends), checking at each step that a matcher
    replaying the tokens so far masks exactly as the live one. Returns the tokens, EOS excluded."""
    closes, opens, visible = classes
    rng = random.Random(seed)
    live = GrammarMatcher(compiled)
    bitmask = allocate_bitmask(2, compiler.vocab_size)
    out: list[int] = []
    for step in range(limit):
        live.fill_bitmask(bitmask, 0)
        GrammarMatcher.replay(compiled, out).fill_bitmask(bitmask, 1)
        assert torch.equal(bitmask[0], bitmask[1]), f"replayed mask differs at step {step}"
        ok = allowed(bitmask, 0, compiler.vocab_size)
        if ok[eos]:
            assert live.is_completed()
            assert live.accept(eos) and live.is_terminated()
            return out
        prefs = [ok & closes, ok & visible & ~opens] if step >= 40 else []
        pool = next(p for p in [*prefs, ok & visible, ok] if p.any()).nonzero().flatten().tolist()
        token = rng.choice(pool)
        assert live.accept(token)
        out.append(token)
    raise AssertionError(f"no end after {limit} tokens")


@pytest.mark.parametrize("kind", list(CASES))
def test_random_walks_end_in_valid_text_and_replay_masks_as_live(model, compiler, token_classes, kind):
    tokenizer, _ = model
    compiled = compiler.compile(CASES[kind])
    for seed in range(3):
        tokens = random_walk(compiler, compiled, token_classes, tokenizer.eos_token_id, seed)
        check_text(kind, tokenizer.decode(tokens))
        replayed = GrammarMatcher.replay(compiled, [*tokens, tokenizer.eos_token_id])
        assert replayed.is_terminated() and replayed.num_tokens == len(tokens) + 1


def test_json_masks_never_allow_raw_control_characters(model, compiler):
    """Valid JSON holds no raw control character but \\n and \\r, even inside a length-bounded string."""
    tokenizer, vocab_size = model
    compiled = compiler.compile(
        StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}})
    )
    matcher = GrammarMatcher.replay(compiled, tokenizer.encode('{"s": "ab', add_special_tokens=False))
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    ids = allowed(bitmask, 0, vocab_size).nonzero().flatten().tolist()
    assert len(ids) > 100  # inside the string: almost anything
    control = [t for t in ids if any(ord(c) < 0x20 and c not in "\n\r" for c in tokenizer.decode([t]))]
    assert not control, [tokenizer.decode([t]) for t in control]
    tab = tokenizer.convert_tokens_to_ids("\u0109")  # byte-level BPE's \t
    assert tokenizer.decode([tab]) == "\t" and not matcher.accept(tab)


def test_complete_grammar_allows_exactly_the_stop_tokens_then_terminates(model):
    tokenizer, vocab_size = model
    stops = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    compiler = GrammarCompiler(tokenizer, vocab_size, stops)
    compiled = compiler.compile(StructuredOutputsParams(choice=["yes"]))
    matcher = GrammarMatcher.replay(compiled, tokenizer.encode("yes", add_special_tokens=False))
    assert matcher.is_completed() and not matcher.is_terminated()
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, vocab_size).nonzero().flatten().tolist() == sorted(stops)
    assert not matcher.accept(tokenizer.bos_token_id)
    assert matcher.accept(tokenizer.pad_token_id) and matcher.is_terminated()
    assert not matcher.accept(tokenizer.eos_token_id)  # nothing after the end
    matcher.fill_bitmask(bitmask, 0)  # a terminated matcher's row still allows only the stops
    assert allowed(bitmask, 0, vocab_size).nonzero().flatten().tolist() == sorted(stops)


def test_stop_token_not_allowed_before_the_grammar_is_complete(model, compiler):
    tokenizer, _ = model
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex=REGEX)))
    assert not matcher.accept(tokenizer.eos_token_id) and matcher.num_tokens == 0


def test_replay_on_another_instance_continues_where_the_first_left(model, compiler, token_classes):
    """Prefill instance and decode instance each have their own compiler: the decode side rebuilds
    the state from the spec and the tokens, and its masks go on as the prefill side's would."""
    tokenizer, vocab_size = model
    params = CASES["json"]
    tokens = random_walk(compiler, compiler.compile(params), token_classes, tokenizer.eos_token_id, seed=7)
    other = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    for cut in (0, 1, len(tokens) // 2, len(tokens)):
        first = compiler.matcher(params, tokens[:cut])
        second = other.matcher(params, tokens[:cut])
        for token in tokens[cut:]:
            bitmask = allocate_bitmask(2, vocab_size)
            first.fill_bitmask(bitmask, 0)
            second.fill_bitmask(bitmask, 1)
            assert torch.equal(bitmask[0], bitmask[1])
            assert first.accept(token) and second.accept(token)
        assert second.accept(tokenizer.eos_token_id) and second.is_terminated()


def test_replay_of_tokens_the_grammar_refuses_raises(model, compiler):
    tokenizer, _ = model
    with pytest.raises(ValueError, match="output position 0 is not allowed by the json_object grammar"):
        GrammarMatcher.replay(compiler.compile(CASES["json_object"]), tokenizer.encode("hi", add_special_tokens=False))


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(json='{"type": "nonsense"}'), "JSON schema is invalid: Unsupported type"),
        (dict(json={"type": "object", "properties": 3}), "JSON schema is invalid: properties must be an object"),
        (dict(json='{"type": "object"'), "JSON schema is not valid JSON"),
        (dict(regex="a(b"), "regex is invalid: .*parenthesis is not closed"),
        (dict(regex="[z-a]"), "regex is invalid"),
        (dict(grammar='root ::= "a" |'), "EBNF grammar is invalid"),
        (dict(grammar='start ::= "a"'), 'EBNF grammar is invalid: .*root rule with name "root" is not found'),
        (dict(grammar="\u0080"), "EBNF grammar is invalid$"),  # xgrammar's message about it cannot be decoded
    ],
)
def test_invalid_spec_is_a_request_error(compiler, params, message):
    with pytest.raises(RequestError, match=message) as info:
        compiler.compile(StructuredOutputsParams(**params))
    assert "\n" not in str(info.value) and "/project/" not in str(info.value)
    with pytest.raises(RequestError, match=message):  # failures are not cached: the same answer again
        compiler.compile(StructuredOutputsParams(**params))


def test_compile_cache_is_keyed_by_kind_and_spec_and_bounded(model):
    tokenizer, vocab_size = model
    compiler = GrammarCompiler(tokenizer, vocab_size, max_cached=2)
    a = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputsParams(json=dict(SCHEMA))) is a
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is a  # the same text
    assert compiler.compile(StructuredOutputsParams(regex="yes")) is not compiler.compile(
        StructuredOutputsParams(choice=["yes"])
    )  # two more: the schema is the least recently used and goes
    assert compiler.compile(StructuredOutputsParams(json=SCHEMA)) is not a


def test_concurrent_compiles_of_one_spec_compile_once(model):
    tokenizer, vocab_size = model
    compiler = GrammarCompiler(tokenizer, vocab_size)
    params = StructuredOutputsParams(json=SCHEMA)
    results, barrier = [], threading.Barrier(4)

    def compile_it():
        barrier.wait()
        results.append(compiler.compile(params))

    threads = [threading.Thread(target=compile_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)


def test_padded_model_vocab_never_allows_tokens_past_the_tokenizer(model):
    tokenizer, vocab_size = model
    padded = vocab_size + 40
    compiler = GrammarCompiler(tokenizer, padded)
    bitmask = allocate_bitmask(1, padded)
    for kind in ("json_object", "choice"):
        GrammarMatcher(compiler.compile(CASES[kind])).fill_bitmask(bitmask, 0)
        assert not allowed(bitmask, 0, padded)[len(tokenizer) :].any()
    logits = torch.zeros(1, padded + 20)  # logits wider still: the columns past the bitmask go too
    apply_bitmask(logits, bitmask)
    assert torch.equal(torch.isfinite(logits[0, :padded]), allowed(bitmask, 0, padded))
    assert torch.isinf(logits[0, padded:]).all()


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    out = logits.clone()
    for row in rows:
        for token in range(logits.shape[1]):
            word = token // 32
            if word >= bitmask.shape[1] or not (int(bitmask[row, word]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows_index", [None, [1, 3], []])
@pytest.mark.parametrize("width", [100, 96, 130])  # bitmask of 100 tokens (4 words): narrower, exact, wider
def test_apply_bitmask_masks_exactly_the_disallowed_tokens(dtype, rows_index, width):
    gen = torch.Generator().manual_seed(width)
    bitmask = allocate_bitmask(4, 100)
    bitmask[:3] = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    bitmask[2, 1] = 0  # a word with nothing allowed; row 3 allows everything
    logits = torch.randn(4, width, generator=gen).to(dtype)
    expected = reference_apply(logits, bitmask, range(4) if rows_index is None else rows_index)
    for apply in ("public", "torch"):
        got = logits.clone()
        if apply == "public":
            apply_bitmask(got, bitmask, rows_index)
        else:  # the path of logits on other devices, checked here on CPU
            index = None if rows_index is None else torch.tensor(rows_index, dtype=torch.long)
            if index is None or index.numel():
                _apply_bitmask_torch(got, bitmask, index, min(width, 128))
                if width > 128:
                    got[slice(None) if index is None else index, 128:] = float("-inf")
        assert torch.equal(got, expected), apply


def test_apply_bitmask_on_a_strided_view_of_logits():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 2), dtype=torch.int32, generator=gen)
    base = torch.randn(6, 64, generator=gen)
    view = base[::2]  # every other row: the kernel follows the row stride
    expected = reference_apply(view, bitmask, range(3))
    apply_bitmask(view, bitmask)
    assert torch.equal(base[::2], expected)
