"""xgrammar against llguidance for structured outputs, on the same tokenizers: how long each takes
to read a tokenizer, to compile a JSON schema, any JSON object, a regex and a choice, to fill a
request's token bitmask and accept a token along a 200-token JSON document, and whether walks that
only ever pick allowed tokens end in text of the language asked for.

    python scripts/benchmarks/bench_grammar.py [--walks 20] [--repeats 5]

Two tokenizers: the built-in tiny model's (1024 tokens) and a 32000-token byte-level BPE trained
here in seconds on the Python standard library's sources (a realistic vocabulary size; no download).
The xgrammar and llguidance columns use the libraries directly, so the figures are their own;
the distserve column is distserve.engine.structured_output (xgrammar, with its JSON fix).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)"
CHOICE = ["positive", "negative", "neutral"]
GRAMMAR = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9]+
"""
KINDS = ("json", "json_object", "regex", "choice", "grammar")
CLOSERS = set('"}])')  # past the walks' soft limit, tokens with these end strings and nestings,
OPENERS = set("{[(")  # and tokens with these are avoided


def json_document(count_tokens: Callable[[str], int], at_least: int = 200) -> str:
    """A document of SCHEMA whose tokens number at least ``at_least``: scores are added until so."""
    doc = {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "admin",
        "active": True,
        "tags": ["math", "engine", "notes"],
        "address": {"street": "12 St James Square", "city": "London", "zip": "10001"},
        "scores": [],
    }
    while count_tokens(json.dumps(doc)) < at_least:
        doc["scores"].append(round(1.5 + 0.37 * len(doc["scores"]), 2))
    return json.dumps(doc)


def invalid(kind: str, text: str | None) -> str:
    """Why ``text`` is not a sentence of the language ``kind`` asks for; empty if it is."""
    if text is None:
        return "no end after 400 tokens"
    try:
        if kind == "json":
            import jsonschema

            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "json_object":
            assert isinstance(json.loads(text), dict), "not an object"
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), "no match"
        elif kind == "choice":
            assert text in CHOICE, "not a choice"
        else:  # integer arithmetic (07 is 7)
            tree = ast.parse(re.sub(r"\b0+(?=\d)", "", text), mode="eval")
            allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
            assert all(isinstance(node, allowed) for node in ast.walk(tree)), "not arithmetic"
            assert text.strip() == text, "spaces around"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.threads = 2

    def compile(self, kind: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(SCHEMA))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}')
        if kind == "regex":
            return compiler.compile_regex(REGEX)
        if kind == "choice":
            return compiler.compile_regex("|".join(re.escape(c) for c in CHOICE))
        return compiler.compile_grammar(GRAMMAR)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def terminated(self, matcher) -> bool:
        return matcher.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)

    def compile(self, kind: str):
        """llguidance has no compiled object apart from a matcher: a fresh matcher is a compile, and
        a request's matcher is a deep copy of it (as vLLM's guidance backend does, minus the copy)."""
        if kind == "json":
            grammar = self.llg.grammar_from("json", json.dumps(SCHEMA))
        elif kind == "json_object":
            grammar = self.llg.grammar_from("json", '{"type": "object"}')
        elif kind == "regex":
            grammar = self.llg.grammar_from("regex", REGEX)
        elif kind == "choice":
            grammar = self.llg.grammar_from("choice", json.dumps(CHOICE))
        else:
            grammar = self.llg.grammar_from("grammar", GRAMMAR)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def terminated(self, matcher) -> bool:
        return matcher.is_stopped()


