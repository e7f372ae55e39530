"""Latency model fitted from profiles of the real engine, in the form of DistServe's simulator.

    prefill batch time = a + b * (total prompt tokens) + c * (sum of squared prompt lengths)
    decode step time   = d + e * (batch size)          + f * (total context tokens of the batch)

The linear terms are the weight-bound work (every token, or every sequence, goes through the
matmuls) and the squared / context terms are attention. Coefficients are fitted by non-negative
least squares: a negative coefficient would be noise (or a term the grid cannot tell apart from
another) and would make predictions outside the grid go negative. With three terms the exact NNLS
solution is found by enumeration: it is the unconstrained least-squares fit on some subset of the
terms, so the best fit among the subsets whose coefficients are all non-negative is the optimum.

``distserve profile`` (distserve/benchmark/profiler.py) measures the samples and saves the result; the
planner loads it and plugs ``prefill_time`` / ``decode_time`` in where it would use the roofline.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "distserve-fitted-latency"
FORMAT_VERSION = 1

PrefillSample = tuple[list[int], float]  # prompt lengths of the batch, seconds
DecodeSample = tuple[int, int, float]  # batch size, total context tokens, seconds


@dataclass(frozen=True)
class FittedLatency:
    prefill: tuple[float, float, float]  # a, b, c
    decode: tuple[float, float, float]  # d, e, f
    meta: dict[str, Any] = field(default_factory=dict)  # device, model, dtype, kv_cache_dtype, tp, pp, date, r2 ...

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            coefs = getattr(self, name)
            if len(coefs) != 3 or any(not (c >= 0 and np.isfinite(c)) for c in coefs):
                raise ValueError(f"{name} must be three finite non-negative coefficients, got {coefs!r}")

    def prefill_time(self, lengths: Sequence[int]) -> float:
        """Seconds one prefill batch of prompts of ``lengths`` tokens takes."""
        if not lengths or any(length < 1 for length in lengths):
            raise ValueError(f"lengths must be a non-empty sequence of positive integers, got {lengths!r}")
        a, b, c = self.prefill
        return a + b * sum(lengths) + c * sum(length * length for length in lengths)

    def decode_time(self, batch_size: int, total_context: int) -> float:
        """Seconds of one decode step of ``batch_size`` sequences whose contexts sum to ``total_context``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size!r}")
        if total_context < 0:
            raise ValueError(f"total_context must be non-negative, got {total_context!r}")
        return self._decode_line(batch_size, total_context)

    def decode_times(self, batch_size: int, total_context: int, steps: int) -> np.ndarray:
        """``decode_time`` of ``steps`` decode steps of the same sequences, the first from
        ``total_context`` tokens, each one token per sequence more (the very floats it gives)."""
        self.decode_time(batch_size, total_context)  # the arguments' checks
        return self._decode_line(batch_size, total_context + batch_size * np.arange(steps, dtype=np.int64))

    def _decode_line(self, batch_size: int, total_context: int | np.ndarray) -> float | np.ndarray:
        d, e, f = self.decode
        return d + e * batch_size + f * total_context

    def mismatch(self, model: str, gpu: str, kv_cache_dtype: str = "auto") -> str | None:
        """What of the profiled setup (``meta``: device, model, KV cache dtype) differs from a question
        about ``model`` on ``gpu`` (a GPU name such as A100-80GB) with a ``kv_cache_dtype`` cache, as a
        clause; None when nothing recorded differs. A GPU matches a device whose name holds its chip
        (A100-80GB: "NVIDIA A100-SXM4-80GB"); a model matches by its last path component, in any case.
        A profile that records no KV cache dtype was measured before there was a choice: ``auto``."""
        differences = []
        device = self.meta.get("device")
        chip = gpu.split("-")[0].lower()
        if device and (device.lower().startswith("cpu") or chip not in device.lower()):
            differences.append(f"on {device}, not {gpu}")
        profiled = self.meta.get("model")
        if profiled and Path(str(profiled)).name.lower() != Path(model).name.lower():
            differences.append(f"with {profiled}, not {model}")
        cache_dtype = self.meta.get("kv_cache_dtype", "auto")
        if cache_dtype != kv_cache_dtype:
            differences.append(f"with kv_cache_dtype {cache_dtype}, not {kv_cache_dtype}")
        return "measured " + " and ".join(differences) if differences else None

    def save(self, path: str | Path) -> None:
        data = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "prefill": list(self.prefill),
            "decode": list(self.decode),
            "meta": self.meta,
        }
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FittedLatency:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a fitted latency file (no 'format: {FORMAT}')")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: fitted latency format version {data.get('version')!r}, expected {FORMAT_VERSION}"
            )
        return cls(tuple(data["prefill"]), tuple(data["decode"]), data.get("meta", {}))


def nnls(features: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns, exact by enumerating the active sets."""
    n = features.shape[1]
    # Columns differ by orders of magnitude (1 vs squared lengths): scale them so lstsq is well conditioned.
    scale = np.abs(features).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = features / scale
    best, best_residual = np.zeros(n), float(np.sum(targets**2))
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            cols = list(subset)
            coefs = np.linalg.lstsq(scaled[:, cols], targets, rcond=None)[0]
            if np.any(coefs < 0):
                continue
            residual = float(np.sum((scaled[:, cols] @ coefs - targets) ** 2))
            if residual < best_residual:
                best = np.zeros(n)
                best[cols] = coefs
                best_residual = residual
    return best / scale


def r_squared(predicted: np.ndarray, targets: np.ndarray) -> float:
    total = float(np.sum((targets - targets.mean()) ** 2))
    residual = float(np.sum((targets - predicted) ** 2))
    if total == 0.0:
        return 1.0 if residual == 0.0 else 0.0
    return 1.0 - residual / total


def _fit_one(features: np.ndarray, targets: np.ndarray) -> tuple[tuple[float, float, float], float]:
    coefs = nnls(features, targets)
    return (float(coefs[0]), float(coefs[1]), float(coefs[2])), r_squared(features @ coefs, targets)


def fit(
    prefill_samples: Sequence[PrefillSample],
    decode_samples: Sequence[DecodeSample],
    meta: dict[str, Any] | None = None,
) -> FittedLatency:
    """Fit both phases; ``meta`` (device, model, ...) is kept with r² and sample counts added."""
    if not prefill_samples or not decode_samples:
        raise ValueError("fitting needs at least one prefill and one decode sample")
    for lengths, _ in prefill_samples:
        if not lengths or any(length < 1 for length in lengths):
            raise ValueError(f"prefill sample lengths must be positive integers, got {lengths!r}")
    prefill_x = np.array(
        [[1.0, sum(lengths), sum(n * n for n in lengths)] for lengths, _ in prefill_samples], dtype=float
    )
    prefill_y = np.array([seconds for _, seconds in prefill_samples], dtype=float)
    decode_x = np.array([[1.0, batch, context] for batch, context, _ in decode_samples], dtype=float)
    decode_y = np.array([seconds for _, _, seconds in decode_samples], dtype=float)
    prefill, prefill_r2 = _fit_one(prefill_x, prefill_y)
    decode, decode_r2 = _fit_one(decode_x, decode_y)
    info = dict(meta or {})
    info.update(
        prefill_r2=prefill_r2,
        decode_r2=decode_r2,
        prefill_samples=len(prefill_samples),
        decode_samples=len(decode_samples),
    )
    return FittedLatency(prefill, decode, info)
