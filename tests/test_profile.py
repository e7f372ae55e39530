import argparse
import json

import pytest

from distserve.benchmark.profiler import add_profile_args, decode_grid, prefill_grid
from distserve.cli import add_dataclass_args, cmd_profile
from distserve.core.config import SECTIONS
from distserve.core.cpu_features import has_bf16_instructions
from placement.fitted import FittedLatency, fit, nnls

PREFILL = (2e-3, 3e-5, 4e-8)
DECODE = (1e-3, 5e-5, 2e-7)


def synthetic_samples(prefill=PREFILL, decode=DECODE):
    model = FittedLatency(prefill, decode)
    batches = [[n] * b for n in (16, 64, 256, 1024) for b in (1, 2, 4)] + [[10, 300], [7, 7, 900]]
    points = [(b, b * c) for b in (1, 8, 32) for c in (16, 128, 1024)]
    return (
        [(lengths, model.prefill_time(lengths)) for lengths in batches],
        [(b, ctx, model.decode_time(b, ctx)) for b, ctx in points],
    )


def test_fit_recovers_known_coefficients():
    prefill, decode = synthetic_samples()
    fitted = fit(prefill, decode, {"model": "synthetic"})
    assert fitted.prefill == pytest.approx(PREFILL, rel=1e-6)
    assert fitted.decode == pytest.approx(DECODE, rel=1e-6)
    assert fitted.meta["model"] == "synthetic"
    assert fitted.meta["prefill_r2"] == pytest.approx(1.0)
    assert fitted.meta["decode_r2"] == pytest.approx(1.0)
    assert (fitted.meta["prefill_samples"], fitted.meta["decode_samples"]) == (len(prefill), len(decode))
    for lengths, seconds in prefill:
        assert fitted.prefill_time(lengths) == pytest.approx(seconds, rel=1e-6)
    for batch, context, seconds in decode:
        assert fitted.decode_time(batch, context) == pytest.approx(seconds, rel=1e-6)


def test_nnls_drops_a_term_least_squares_would_make_negative():
    # Times that fall with the batch size: plain least squares gives e < 0, NNLS pins it at 0.
    decode = [(b, 100 * b, 1e-3 + 1e-6 * 100 * b - 2e-5 * b) for b in (1, 2, 4, 8, 16)]
    decode += [(b, 1000 * b, 1e-3 + 1e-6 * 1000 * b - 2e-5 * b) for b in (1, 2, 4, 8, 16)]
    prefill, _ = synthetic_samples()
    fitted = fit(prefill, decode)
    d, e, f = fitted.decode
    assert e == 0.0 and d > 0 and f > 0
    assert fitted.decode_time(1, 0) > 0


def test_nnls_matches_least_squares_when_unconstrained():
    import numpy as np

    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nnls(x, np.array([3.0, 5.0, 7.0])) == pytest.approx([1.0, 2.0])
    assert nnls(x, np.array([-1.0, -2.0, -3.0])) == pytest.approx([0.0, 0.0])


def test_save_load_round_trip(tmp_path):
    prefill, decode = synthetic_samples()
    fitted = fit(prefill, decode, {"device": "test", "tp": 1})
    path = tmp_path / "fitted.json"
    fitted.save(path)
    assert FittedLatency.load(path) == fitted
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        FittedLatency.load(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a fitted latency file"):
        FittedLatency.load(path)


def test_invalid_inputs():
    with pytest.raises(ValueError, match="non-negative"):
        FittedLatency((-1.0, 0.0, 0.0), (0.0, 0.0, 0.0))
    model = FittedLatency(PREFILL, DECODE)
    with pytest.raises(ValueError):
        model.prefill_time([])
    with pytest.raises(ValueError):
        model.decode_time(0, 10)
    with pytest.raises(ValueError):
        fit([], [(1, 1, 1.0)])


def test_grids_respect_limits():
    batches = prefill_grid(max_prompt_len=100, max_batch_size=8, token_budget=256)
    assert [16] in batches and [100] in batches and [16] * 8 in batches
    assert all(sum(b) <= 256 and len(b) <= 8 and max(b) <= 100 for b in batches)
    points = decode_grid(max_context_len=64, max_batch_size=3)
    assert {b for b, _ in points} == {1, 2, 3} and {c for _, c in points} == {16, 32, 64}


def test_profile_tiny_llama_on_cpu(tmp_path):
    parser = argparse.ArgumentParser()
    add_profile_args(parser)
    for cls in SECTIONS.values():
        add_dataclass_args(parser, cls)
    out = tmp_path / "tiny.json"
    args = parser.parse_args(
        ["--out", str(out), "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu"]
        # Prompts up to 512 tokens so the forward, not the per-step overhead, dominates on a tiny model.
        + ["--max-prompt-len", "512", "--max-context-len", "256", "--max-batch-size", "4", "--repeats", "3"]
    )
    assert cmd_profile(args) == 0
    fitted = FittedLatency.load(out)
    meta = fitted.meta
    dtype = "bfloat16" if has_bf16_instructions() else "float32"  # as auto chooses on this CPU
    assert meta["model"] == "tiny-llama" and meta["tp"] == meta["pp"] == 1 and meta["dtype"] == dtype
    assert meta["kv_cache_dtype"] == "auto"  # the planner warns when it plans for another
    assert meta["prefill_samples"] == 18 and meta["decode_samples"] == 15
    assert meta["prefill_r2"] > 0.8
    times = [fitted.prefill_time([n] * 2) for n in (16, 64, 256)]
    assert 0 < times[0] < times[1] < times[2]
    assert 0 < fitted.decode_time(1, 16) <= fitted.decode_time(4, 1024)
