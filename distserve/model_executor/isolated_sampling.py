"""A step's sampling in which one request's fault stays its own.

The sampler works on the whole batch at once, so a row it cannot sample (its logits processors,
bitmask or draw raise on its values) would cost every request of the batch its token, and the
instance its step loop. Here a sequence whose rows fail is left out and named in ``faults`` (by
its index in the batch), and the others get the tokens they would have had without it: a row's
token does not depend on the rows beside it (greedy: its argmax; seeded: its own generator).
Rows whose logits hold NaN or infinity fail before sampling (the draw would still pick some
token, at random). A batch that raises is sampled again one sequence at a time to find which
failed: that costs only a step that fails. The forward pass is not guarded here: when the model
itself fails, the instance has failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from distserve.core.errors import RequestFault
from distserve.core.outputs import TokenLogprobs
from distserve.model_executor.logprobs import split_prompt_rows
from distserve.model_executor.sampler import Sampler, SamplerOutput, fan_out_samples

if TYPE_CHECKING:
    from distserve.model_executor.model_runner import BatchInput, SeqInput

logger = logging.getLogger(__name__)

FAILED_TOKEN = -1  # in place of each token a failed sequence would have sampled


@dataclass
class SampledStep:
    token_ids: list[int]  # one per sampled row (a request of n samples has n at its prompt's end)
    logprobs: list[TokenLogprobs | None] | None = None  # per sampled row, where its request asks
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None  # per sequence of the batch
    faults: dict[int, RequestFault] = field(default_factory=dict)  # by index in the batch
    beam_candidates: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # by index in the batch


def sample_step(sampler: Sampler, logits: torch.Tensor, batch: BatchInput) -> SampledStep:
    """Tokens (and logprobs) of ``batch`` from the last stage's ``logits``, a row per sequence that
    samples, or every new token's rows for those that want prompt logprobs."""
    faults: dict[int, RequestFault] = {}
    prompt_logprobs = None
    if batch.is_prefill and any(s.wants_prompt_logprobs for s in batch.seqs):
        logits, prompt_logprobs = split_prompt_rows(logits, batch.seqs, faults)
    sampling = [i for i, s in enumerate(batch.seqs) if s.sample]  # the batch index of each row
    # A sum in float32 is finite when every entry is: one pass, and no overflow of float16 rows.
    finite = logits.sum(dim=-1, dtype=torch.float32).isfinite()
    if not bool(finite.all()):
        for row in (~finite).nonzero().flatten().tolist():
            faults[sampling[row]] = RequestFault("its logits hold NaN or infinity: there is nothing to sample from")
    healthy = [row for row, i in enumerate(sampling) if i not in faults]
    seqs = [batch.seqs[sampling[row]] for row in healthy]
    beams = beam_candidates(logits, [(row, sampling[row], seqs[j].beam_candidates) for j, row in enumerate(healthy)])
    try:
        sampled = _sample(sampler, logits if not faults else logits[healthy], seqs)
    except Exception:
        logger.warning("sampling a batch of %d sequences failed: sampling each alone", len(seqs))
        rows = _sample_each(sampler, logits, healthy, seqs, sampling, faults)
    else:
        if not faults:
            return SampledStep(sampled.token_ids, sampled.logprobs, prompt_logprobs, beam_candidates=beams)
        rows = dict(zip(healthy, _split(sampled, seqs)))
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for row, i in enumerate(sampling):
        count = 1 + len(batch.seqs[i].sibling_params or ())
        tokens, row_logprobs = rows.get(row, ([FAILED_TOKEN] * count, [None] * count))
        token_ids += tokens
        logprobs += row_logprobs
    return SampledStep(token_ids, logprobs if any(logprobs) else None, prompt_logprobs, faults, beams)


def beam_candidates(logits: torch.Tensor, rows: list[tuple[int, int, int]]) -> dict[int, tuple[list[int], list[float]]]:
    """For each (row, batch index, count) of a beam that asks for ``count`` candidates: its ``count``
    likeliest tokens and their log-softmax in float32, as transformers' beam search scores them
    (of the model's own logits), by batch index."""
    wanted = [(row, i, count) for row, i, count in rows if count]
    if not wanted:
        return {}
    index = torch.tensor([row for row, _, _ in wanted], device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    values, ids = logprobs.topk(max(count for _, _, count in wanted), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return {i: (ids[r][:count], values[r][:count]) for r, (_, i, count) in enumerate(wanted)}


Row = tuple[list[int], list[TokenLogprobs | None]]  # a row's tokens (several at a prompt's end) and their logprobs


def _sample(sampler: Sampler, logits: torch.Tensor, seqs: list[SeqInput]) -> SamplerOutput:
    return sampler.sample(*fan_out_samples(logits, seqs))


def _split(sampled: SamplerOutput, seqs: list[SeqInput]) -> list[Row]:
    """``sampled``'s tokens and logprobs, by sequence."""
    logprobs = sampled.logprobs or [None] * len(sampled.token_ids)
    rows, start = [], 0
    for seq in seqs:
        end = start + 1 + len(seq.sibling_params or ())
        rows.append((sampled.token_ids[start:end], logprobs[start:end]))
        start = end
    return rows


def _sample_each(
    sampler: Sampler,
    logits: torch.Tensor,
    healthy: list[int],
    seqs: list[SeqInput],
    sampling: list[int],
    faults: dict[int, RequestFault],
) -> dict[int, Row]:
    """The ``healthy`` rows (of ``seqs``) sampled one at a time, by row; one that raises is added
    to ``faults`` under its batch index (``sampling[row]``)."""
    rows = {}
    for row, seq in zip(healthy, seqs):
        try:
            rows[row] = _split(_sample(sampler, logits[row : row + 1], [seq]), [seq])[0]
        except Exception as e:
            logger.exception("sampling the sequence at %d of the batch failed", sampling[row])
            faults[sampling[row]] = RequestFault.of("sampling", e)
    return rows
