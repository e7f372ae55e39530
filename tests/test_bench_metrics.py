"""The benchmark's measurement core on hand-made timelines where every figure is exact."""

import json
import math

import numpy as np
import pytest

from distserve.benchmark.metrics import (
    SLO,
    Attainment,
    RequestRecord,
    Stats,
    attainment,
    format_result,
    summarize,
)
from placement.goodput import find_goodput
from placement.workload import (
    LengthDistribution,
    RequestSpec,
    arrival_times,
    load_length_trace,
    load_sharegpt,
    parse_length,
    synthetic_workload,
)

approx = pytest.approx


# --- request records --------------------------------------------------------------------------


def test_record_latencies():
    r = RequestRecord(prompt_len=8, output_len=3, send_time=10.0, token_times=[10.5, 10.6, 10.8])
    assert r.ok and r.num_tokens == 3
    assert r.ttft == approx(0.5)
    assert r.tpot == approx(0.15)
    assert r.itls == approx([0.1, 0.2])
    assert r.e2e == approx(0.8)


def test_chunked_tokens_count_once_each():
    r = RequestRecord(8, 4, send_time=0.0, token_times=[1.0, 2.0, 2.0, 2.0])
    assert r.tpot == approx(1 / 3)
    assert r.itls == approx([1.0, 0.0, 0.0])


def test_single_token_request_has_zero_tpot():
    r = RequestRecord(8, 1, send_time=1.0, token_times=[1.25])
    assert r.ok and r.ttft == approx(0.25) and r.e2e == approx(0.25)
    assert r.tpot == 0.0 and r.itls == []


def test_failed_requests():
    failed = RequestRecord(8, 4, send_time=0.0, token_times=[0.5], error="connection reset")
    empty = RequestRecord(8, 4, send_time=0.0)
    assert not failed.ok and not empty.ok
    assert math.isnan(empty.ttft) and math.isnan(empty.tpot) and math.isnan(empty.e2e)


# --- stats and attainment ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [[1, 2, 3, 4], [5.0], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], list(range(101))])
def test_stats_match_numpy(values):
    s = Stats.of(values)
    assert s.mean == approx(np.mean(values))
    assert s.median == approx(np.median(values))
    assert s.p90 == approx(np.percentile(values, 90))
    assert s.p99 == approx(np.percentile(values, 99))


def test_stats_exact_and_empty():
    assert Stats.of([1, 2, 3, 4]) == Stats(mean=2.5, median=2.5, p90=approx(3.7), p99=approx(3.97))
    assert all(math.isnan(v) for v in vars(Stats.of([])).values())


def slo_records() -> list[RequestRecord]:
    return [
        RequestRecord(10, 3, 0.0, [0.1, 0.2, 0.3]),  # TTFT 0.1, TPOT 0.1: meets both
        RequestRecord(10, 3, 0.0, [0.5, 0.6, 0.7]),  # TTFT 0.5, TPOT 0.1: TPOT only
        RequestRecord(10, 3, 0.0, [0.1, 0.5, 0.9]),  # TTFT 0.1, TPOT 0.4: TTFT only
        RequestRecord(10, 1, 0.0, [0.2]),  # single token: TPOT 0, meets both
        RequestRecord(10, 3, 0.0, [0.1], error="server error"),  # failed: misses everything
    ]


def test_attainment_exact_fractions():
    att = attainment(slo_records(), SLO(ttft=0.2, tpot=0.2))
    assert att == Attainment(both=2 / 5, ttft=3 / 5, tpot=3 / 5)
    # The bounds are inclusive.
    assert attainment(slo_records()[:1], SLO(ttft=0.1, tpot=0.1)).both == 1.0


def test_slo_scaled():
    assert SLO(0.2, 0.05).scaled(2.0) == SLO(0.4, 0.1)
    assert attainment(slo_records(), SLO(0.2, 0.2).scaled(2.5)) == Attainment(4 / 5, 4 / 5, 4 / 5)


def test_attainment_of_nothing():
    with pytest.raises(ValueError):
        attainment([], SLO(1, 1))


# --- summarize --------------------------------------------------------------------------------


def test_summarize_throughputs_and_stats():
    records = [
        RequestRecord(100, 3, 0.0, [1.0, 1.5, 2.0]),
        RequestRecord(50, 2, 1.0, [2.0, 4.0]),
        RequestRecord(30, 1, 2.0, [3.0]),
        RequestRecord(70, 5, 3.0, [], error="timeout"),
    ]
    res = summarize(records, slo=SLO(ttft=1.0, tpot=1.0), rate=2.0)
    assert (res.num_requests, res.num_ok, res.num_errors) == (4, 3, 1)
    assert res.duration == approx(4.0)  # first send 0.0, last token 4.0
    assert res.request_throughput == approx(3 / 4)
    assert res.output_throughput == approx(6 / 4)
    assert res.input_throughput == approx(180 / 4)
    assert res.ttft.mean == approx(1.0) and res.ttft.median == approx(1.0)
    assert res.tpot.mean == approx((0.5 + 2.0) / 2)  # the single-token request is left out
    assert res.itl == Stats.of([0.5, 0.5, 2.0])
    assert res.e2e.mean == approx((2.0 + 3.0 + 1.0) / 3)
    assert res.attainment == Attainment(both=2 / 4, ttft=3 / 4, tpot=2 / 4)

    d = res.to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert d["ttft"]["median"] == approx(1.0) and d["attainment"]["both"] == 0.5 and d["rate"] == 2.0

    text = format_result(res)
    for needle in ("TTFT", "TPOT", "ITL", "E2E", "1000.00", "50.0"):
        assert needle in text


