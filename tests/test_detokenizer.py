"""Incremental detokenization gives the same text as decoding everything at once."""

import random

from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence
from distserve.engine.detokenizer import Detokenizer
from distserve.model_executor.tiny_models import train_tokenizer

TEXTS = ["héllo wörld", " — 你好, ", "the cache block", " naïve café ☕ ", "12345", "\n  spaced  out\n"]


def _stream(detok: Detokenizer, prompt: list[int], outputs: list[int]) -> tuple[Sequence, list[str]]:
    seq = Sequence(prompt, SamplingParams())
    detok.start(seq)
    deltas = []
    for token in outputs:
        seq.append_token(token)
        deltas.append(detok.step(seq))
    return seq, deltas


def test_multibyte_characters_split_over_tokens():
    tokenizer = train_tokenizer()
    detok = Detokenizer(tokenizer)
    rng = random.Random(0)
    prompt = tokenizer.encode("A prompt.")
    # The byte-level vocabulary splits these characters over several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokenizer.encode("你好☕"))
    for _ in range(30):
        text = "".join(rng.choice(TEXTS) for _ in range(6))
        outputs = tokenizer.encode(text)
        seq, deltas = _stream(detok, prompt, outputs)
        assert seq.output_text == text == "".join(deltas)
        assert "\ufffd" not in "".join(deltas)


def test_unknown_ids_do_not_grow_the_window():
    tokenizer = train_tokenizer()
    detok = Detokenizer(tokenizer)
    unknown = [len(tokenizer) + 100] * 50  # ids past the vocabulary, as a dummy preset may emit
    seq, deltas = _stream(detok, tokenizer.encode("x"), unknown)
    assert "".join(deltas) == ""
    assert seq.read_offset - seq.prefix_offset <= 1