class Distserve:
    """distserve.engine.structured_output: xgrammar behind its API, JSON masks without raw control
    characters, no compile cache (max_cached=0) so compiles are timed cold."""

    name = "distserve"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        from distserve.engine.structured_output import GrammarCompiler, GrammarMatcher

        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids, max_cached=0, max_threads=2)
        self.matcher_class = GrammarMatcher

    def compile(self, kind: str):
        from distserve.core.sampling_params import StructuredOutputsParams

        spec = {"json": SCHEMA, "json_object": True, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR}[kind]
        return self.compiler.compile(StructuredOutputsParams(**{kind: spec}))

    def matcher(self, compiled):
        return self.matcher_class(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept(token)

    def terminated(self, matcher) -> bool:
        return matcher.is_terminated()


LIBRARIES = (Xgrammar, Llguidance, Distserve)


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def follow(lib, compiled, tokens: list[int], eos: int, vocab_size: int) -> tuple[list[float], list[float]]:
    """Fill and accept times (s) of each step along ``tokens`` then EOS, each checked to be allowed."""
    matcher = lib.matcher(compiled)
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    fills, accepts = [], []
    for token in [*tokens, eos]:
        start = time.perf_counter()
        lib.fill(matcher, bitmask)
        fills.append(time.perf_counter() - start)
        assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, f"{lib.name} masks token {token} of the document"
        start = time.perf_counter()
        ok = lib.accept(matcher, token)
        accepts.append(time.perf_counter() - start)
        assert ok, f"{lib.name} refused token {token} of the document"
    assert lib.terminated(matcher), f"{lib.name} is not terminated after the document and EOS"
    return fills, accepts


class TokenClasses:
    """Per-token flags the walks choose by, computed once per tokenizer (vocabulary-wide tensors)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        texts = [tokenizer.decode([t]) for t in range(len(tokenizer))] + [""] * (vocab_size - len(tokenizer))
        self.closes = torch.tensor([bool(CLOSERS & set(t)) for t in texts])
        self.opens = torch.tensor([bool(OPENERS & set(t)) for t in texts])
        self.visible = torch.tensor([bool(t.strip()) for t in texts])


def walk(lib, compiled, tokenizer, classes: TokenClasses, eos: int, vocab_size: int, rng, soft_limit: int = 48):
    """Text of a walk that only picks allowed tokens: EOS once allowed; past ``soft_limit`` tokens,
    one that closes a string or nesting if any is allowed, else one that opens none and is not
    whitespace; otherwise any allowed token but whitespace, if there is one. Random among those
    (the first when ``rng`` is None: the greedy walk). None if it has not ended after 400 tokens."""
    matcher = lib.matcher(compiled)
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    out: list[int] = []
    for step in range(400):
        lib.fill(matcher, bitmask)
        allowed = (((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab_size]).bool()
        if allowed[eos]:
            choice = eos
        else:
            prefs = [allowed & classes.closes, allowed & classes.visible & ~classes.opens] if step >= soft_limit else []
            prefs += [allowed & classes.visible, allowed]
            pool = next(p for p in prefs if p.any()).nonzero().flatten()
            choice = int(pool[0] if rng is None else pool[rng.randrange(len(pool))])
        assert lib.accept(matcher, choice), f"{lib.name} refused allowed token {choice}"
        if choice == eos:
            return tokenizer.decode(out)
        out.append(choice)
    return None


def train_bpe_32k():
    """A 32000-token byte-level BPE, trained on the standard library's sources (about 2 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from distserve.model_executor.tiny_models import BOS, EOS, PAD

    root = Path(sysconfig.get_paths()["stdlib"])

    def corpus():
        size = 0
        for path in sorted(root.glob("*.py")) + sorted(root.glob("json/*.py")) + sorted(root.glob("email/*.py")):
            text = path.read_text(errors="replace")
            size += len(text)
            yield text
            if size > 6_000_000:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def tiny_tokenizer():
    from distserve.core.config import ModelConfig
    from distserve.model_executor.model_loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(ModelConfig(model="tiny-llama")))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def bench_apply(vocab_size: int, rows: int, repeats: int) -> dict[str, float]:
    """Masking [rows, vocab] float32 logits in place: xgrammar's CPU kernel against an unpack in torch."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(rows, vocab_size, generator=gen)
    shifts = torch.arange(32, dtype=torch.int32)

    def unpack():
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, words * 32)[:, :vocab_size]
        logits.masked_fill_(bits == 0, float("-inf"))

    def kernel():
        xgr.apply_token_bitmask_inplace(logits, bitmask)

    kernel(), unpack()
    return {"xgrammar CPU kernel": median_s(kernel, repeats * 10), "torch unpack": median_s(unpack, repeats * 10)}


def measure(lib_class, tokenizer, doc_tokens: list[int], walks: int, repeats: int) -> tuple[dict[str, str], list[str]]:
    """One library's column of the table on one tokenizer, and a line per invalid walk."""
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    col: dict[str, str] = {}
    col["tokenizer info (ms)"] = ms(median_s(lambda: lib_class(tokenizer, vocab_size, [eos]), repeats))
    lib = lib_class(tokenizer, vocab_size, [eos])
    compiled = {}
    for kind in KINDS:
        col[f"compile {kind} (ms)"] = ms(median_s(lambda k=kind: lib.compile(k), repeats))
        compiled[kind] = lib.compile(kind)
    col["matcher from compiled (us)"] = us(median_s(lambda: lib.matcher(compiled["json"]), repeats * 20))
    # cold: the first request of a fresh compile; warm: later requests of it (median of the means)
    for label, grammar, runs in (("cold", lib.compile("json"), 1), ("warm", compiled["json"], repeats)):
        timed = [follow(lib, grammar, doc_tokens, eos, vocab_size) for _ in range(runs)]
        col[f"fill/token {label}, mean (us)"] = us(statistics.median(statistics.fmean(f) for f, _ in timed))
        col[f"fill/token {label}, p99 (us)"] = us(statistics.median(percentile(f, 0.99) for f, _ in timed))
        col[f"accept/token {label}, mean (us)"] = us(statistics.median(statistics.fmean(a) for _, a in timed))
    classes = TokenClasses(tokenizer, vocab_size)
    failures = []
    for kind in KINDS:
        rngs = [random.Random(seed) for seed in range(walks)] + [None]
        texts = [walk(lib, compiled[kind], tokenizer, classes, eos, vocab_size, rng) for rng in rngs]
        whys = [invalid(kind, text) for text in texts]
        col[f"walks valid: {kind}"] = f"{whys.count('')}/{len(texts)}"
        failures += [f"{lib.name} {kind}: {why} in {text!r:.90}" for why, text in zip(whys, texts) if why]
    return col, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=20, help="seeded random walks per language and library")
    parser.add_argument("--repeats", type=int, default=5, help="compiles timed per figure (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    start = time.perf_counter()
    tokenizers = {"tiny (1024)": tiny_tokenizer(), "bpe-32k (32000)": train_bpe_32k()}
    print(f"tokenizers ready in {time.perf_counter() - start:.1f} s\n")

    for tok_name, tokenizer in tokenizers.items():
        doc = json_document(lambda text, t=tokenizer: len(t.encode(text, add_special_tokens=False)))
        doc_tokens = tokenizer.encode(doc, add_special_tokens=False)
        columns = {lib.name: measure(lib, tokenizer, doc_tokens, args.walks, args.repeats) for lib in LIBRARIES}
        print(f"{tok_name}: JSON document of {len(doc_tokens)} tokens (+ EOS), {args.repeats} repeats (median)")
        print(f"  {'':<32}" + "".join(f"{name:>12}" for name in columns))
        for key in columns["xgrammar"][0]:
            print(f"  {key:<32}" + "".join(f"{col[key]:>12}" for col, _ in columns.values()))
        for _, failures in columns.values():
            for line in failures:
                print(f"  invalid walk, {line}")
        print()

    for vocab_size, batch in ((32000, 64), (128256, 64)):
        times = bench_apply(vocab_size, batch, args.repeats)
        figures = ", ".join(f"{name} {ms(seconds)} ms" for name, seconds in times.items())
        print(f"apply bitmask, {batch} x {vocab_size} float32 logits: {figures}")


if __name__ == "__main__":
    main()
