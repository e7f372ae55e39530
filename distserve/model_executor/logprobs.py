"""Logprobs a request asks for: of each sampled token and the top N at its position
(``SamplingParams.logprobs``), and of each prompt token (``prompt_logprobs``). They are the
log-softmax of the model's own logits, before penalties, biases, bans and temperature, as vLLM
returns them by default."""

from __future__ import annotations

import torch

from distserve.core.errors import RequestFault
from distserve.core.outputs import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """For each row of ``logits [rows, vocab]``: the logprob and rank of ``token_ids[row]`` and the
    ``num_top[row]`` likeliest tokens, computed for all rows in one pass."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    values, ranks_list, ids = chosen.tolist(), ranks.tolist(), token_ids.tolist()
    top_v = top_values.tolist() if k else None
    top_i = top_ids.tolist() if k else None
    return [
        TokenLogprobs(
            ids[r],
            values[r],
            ranks_list[r],
            top_i[r][: num_top[r]] if k else [],
            top_v[r][: num_top[r]] if k else [],
        )
        for r in range(len(ids))
    ]


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens that ``logits``' rows predict: row i's of ``next_token_ids[i]``
    (rows past the prompt's end, which predict output tokens, are left out by the caller)."""
    rows = len(next_token_ids)
    if rows == 0:
        return []
    targets = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)
    return token_logprobs(logits[:rows], targets, [num_top] * rows)


def split_prompt_rows(
    logits: torch.Tensor, seqs: list, faults: dict[int, RequestFault]
) -> tuple[torch.Tensor, list[list[TokenLogprobs] | None]]:
    """A prefill step's logits, with rows for every new token of the sequences that want prompt
    logprobs (``SeqInput.num_logit_rows``), as (one row per sampling sequence, each sequence's
    prompt logprobs or None). A chunk's rows predict the prompt tokens after it; the last row of
    the prompt predicts the first output token, and is the one sampled. A sequence whose prompt
    logprobs raise is added to ``faults`` (by its index in ``seqs``) and the others go on."""
    sample_rows: list[int] = []
    per_seq: list[list[TokenLogprobs] | None] = []
    row = 0
    for i, seq in enumerate(seqs):
        count = seq.num_logit_rows
        found = None
        if seq.wants_prompt_logprobs:
            history = seq.token_history
            num_prompt = len(history) - seq.output_index
            first_target = seq.start + 1
            targets = history[first_target : min(seq.start + count + 1, num_prompt)]
            try:
                found = prompt_logprobs(logits[row : row + count], targets, seq.sampling_params.prompt_logprobs)
            except Exception as e:
                faults[i] = RequestFault.of("prompt logprobs", e)
        per_seq.append(found)
        if seq.sample:
            sample_rows.append(row + count - 1)
        row += count
    index = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
    return logits.index_select(0, index), per_seq
