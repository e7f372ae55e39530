"""Workloads: request lengths (synthetic, ShareGPT, traces) and arrival times, shared by the
serving benchmark (sent to a real cluster) and the placement simulator."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("fixed", "uniform", "lognormal")


@dataclass
class RequestSpec:
    prompt_len: int
    output_len: int


@dataclass
class LengthDistribution:
    """A distribution of token counts. ``fixed`` uses ``mean``; ``uniform`` draws integers in
    [``low``, ``high``]; ``lognormal`` has mean ``mean`` and shape ``sigma`` (of the underlying
    normal). Samples are rounded and clipped to [``min``, ``max``]."""

    kind: str = "fixed"
    mean: float | None = None
    low: int | None = None
    high: int | None = None
    sigma: float | None = None
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind in ("fixed", "lognormal") and (self.mean is None or not 0 < self.mean < math.inf):
            raise ValueError(f"mean must be a positive finite number for a {self.kind} distribution, got {self.mean}")
        if self.kind == "uniform":
            if self.low is None or self.low < 0:
                raise ValueError(f"low must be a non-negative integer for a uniform distribution, got {self.low}")
            if self.high is None or self.high < self.low:
                raise ValueError(f"high must be an integer >= low ({self.low}), got {self.high}")
        if self.kind == "lognormal" and (self.sigma is None or not 0 <= self.sigma < math.inf):
            raise ValueError(f"sigma must be a non-negative finite number for lognormal, got {self.sigma}")
        if self.min < 0:
            raise ValueError(f"min must be >= 0, got {self.min}")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max must be >= min ({self.min}), got {self.max}")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "fixed":
            values = np.full(n, float(self.mean))
        elif self.kind == "uniform":
            values = rng.integers(self.low, self.high, size=n, endpoint=True).astype(float)
        else:
            # The lognormal's mean is exp(mu + sigma^2 / 2); solve for mu so that it equals ``mean``.
            mu = math.log(self.mean) - self.sigma**2 / 2
            values = rng.lognormal(mu, self.sigma, size=n)
        upper = math.inf if self.max is None else self.max
        return [int(v) for v in np.clip(np.rint(values), self.min, upper)]

    def __str__(self) -> str:
        """The form ``parse_length`` reads."""
        if self.kind == "fixed":
            text = f"fixed:{_fmt(self.mean)}"
        elif self.kind == "uniform":
            text = f"uniform:{self.low}:{self.high}"
        else:
            text = f"lognormal:{_fmt(self.mean)}:{_fmt(self.sigma)}"
        if self.min != 1:
            text += f",min={self.min}"
        if self.max is not None:
            text += f",max={self.max}"
        return text


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def parse_length(text: str) -> LengthDistribution:
    """Reads "128", "fixed:128", "uniform:64:512" or "lognormal:256:0.8" (mean, sigma), each
    optionally followed by ",min=N" and/or ",max=N"."""
    spec, *options = [part.strip() for part in text.split(",")]
    fields = spec.split(":")
    kind, args = ("fixed", fields) if len(fields) == 1 else (fields[0], fields[1:])
    arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if kind not in arity:
        raise ValueError(f"length {text!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if len(args) != arity[kind]:
        raise ValueError(f"length {text!r}: {kind} takes {arity[kind]} value(s) separated by ':', got {len(args)}")
    if kind == "fixed":
        kwargs: dict = {"mean": _number(text, args[0], float)}
    elif kind == "uniform":
        kwargs = {"low": _number(text, args[0], int), "high": _number(text, args[1], int)}
    else:
        kwargs = {"mean": _number(text, args[0], float), "sigma": _number(text, args[1], float)}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("min", "max"):
            raise ValueError(f"length {text!r}: options are min=N and max=N, got {option!r}")
        kwargs[key] = _number(text, value, int)
    try:
        return LengthDistribution(kind, **kwargs)
    except ValueError as e:
        raise ValueError(f"length {text!r}: {e}") from None


def _number(text: str, value: str, convert: Callable[[str], float]) -> float:
    try:
        return convert(value)
    except ValueError:
        raise ValueError(f"length {text!r}: {value!r} is not a valid {convert.__name__}") from None


# Length shapes of three common workloads (lognormal, long right tail), for planning when no trace is at hand:
# chat (conversations: mid-size prompts, long replies), code completion (short prompts, short completions)
# and summarization (long documents, short summaries).
WORKLOAD_PRESETS: dict[str, tuple[str, str]] = {
    "chat": ("lognormal:750:1.0,max=4096", "lognormal:200:0.9,max=1024"),
    "code": ("lognormal:170:0.5,max=2048", "lognormal:100:0.6,max=512"),
    "summarization": ("lognormal:1700:0.5,max=8192", "lognormal:90:0.5,max=512"),
}


def preset_workload(name: str, n: int, seed: int = 0, max_context: int | None = None) -> list[RequestSpec]:
    """``n`` requests shaped like the preset ``name``; with ``max_context``, prompts are cut so that
    prompt + output fits it (keeping at least one prompt token), as a server would have to."""
    if name not in WORKLOAD_PRESETS:
        raise ValueError(f"unknown workload {name!r}; presets: {', '.join(WORKLOAD_PRESETS)}")
    prompt, output = (parse_length(text) for text in WORKLOAD_PRESETS[name])
    return fit_context(synthetic_workload(n, prompt, output, seed), max_context)


def fit_context(requests: list[RequestSpec], max_context: int | None) -> list[RequestSpec]:
    """Requests with prompts cut so prompt + output <= ``max_context`` (outputs cut too when they alone exceed it)."""
    if max_context is None:
        return requests
    if max_context < 2:
        raise ValueError(f"max_context must be at least 2, got {max_context}")
    fitted = []
    for r in requests:
        output = min(r.output_len, max_context - 1)
        fitted.append(RequestSpec(max(1, min(r.prompt_len, max_context - output)), output))
    return fitted


def synthetic_workload(
    n: int, prompt: LengthDistribution, output: LengthDistribution, seed: int = 0
) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    prompts = prompt.sample(n, rng)
    outputs = output.sample(n, rng)
    return [RequestSpec(p, o) for p, o in zip(prompts, outputs)]


def load_sharegpt(
    path: str | Path,
    count_tokens: Callable[[str], int],
    n: int | None = None,
    seed: int = 0,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
) -> list[RequestSpec]:
    """Requests from a ShareGPT dump: the first human turn is the prompt, the gpt turn after it the
    output. Like vLLM's benchmark, pairs with prompt or output under 4 tokens are dropped (and here
    those over the max lengths). Returns n pairs (all of them when n is None, fewer when the file
    has fewer)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    # Shuffle before counting tokens so that only as many as needed go through the tokenizer.
    order = np.random.default_rng(seed).permutation(len(pairs))
    requests = []
    for i in order:
        if n is not None and len(requests) >= n:
            break
        prompt_len, output_len = count_tokens(pairs[i][0]), count_tokens(pairs[i][1])
        if prompt_len < 4 or output_len < 4:
            continue
        if (max_prompt_len is not None and prompt_len > max_prompt_len) or (
            max_output_len is not None and output_len > max_output_len
        ):
            continue
        requests.append(RequestSpec(prompt_len, output_len))
    if not requests:
        raise ValueError(f"{path}: no usable conversation (a human turn followed by a gpt turn, each >= 4 tokens)")
    return requests


def _first_exchange(entry: object) -> tuple[str, str] | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for turn, reply in zip(turns, turns[1:]):
        if isinstance(turn, dict) and turn.get("from") == "human":
            if isinstance(reply, dict) and reply.get("from") == "gpt":
                return str(turn.get("value", "")), str(reply.get("value", ""))
            return None
    return None


def load_length_trace(path: str | Path) -> list[RequestSpec]:
    """Requests from a JSONL trace: one {"prompt_len": int, "output_len": int} per line
    ("input_len" is accepted for "prompt_len"); blank lines are skipped."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            prompt_len = row.get("prompt_len", row.get("input_len"))
            output_len = row.get("output_len")
            for name, value in (("prompt_len", prompt_len), ("output_len", output_len)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{path}:{number}: {name} must be a positive integer, got {value!r}")
            requests.append(RequestSpec(prompt_len, output_len))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from 0 (the first after one gap) for n requests at mean ``rate`` req/s.
    Gaps are gamma-distributed with shape ``burstiness``: 1 is a Poisson process, smaller is
    burstier (coefficient of variation 1/sqrt(burstiness)). ``rate`` inf sends everything at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1 / (rate * burstiness), size=n)
    return [float(t) for t in np.cumsum(gaps)]