def test_summarize_all_failed_is_json_ready():
    failed = [RequestRecord(10, 2, 0.0, [], error="refused"), RequestRecord(10, 2, 2.0, [], error="refused")]
    res = summarize(failed, rate=math.inf)
    assert res.num_ok == 0 and res.duration == 2.0 and res.request_throughput == 0.0 and res.attainment is None
    d = res.to_dict()
    assert d["ttft"]["mean"] is None and d["rate"] == "inf"
    json.dumps(d, allow_nan=False)
    # No time elapsed at all: throughputs are undefined rather than infinite.
    res = summarize(failed[:1])
    assert math.isnan(res.request_throughput) and res.to_dict()["request_throughput"] is None
    assert "nan" in format_result(res)


def test_the_first_error_is_of_the_first_failed_request_sent():
    records = [
        RequestRecord(8, 2, send_time=0.0, token_times=[0.1, 0.2]),
        RequestRecord(8, 2, send_time=0.3, error="RESOURCE_EXHAUSTED: retry later"),
        RequestRecord(8, 2, send_time=0.2, error="INVALID_ARGUMENT: the prompt is too long"),
    ]
    res = summarize(records)
    assert (res.num_ok, res.num_errors) == (1, 2)
    assert res.first_error == res.to_dict()["first_error"] == "INVALID_ARGUMENT: the prompt is too long"
    assert "First error: INVALID_ARGUMENT: the prompt is too long" in format_result(res)
    clean = summarize(records[:1])
    assert clean.first_error is None and "First error" not in format_result(clean)


# --- goodput ----------------------------------------------------------------------------------


def step_measure(rate: float) -> float:
    return 1.0 if rate <= 3.7 else 0.5


def test_find_goodput_converges():
    goodput, probes = find_goodput(step_measure, target=0.9, low=0.5, high=10.0, tolerance=0.02)
    assert goodput <= 3.7 and goodput >= 3.7 * (1 - 0.02)
    assert probes[:2] == [(0.5, 1.0), (10.0, 0.5)]
    assert all(a == step_measure(r) for r, a in probes)


def test_find_goodput_max_iters_bounds_probes():
    _, probes = find_goodput(step_measure, target=0.9, low=0.5, high=10.0, tolerance=1e-9, max_iters=5)
    assert len(probes) == 2 + 5


def test_find_goodput_edges():
    assert find_goodput(step_measure, target=0.9, low=4.0, high=8.0) == (0.0, [(4.0, 0.5)])
    assert find_goodput(step_measure, target=0.9, low=1.0, high=3.0) == (3.0, [(1.0, 1.0), (3.0, 1.0)])
    with pytest.raises(ValueError):
        find_goodput(step_measure, target=0.9, low=3.0, high=1.0)


# --- arrivals ---------------------------------------------------------------------------------


def gaps(times: list[float]) -> np.ndarray:
    return np.diff([0.0, *times])


def test_arrival_mean_rate_and_burstiness():
    poisson = arrival_times(20000, rate=5.0, seed=1)
    bursty = arrival_times(20000, rate=5.0, burstiness=0.25, seed=1)
    for times in (poisson, bursty):
        assert len(times) == 20000 and times[0] > 0 and np.all(np.diff(times) >= 0)
        assert 20000 / times[-1] == approx(5.0, rel=0.04)
    cv = [gaps(t).std() / gaps(t).mean() for t in (poisson, bursty)]
    assert cv[0] == approx(1.0, rel=0.05)
    assert cv[1] == approx(2.0, rel=0.05)  # 1 / sqrt(0.25)


