"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p and per-request seeds.

Seeded requests draw their noise from a generator keyed by (seed, output position), so a
request's samples do not depend on what it is batched with or on being preempted and recomputed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from distserve.core.outputs import TokenLogprobs
from distserve.core.sampling_params import SamplingParams
from distserve.model_executor.logits_processors import LogitsRow, apply_logits_processors
from distserve.model_executor.logprobs import token_logprobs
from distserve.model_executor.token_bitmask import apply_bitmask

if TYPE_CHECKING:
    from distserve.model_executor.model_runner import SeqInput


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None] | None = None  # per row, for the rows whose request asks


def fan_out_samples(logits: torch.Tensor, rows: list[SeqInput]) -> tuple[torch.Tensor, list[SeqInput]]:
    """The rows to sample: each sequence's, and after the prompt of a request of n samples that
    row again for each of its other samples, with their own params (seeds)."""
    if not any(row.sibling_params for row in rows):
        return logits, rows
    index, fanned = [], []
    for i, row in enumerate(rows):
        samples = [row, *(dataclasses.replace(row, sampling_params=p) for p in row.sibling_params or ())]
        index += [i] * len(samples)
        fanned += samples
    return logits[torch.tensor(index, device=logits.device)], fanned


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator: torch.Generator | None = None
        self.seed = seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
        """Pick one token per row of ``logits [batch, vocab]``; ``steps[i]`` is row i's output position."""
        return self._select(logits.float(), params, steps).tolist()

    def sample(self, logits: torch.Tensor, rows: list[LogitsRow]) -> SamplerOutput:
        """One token per row, after the logits processors its request asks for, with the logprobs
        it asks for (of the model's logits as they came)."""
        params = [row.sampling_params for row in rows]
        shaped = apply_logits_processors(logits.float(), rows)
        constrained = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
        if constrained:
            if shaped is logits:  # the raw logits stay as they are, for logprobs
                shaped = shaped.clone()
            bitmask = torch.stack([rows[i].token_bitmask for i in constrained])
            part = shaped[constrained]
            apply_bitmask(part, bitmask)
            shaped[constrained] = part
        tokens = self._select(shaped, params, [row.output_index for row in rows])
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return SamplerOutput(tokens.tolist())
        index = torch.tensor(wanted, device=logits.device)
        found = token_logprobs(logits[index], tokens[index], [params[i].logprobs for i in wanted])
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        for i, entry in zip(wanted, found):
            logprobs[i] = entry
        return SamplerOutput(tokens.tolist(), logprobs)

    def _select(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == len(params):  # no argmax, and no copy of the rows, to throw away
            return self._sample(logits, params, steps)
        tokens = logits.argmax(dim=-1)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample(logits[rows], [params[i] for i in random_rows], [steps[i] for i in random_rows])
            tokens[rows] = sampled
        return tokens

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        logits = logits / temperature[:, None]
        if any(p.top_k or p.top_p < 1.0 for p in params):
            weights, ids = self._filtered(logits, params)
        else:  # nothing to cut: no sort of the vocabulary (softmax's exponentials are torch's fastest on CPU)
            weights, ids = logits.softmax(dim=-1), None
        if any(p.min_p > 0.0 for p in params):
            # Tokens less likely than min_p times the likeliest go (after temperature, as vLLM).
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=weights.dtype)
            weights = weights.masked_fill(weights < min_p[:, None] * weights.amax(dim=-1, keepdim=True), 0.0)
        uniform = torch.empty((len(params), 1), device=device, dtype=weights.dtype)
        for i, (p, step) in enumerate(zip(params, steps)):
            uniform[i].uniform_(generator=self._generator(p, step, device))
        choice = draw(weights, uniform)
        return choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)

    @staticmethod
    def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's probabilities after top-k and top-p, in descending order, and their token ids."""
        device, vocab = logits.device, logits.shape[-1]
        ks = [min(p.top_k or vocab, vocab) for p in params]
        # Rows whose top-k keeps every token take top-p of the whole distribution, also where only
        # the likeliest tokens are ordered: their normalizer is the whole row's.
        whole = [k == vocab for k in ks]
        log_total = logits.logsumexp(dim=-1) if any(whole) else None
        sorted_logits, sorted_ids = _ordered(logits, params, ks, log_total)
        # One order serves both filters: top-k cuts by rank, top-p by cumulative probability.
        ranks = torch.arange(sorted_logits.shape[-1], device=device)[None, :]
        drop = ranks >= torch.tensor(ks, device=device)[:, None]
        kept = sorted_logits.masked_fill(drop, float("-inf"))
        log_norm = kept.logsumexp(dim=-1)
        if log_total is not None:
            log_norm = torch.where(torch.tensor(whole, device=device), log_total, log_norm)
        probs = (kept - log_norm[:, None]).exp()
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
        cumulative = probs.cumsum(dim=-1)
        drop |= (cumulative - probs) >= top_p[:, None]  # keep the smallest prefix reaching top_p
        return sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1), sorted_ids

    def _generator(self, params: SamplingParams, step: int, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            if self.generator is None or self.generator.device != device:
                self.generator = torch.Generator(device=device).manual_seed(self.seed)
            return self.generator
        return torch.Generator(device=device).manual_seed(hash((params.seed, step)) & 0x7FFF_FFFF_FFFF_FFFF)


# Vocabulary entries summed together before a draw looks among them (``draw``).
DRAW_CHUNK = 256


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's draw from its weights ``[rows, vocab]`` (not negative, not normalized) by the
    inverse transform: the first entry whose cumulative weight passes ``uniform`` ``[rows, 1]``
    (in [0, 1)) times the row's total. A draw per vocabulary entry (the exponential race) took 10
    ms for 16 rows of 32,000 on one CPU thread; a cumulative sum of the rows, one element after
    another, 1.5 ms for 32. So the entries are summed in chunks (vectorised), the chunk is found
    in the chunks' running totals and the entry in that chunk's (with softmax, 1.6 against 3.0 ms
    for 32 rows). An entry of weight 0 is never drawn: the target stays below the total (of the
    rows, then of the chunk), and the first cumulative weight past it rose at its entry. NaN
    weights (NaN logits from a model) still give an entry of the vocabulary."""
    rows, vocab = weights.shape
    pad = -vocab % DRAW_CHUNK
    chunks = (F.pad(weights, (0, pad)) if pad else weights).view(rows, (vocab + pad) // DRAW_CHUNK, DRAW_CHUNK)
    bounds = chunks.sum(dim=-1).cumsum(dim=-1)  # [rows, chunks]: each chunk's running total
    total = bounds[:, -1:]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(bounds, target, right=True).clamp_(max=bounds.shape[-1] - 1)  # [rows, 1]
    before = bounds.gather(1, (chunk - 1).clamp(min=0)).masked_fill_(chunk == 0, 0.0)
    inside = chunks.gather(1, chunk[:, :, None].expand(-1, -1, DRAW_CHUNK)).squeeze(1).cumsum(dim=-1)
    end = inside[:, -1:]
    rest = torch.minimum((target - before).clamp_(min=0.0), torch.nextafter(end, torch.zeros_like(end)))
    entry = torch.searchsorted(inside, rest, right=True).clamp_(max=DRAW_CHUNK - 1)
    return (chunk * DRAW_CHUNK + entry).squeeze(1).clamp_(max=vocab - 1)


# The likeliest tokens a row's top-k and top-p are first looked for among: a partial sort of them
# took 4.5 ms for 16 rows of 32,000 on one CPU thread, a full sort 35 ms.
TOP_CANDIDATES = 1024


def _ordered(
    logits: torch.Tensor, params: list[SamplingParams], ks: list[int], log_total: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logits in descending order with their token ids: only the ``TOP_CANDIDATES``
    likeliest where they hold every token each row's filters can keep (its top-k ``ks`` within
    them, or, with a top-k of the whole vocabulary, its top-p mass of the whole row, whose
    logsumexp ``log_total`` is), else the whole vocabulary."""
    vocab = logits.shape[-1]
    if vocab > TOP_CANDIDATES and all(k <= TOP_CANDIDATES or k == vocab for k in ks):
        top_logits, top_ids = logits.topk(TOP_CANDIDATES, dim=-1)
        wide = [i for i, k in enumerate(ks) if k == vocab]
        if not wide:
            return top_logits, top_ids
        rows = torch.tensor(wide, device=logits.device)
        assert log_total is not None
        mass = (top_logits[rows].logsumexp(dim=-1) - log_total[rows]).exp().tolist()
        if all(m >= params[i].top_p for i, m in zip(wide, mass)):
            return top_logits, top_ids
    return logits.sort(dim=-1, descending=True)
