"""How long an instance's steps take for the tokens they run, learned from its own steps: a
least-squares line, seconds = fixed + per_token * tokens, over its recent steps (each step weighs
``DECAY`` times the one after it, so the last fifty or so count, and a change of load or machine
shows within them). A chunked-prefill scheduler asks it how many tokens fit a step that must stay
within the TPOT SLO of the requests decoding in it.
"""

from __future__ import annotations

from typing import NamedTuple

DECAY = 0.98
MIN_STEPS = 8  # steps seen before the line is trusted
# The steps must differ in size for a slope to be told from noise: decode steps alone (a token per
# running request) all cost about the same, and their spread says nothing of a chunk's cost.
MIN_TOKENS_SPREAD = 8.0  # tokens, the weighted standard deviation of the steps' sizes


class StepCost(NamedTuple):
    """A step-time line: ``fixed + per_token * tokens`` seconds a step."""

    fixed: float
    per_token: float

    def seconds(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens

    def tokens_within(self, seconds: float) -> float:
        """The tokens a step of ``seconds`` runs (negative when even an empty step takes longer)."""
        return (seconds - self.fixed) / self.per_token


class StepTimeModel:
    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self.num_steps = 0
        # Weighted sums of 1, tokens, seconds, tokens^2 and tokens * seconds over the steps seen.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._line: StepCost | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step ran ``num_tokens`` tokens (decode tokens and prompt chunks) in ``seconds``."""
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds
        self.num_steps += 1
        self._fit()

    def _fit(self) -> None:
        """Fit the line to the steps seen, if they differ enough in size to say its slope: on every
        step, so that the line of the last steps that differed stands however late it is asked for
        (a decode-only stretch alone would otherwise leave it unknown)."""
        if self.num_steps < MIN_STEPS:
            return
        mean_x, mean_y = self._x / self._w, self._y / self._w
        variance = self._xx / self._w - mean_x * mean_x
        if variance >= MIN_TOKENS_SPREAD**2:
            per_token = (self._xy / self._w - mean_x * mean_y) / variance
            if per_token > 0:  # else noise over steps that differ too little: the last line stands
                self._line = StepCost(max(0.0, mean_y - per_token * mean_x), per_token)

    def line(self) -> StepCost | None:
        """(fixed seconds per step, seconds per token), or None until enough steps of different
        sizes have been seen to tell them apart. While the recent steps are all of about one size
        (steps cut to fit an SLO are), the line fitted when they last differed stands."""
        return self._line

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step can run in ``seconds`` (0 when even an empty step takes longer);
        None while the line is unknown."""
        line = self.line()
        return None if line is None else max(0, int(line.tokens_within(seconds)))
