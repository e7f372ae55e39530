"""Incremental detokenization and stop-string matching.

Decoding only a short window of ids each step keeps the cost per token constant. The window
starts a few tokens back, because a token's text can depend on its left neighbours (spaces,
multi-byte characters split over tokens); text ending in U+FFFD is held back until complete.
"""

from __future__ import annotations

from distserve.core.sequence import Sequence

# Prompt tokens kept as left context for the first output token.
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        seq.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0)
        seq.read_offset = seq.num_prompt_tokens

    def step(self, seq: Sequence) -> str:
        """Append the text of ``seq``'s newest token(s) to ``seq.output_text``; return what was added."""
        skip = seq.sampling_params.skip_special_tokens
        ids = seq.all_token_ids
        prefix = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if full.endswith("\ufffd"):  # an incomplete character: wait for the tokens that finish it
            return ""
        # Advance even when nothing printable came (special or unknown ids), so the window stays short.
        delta = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.output_text += delta
        return delta

    def text_of(self, prompt_token_ids: list[int], output_token_ids: list[int], skip_special_tokens: bool) -> str:
        """The whole text of ``output_token_ids`` after the prompt, as ``step`` adds it up (a beam
        search's hypotheses are detokenized once, at its end)."""
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        prefix = self.tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        full = self.tokenizer.decode(context + output_token_ids, skip_special_tokens=skip_special_tokens)
        return full[len(prefix) :]


def find_stop_string(seq: Sequence, delta: str) -> str | None:
    """If a stop string ends inside the newest ``delta``, cut ``seq.output_text`` there and return it."""
    params = seq.sampling_params
    text = seq.output_text
    for stop in params.stop:
        start = max(0, len(text) - len(delta) - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1:
            seq.output_text = text[: index + len(stop)] if params.include_stop_str_in_output else text[:index]
            return stop
    return None