def test_arrival_edge_cases():
    assert arrival_times(3, rate=math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(5, 2.0, seed=7) == arrival_times(5, 2.0, seed=7)
    for kwargs in ({"rate": 0.0}, {"rate": -1.0}, {"rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError):
            arrival_times(3, **kwargs)


# --- length distributions ---------------------------------------------------------------------


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDistribution("fixed", mean=128).sample(4, rng) == [128] * 4
    uniform = LengthDistribution("uniform", low=64, high=70).sample(5000, rng)
    assert min(uniform) == 64 and max(uniform) == 70
    lognormal = LengthDistribution("lognormal", mean=256, sigma=0.8).sample(50000, rng)
    assert np.mean(lognormal) == approx(256, rel=0.03)
    clipped = LengthDistribution("lognormal", mean=256, sigma=1.5, min=16, max=512).sample(5000, rng)
    assert min(clipped) == 16 and max(clipped) == 512
    assert LengthDistribution("fixed", mean=4000, max=2048).sample(2, rng) == [2048, 2048]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kind": "zipf", "mean": 3}, "kind"),
        ({"kind": "fixed"}, "mean"),
        ({"kind": "uniform", "low": 10, "high": 5}, "high"),
        ({"kind": "lognormal", "mean": 100, "sigma": -1}, "sigma"),
        ({"kind": "fixed", "mean": 10, "min": 20, "max": 10}, "max"),
    ],
)
def test_length_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LengthDistribution(**kwargs)


def test_synthetic_workload():
    specs = synthetic_workload(
        3, LengthDistribution("fixed", mean=100), LengthDistribution("uniform", low=1, high=9), seed=3
    )
    assert [s.prompt_len for s in specs] == [100] * 3 and all(1 <= s.output_len <= 9 for s in specs)
    assert specs == synthetic_workload(
        3, LengthDistribution("fixed", mean=100), LengthDistribution("uniform", low=1, high=9), seed=3
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("128", LengthDistribution("fixed", mean=128)),
        ("fixed:128", LengthDistribution("fixed", mean=128)),
        ("uniform:64:512", LengthDistribution("uniform", low=64, high=512)),
        ("lognormal:256:0.8", LengthDistribution("lognormal", mean=256, sigma=0.8)),
        ("lognormal:256:0.8,max=2048", LengthDistribution("lognormal", mean=256, sigma=0.8, max=2048)),
        ("uniform:1:9, min=2, max=8", LengthDistribution("uniform", low=1, high=9, min=2, max=8)),
    ],
)
def test_parse_length_round_trips(text, expected):
    assert parse_length(text) == expected
    assert parse_length(str(expected)) == expected


@pytest.mark.parametrize(
    "text", ["", "abc", "zipf:3", "uniform:64", "fixed:1:2", "lognormal:256:x", "128,max=", "128,top=3", "0"]
)
def test_parse_length_errors(text):
    with pytest.raises(ValueError, match="length"):
        parse_length(text)


# --- files ------------------------------------------------------------------------------------


def words(n: int) -> str:
    return " ".join(["w"] * n)


def test_load_sharegpt(tmp_path):
    def conv(*turns):
        return {"conversations": [{"from": who, "value": text} for who, text in turns]}

    data = [
        conv(("human", words(5)), ("gpt", words(7)), ("human", words(50)), ("gpt", words(50))),  # kept: 5 / 7
        conv(("system", words(9)), ("human", words(6)), ("gpt", words(8))),  # kept: first human turn, 6 / 8
        conv(("human", words(3)), ("gpt", words(10))),  # prompt under 4 tokens
        conv(("human", words(10)), ("gpt", words(3))),  # output under 4 tokens
        conv(("human", words(40)), ("gpt", words(10))),  # prompt over the max
        conv(("human", words(10)), ("gpt", words(40))),  # output over the max
        conv(("human", words(10))),  # a single turn
        conv(("gpt", words(10)), ("gpt", words(10))),  # no human turn
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    count = lambda s: len(s.split())  # noqa: E731
    kept = load_sharegpt(path, count, n=None, seed=0, max_prompt_len=30, max_output_len=30)
    assert sorted((r.prompt_len, r.output_len) for r in kept) == [(5, 7), (6, 8)]
    assert len(load_sharegpt(path, count, n=1, seed=0, max_prompt_len=30, max_output_len=30)) == 1
    assert len(load_sharegpt(path, count, n=None, seed=0)) == 4  # no max lengths
    orders = {tuple((r.prompt_len, r.output_len) for r in load_sharegpt(path, count, None, seed)) for seed in range(8)}
    assert len(orders) > 1  # the seed shuffles

    path.write_text(json.dumps(data[2:4] + data[6:]))
    with pytest.raises(ValueError, match="no usable conversation"):
        load_sharegpt(path, count, n=10, seed=0)


def test_load_length_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_len": 12, "output_len": 3}\n\n{"input_len": 7, "output_len": 9}\n')
    assert load_length_trace(path) == [RequestSpec(12, 3), RequestSpec(7, 9)]
    path.write_text('{"prompt_len": 12, "output_len": 3}\n{"prompt_len": 5}\n')
    with pytest.raises(ValueError, match=":2: output_len"):
        load_length_trace(path)
    path.write_text('{"prompt_len": 12, "output_len": 3}\n{"prompt_len": 1, "output_len": 2}\nnot json\n')
    with pytest.raises(ValueError, match=":3: not JSON"):
        load_length_trace(path)


# --- plots ------------------------------------------------------------------------------------


def test_plots_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    from placement.plots import plot_attainment_vs_rate, plot_attainment_vs_slo_scale

    series = {"disagg 1P1D": [(1.0, 1.0), (3.0, 0.95), (2.0, 0.99)], "colocated": [(1.0, 0.97), (2.0, 0.6)]}
    for plot, path in (
        (plot_attainment_vs_rate, tmp_path / "rate.png"),
        (plot_attainment_vs_slo_scale, tmp_path / "sub" / "scale.png"),
    ):
        out = plot(series, 0.9, path, title="test")
        assert out == path and path.stat().st_size > 0
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_attainment_vs_rate(series, None, tmp_path / "no-target.png")
