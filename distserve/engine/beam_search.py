"""Beam search in the engine: a request's k beams are sequences of the scheduler that share their
KV blocks copy on write, as the samples of a request of ``n`` do.

Every step each live beam runs its newest token; the worker returns the top ``num_candidates``
log-softmax values (float32) of its logits (``SeqInput.beam_candidates``) and ``BeamSearch.select``
keeps the best k unfinished continuations by cumulative logprob: a beam continued by one of them
keeps its sequence, a second continuation of the same beam is forked from it (sharing its blocks;
the first write into a shared block copies it), and a beam none continues is dropped (its blocks
freed). Continuations that end (a stop token, or the length) become finished hypotheses, scored by
their cumulative logprob over their length to the ``length_penalty``. All of it follows
transformers' ``_beam_search`` step for step, in the same float32 arithmetic: the top
``max(2, 1 + number of stop tokens) * k`` candidates, hypotheses only from the k best of them,
its early-stop heuristic and ``early_stopping`` True / False / "never". The request returns its
``n`` best hypotheses at the end.

A step selects only once every live beam has reported its candidates while running: a beam that
reported and waits for its siblings (preempted and recomputed, or swapped in, a step after them)
runs its newest token again, which writes the same KV.
"""

from __future__ import annotations

import numpy as np

from distserve.core.beams import BeamState, Hypothesis
from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence, SequenceStatus


class BeamSearch:
    """One request's beams (``beams``, best first, shared with each beam's ``Sequence.beams``) and
    its finished hypotheses."""

    def __init__(
        self,
        params: SamplingParams,
        num_prompt_tokens: int,
        max_model_len: int,
        beams: list[Sequence],
        state: BeamState | None = None,
    ) -> None:
        self.params = params
        self.width = params.beam_width
        self.num_candidates = params.num_beam_candidates
        self.stop_token_ids = frozenset(params.all_stop_token_ids)
        # The most output tokens a beam may have: transformers' max_length less the prompt.
        self.max_new_tokens = min(params.max_tokens, max_model_len - num_prompt_tokens)
        self.beams = beams
        state = state or BeamState([0.0] * len(beams), [])
        self.scores = [np.float32(s) for s in state.scores]
        self.finished = list(state.finished)
        self.improvable = state.improvable
        self.reports: dict[int, tuple[list[int], list[float]]] = {}  # by seq_id: (token ids, logprobs)
        self._next_index = max(b.sample_index for b in beams) + 1
        for beam in beams:
            beam.beams = self.beams

    @property
    def state(self) -> BeamState:
        return BeamState([float(s) for s in self.scores], list(self.finished), self.improvable)

    def report(self, seq: Sequence, token_ids: list[int], logprobs: list[float]) -> bool:
        """``seq``'s candidates for its next token; whether every live beam has reported while
        running, so that the step can select."""
        self.reports[seq.seq_id] = (token_ids, logprobs)
        return all(b.seq_id in self.reports and b.status is SequenceStatus.RUNNING for b in self.beams)

    def next_index(self) -> int:
        """A sample index for a forked beam, unique in the request (its key among the engine's)."""
        self._next_index += 1
        return self._next_index - 1

    def select(self) -> tuple[list[tuple[Sequence, int]], bool]:
        """One step of transformers' beam search over the reported candidates: the running beams of
        the next step as (parent beam, token), best first, and whether the search is over. The
        finished hypotheses are updated."""
        scores, parents, tokens = [], [], []
        for b, beam in enumerate(self.beams):
            ids, logprobs = self.reports[beam.seq_id]
            scores.append(np.asarray(logprobs, dtype=np.float32) + self.scores[b])
            parents += [b] * len(ids)
            tokens += ids
        self.reports.clear()
        flat = np.concatenate(scores)
        # Stable on ties, in beam-major order as transformers' topk over the flattened beams x vocab.
        top = np.argsort(-flat, kind="stable")[: self.num_candidates]
        num_generated = self.beams[0].num_output_tokens + 1  # each candidate's output length
        at_length = num_generated >= self.max_new_tokens
        ends = [at_length or tokens[c] in self.stop_token_ids for c in top]
        running = [c for c, end in zip(top, ends) if not end][: self.width]
        self._add_finished(top, ends, flat, parents, tokens, num_generated, at_length)
        selected = [(self.beams[parents[c]], tokens[c]) for c in running]
        self.scores = [flat[c] for c in running]
        done = not running or self._done(num_generated)
        return selected, done

    def _add_finished(self, top, ends, flat, parents, tokens, num_generated: int, at_length: bool) -> None:
        """The ends among the ``width`` best candidates join the hypotheses, which keep the best
        ``width`` (the rest of the candidates only back the running beams, as in transformers)."""
        new = []
        for c, end in zip(top[: self.width], ends[: self.width]):
            if not end:
                continue
            beam = self.beams[parents[c]]
            score = flat[c] / np.float32(num_generated**self.params.length_penalty)
            reason = "length" if at_length and tokens[c] not in self.stop_token_ids else "stop"
            new.append(Hypothesis([*beam.output_token_ids, tokens[c]], float(flat[c]), float(score), reason))
        if new:
            merged = self.finished + new
            order = np.argsort(-np.asarray([h.score for h in merged], dtype=np.float32), kind="stable")
            self.finished = [merged[i] for i in order[: self.width]]

    def _done(self, num_generated: int) -> bool:
        """transformers' stopping rule after a step: no running beam can beat the worst of a full
        set of hypotheses (by its heuristic), or ``early_stopping`` is True and the set is full."""
        full = len(self.finished) == self.width
        if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = num_generated
        if full:
            best_running = self.scores[0] / np.float32(best_length**self.params.length_penalty)
            self.improvable = self.improvable and bool(best_running > np.float32(self.finished[-1].score))
        return not self.improvable or (self.params.early_stopping is True and full)

    def best(self) -> list[Hypothesis]:
        """The request's outputs: its ``n`` best hypotheses, best first."""
        return self.finished[: self.params.n]
