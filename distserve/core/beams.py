"""A beam search's state between steps, as plain data: its finished hypotheses, and what a decode
instance needs of it to go on (``Handover.beams``). The search itself is the engine's
(``distserve.engine.beam_search``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distserve.core.sampling_params import SamplingParams


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (the stop token included), their summed logprob and its
    score, ``cumulative_logprob / len(token_ids) ** length_penalty`` (in float32, as transformers')."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (a stop token ended it) or "length"


@dataclass
class BeamState:
    """The running beams' cumulative logprobs (in the order of the hand-over's carrier and its
    siblings), the hypotheses finished so far, best first, and whether a running beam may still
    beat them."""

    scores: list[float]
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, for ``LLM.beam_search``: ``beam_width`` beams of up to
    ``max_tokens`` tokens, all of them returned; ``early_stopping`` as transformers' (True, False or
    "never"). ``temperature`` is taken and ignored, as vLLM's beam search scores beams by the
    model's own logprobs."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width, beam_width=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
            temperature=self.temperature, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )  # fmt: skip


@dataclass
class BeamSearchSequence:
    """One of a beam search's results, as vLLM's: prompt and output tokens, the output's text."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob over the output's length to the length_penalty
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """A prompt's beam search results, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]
