"""What a request asks of its logits before a token is picked: repetition, presence and frequency
penalties, logit bias, allowed and banned tokens, and the stop tokens held back until
``min_tokens``. Each applies to the whole batch at once, on the rows that ask for it: a batch
whose requests ask for none of them is not touched.

Order, as vLLM's: the repetition penalty, then frequency and presence, then biases and bans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from distserve.core.sampling_params import SamplingParams


class LogitsRow(Protocol):
    """What the processors read of a row (a ``SeqInput``): its params, which output token it
    samples, and for penalties and multi-token bad words the request's tokens so far, prompt first."""

    sampling_params: SamplingParams
    output_index: int
    token_history: list[int] | None
    token_bitmask: torch.Tensor | None


def _split_history(row: LogitsRow) -> tuple[list[int], list[int]]:
    """(prompt tokens, output tokens) of a row's history."""
    history = row.token_history or []
    cut = len(history) - row.output_index
    return history[:cut], history[cut:]


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """``logits [rows, vocab]`` as the rows' params shape them; a new tensor when anything applies."""
    shaped = [i for i, row in enumerate(rows) if row.sampling_params.shapes_logits]
    if not shaped:
        return logits
    logits = logits.clone()
    penalized = [i for i in shaped if rows[i].sampling_params.penalized]
    if penalized:
        _apply_penalties(logits, penalized, rows)
    _apply_bias_and_bans(logits, shaped, rows)
    return logits


def _apply_penalties(logits: torch.Tensor, indices: list[int], rows: Sequence[LogitsRow]) -> None:
    device, vocab = logits.device, logits.shape[-1]
    index = torch.tensor(indices, device=device)
    sub = logits[index]
    prompts, outputs = zip(*(_split_history(rows[i]) for i in indices))
    # counts[r, t]: how often row r generated token t (one scatter for the whole batch)
    counts = torch.zeros_like(sub)
    row_ids = torch.tensor([r for r, out in enumerate(outputs) for _ in out], dtype=torch.long, device=device)
    if len(row_ids):
        tokens = torch.tensor([t for out in outputs for t in out], dtype=torch.long, device=device)
        keep = tokens < vocab
        counts.index_put_(
            (row_ids[keep], tokens[keep]), torch.ones_like(tokens[keep], dtype=sub.dtype), accumulate=True
        )
    params = [rows[i].sampling_params for i in indices]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype, device=device)[:, None]
    if (repetition != 1.0).any():
        seen = counts > 0  # the repetition penalty also counts the prompt's tokens
        prompt_rows, prompt_tokens = [], []
        for r, prompt in enumerate(prompts):
            prompt_rows += [r] * len(prompt)
            prompt_tokens += prompt
        if prompt_tokens:
            tokens = torch.tensor(prompt_tokens, dtype=torch.long, device=device)
            keep = tokens < vocab
            seen[torch.tensor(prompt_rows, device=device)[keep], tokens[keep]] = True
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=device)[:, None]
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    logits[index] = sub


def _apply_bias_and_bans(logits: torch.Tensor, indices: list[int], rows: Sequence[LogitsRow]) -> None:
    """Logit bias added, banned tokens (bad words, stop tokens before ``min_tokens``) and tokens
    outside ``allowed_token_ids`` set to -inf: gathered as (row, token) lists, applied at once."""
    device, vocab = logits.device, logits.shape[-1]
    bias_rows, bias_tokens, bias_values = [], [], []
    ban_rows, ban_tokens = [], []
    allowed_rows, allowed_tokens = [], []
    for i in indices:
        row = rows[i]
        params = row.sampling_params
        if params.logit_bias:
            for token, value in params.logit_bias.items():
                bias_rows.append(i)
                bias_tokens.append(token)
                bias_values.append(value)
        if row.output_index < params.min_tokens:
            ban_tokens += params.all_stop_token_ids
            ban_rows += [i] * len(params.all_stop_token_ids)
        for word in params.bad_words_token_ids:
            # A word's last token is banned where the tokens before it were just generated.
            prefix = list(word[:-1])
            history = row.token_history or []
            if not prefix or history[len(history) - len(prefix) :] == prefix:
                ban_rows.append(i)
                ban_tokens.append(word[-1])
        if params.allowed_token_ids is not None:
            allowed_rows += [i] * len(params.allowed_token_ids)
            allowed_tokens += params.allowed_token_ids
    if bias_rows:
        tokens = torch.tensor(bias_tokens, dtype=torch.long, device=device)
        keep = tokens < vocab
        values = torch.tensor(bias_values, dtype=logits.dtype, device=device)[keep]
        logits.index_put_((torch.tensor(bias_rows, device=device)[keep], tokens[keep]), values, accumulate=True)
    if allowed_rows:
        rows_t = torch.tensor(sorted(set(allowed_rows)), device=device)
        allowed = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        tokens = torch.tensor(allowed_tokens, dtype=torch.long, device=device)
        keep = tokens < vocab
        allowed[torch.tensor(allowed_rows, device=device)[keep], tokens[keep]] = True
        logits[rows_t] = logits[rows_t].masked_fill(~allowed[rows_t], float("-inf"))
    if ban_rows:
        tokens = torch.tensor(ban_tokens, dtype=torch.long, device=device)
        keep = tokens < vocab
        logits[torch.tensor(ban_rows, device=device)[keep], tokens[keep]] = float("-inf")
