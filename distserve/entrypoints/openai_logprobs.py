"""Logprobs in vLLM's shapes: pure functions of the tokenizer and the engine's ``TokenLogprobs``. A
token is named by decoding it alone (``tokenizer.decode([id])``, so a piece of a UTF-8 character is
U+FFFD), and -inf is written -9999.0, which JSON can carry."""

from __future__ import annotations

from typing import Any

from distserve.core.outputs import TokenLogprobs

_MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def token_text(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text decoded alone (a SentencePiece word-start token keeps
    its leading space, which decoding it alone drops), or ``token_id:<id>``."""
    if as_id:
        return f"token_id:{token_id}"
    text = tokenizer.decode([token_id]) or ""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
        text = " " * (len(piece) - len(piece.lstrip("\u2581"))) + text
    return text


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    num_top: int,
    text_offset: int = 0,
    as_ids: bool = False,
) -> dict[str, list]:
    """/v1/completions' ``logprobs`` of the tokens: for each, its text, its logprob and a map of the
    texts of it and the ``num_top`` likeliest tokens to their logprobs (None for a position without
    logprobs: the prompt's first), and ``text_offset``, where its text begins (``text_offset`` for
    the first, then each token's text length added, as vLLM counts)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, logprobs):
        token = token_text(tokenizer, token_id, as_ids)
        out["tokens"].append(token)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_logprob(entry.logprob))
        # The token first, then the likeliest (itself once if among them); tokens of the same
        # text share one key, the later one's value, as in vLLM.
        by_id = {token_id: entry.logprob}
        for top_id, value in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top]):
            by_id.setdefault(top_id, value)
        out["top_logprobs"].append({token_text(tokenizer, t, as_ids): _logprob(v) for t, v in by_id.items()})
    return out


def next_text_offset(logprobs: dict[str, list], text_offset: int) -> int:
    """Where the text of the token after ``logprobs``' last begins."""
    if not logprobs["tokens"]:
        return text_offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _chat_token(tokenizer, token_id: int, value: float, as_ids: bool) -> dict[str, Any]:
    token = token_text(tokenizer, token_id, as_ids)
    return {"token": token, "logprob": _logprob(value), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(tokenizer, logprobs: list[TokenLogprobs], num_top: int, as_ids: bool = False) -> dict[str, list]:
    """/v1/chat/completions' ``logprobs``: for each token its text, logprob, UTF-8 bytes (of the text,
    as vLLM gives them) and the ``num_top`` likeliest tokens, likeliest first."""
    content = []
    for entry in logprobs:
        item = _chat_token(tokenizer, entry.token_id, entry.logprob, as_ids)
        item["top_logprobs"] = [
            _chat_token(tokenizer, t, v, as_ids)
            for t, v in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])
        ]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(tokenizer, logprobs: list[TokenLogprobs | None]) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or a map of token id (a string,
    as JSON keys are) to ``{"logprob", "rank", "decoded_token"}``, for the prompt's token and then the
    likeliest."""
    out: list[dict[str, dict] | None] = []
    for entry in logprobs:
        if entry is None:
            out.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank)]
        ranked += [(t, v, rank) for rank, (t, v) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), 1)]
        position: dict[str, dict] = {}
        for token_id, value, rank in ranked:
            position.setdefault(
                str(token_id),
                {"logprob": _logprob(value), "rank": rank, "decoded_token": token_text(tokenizer, token_id)},
            )
        out.append(position)
    return out
