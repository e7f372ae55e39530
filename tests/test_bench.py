"""``distserve bench`` end to end against a real server over loopback: every request gets the
output length it asked for, results and plots are written, and goodput search bottoms out."""

import asyncio
import json
import socket

import pytest

from distserve.benchmark.runner import run_workload
from distserve.cli import main
from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.client import AsyncClient
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from placement.workload import RequestSpec


@pytest.fixture(scope="module")
def server(ray_cluster):
    config = make_cluster_config(model="tiny-llama", num_kv_blocks=128, prefill={}, decode={})
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
        yield server


def _lengths(path, lengths: list[tuple[int, int]]) -> str:
    path.write_text("\n".join(json.dumps({"prompt_len": p, "output_len": o}) for p, o in lengths))
    return str(path)


def test_every_request_gets_its_lengths_and_clock(server):
    specs = [RequestSpec(p, o) for p, o in [(5, 1), (40, 7), (200, 30), (17, 12), (90, 3)]]

    async def run():
        async with AsyncClient(server.grpc_address) as client:
            return await run_workload(client, specs, rate=50.0, seed=1)

    records = asyncio.run(run())
    for spec, record in zip(specs, records):
        assert record.ok and record.num_tokens == spec.output_len
        assert record.send_time < record.token_times[0] <= record.token_times[-1]
    sends = [r.send_time for r in records]
    assert max(sends) - min(sends) > 0.01  # sent on the arrival schedule, not all at once


def test_bench_command_writes_results_and_plots(server, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import placement.plots

    titles = []  # each plot's title, as the real plotting functions get it
    for name in ("plot_attainment_vs_rate", "plot_attainment_vs_slo_scale"):
        plot = getattr(placement.plots, name)
        monkeypatch.setattr(placement.plots, name, lambda *args, plot=plot: titles.append(args[-1]) or plot(*args))
    trace = _lengths(tmp_path / "lengths.jsonl", [(20 + 9 * i, 4 + i) for i in range(8)])
    out = tmp_path / "bench.json"
    args = ["bench", "--server", server.grpc_address, "--trace", trace, "--rates", "inf,40", "--no-progress"]
    args += ["--slo-ttft", "10", "--slo-tpot", "1", "--result-json", str(out), "--plot-dir", str(tmp_path)]
    assert main(args) == 0
    results = json.loads(out.read_text())
    assert [run["rate"] for run in results["runs"]] == ["inf", 40.0]
    for run in results["runs"]:
        assert run["num_ok"] == 8 and run["num_errors"] == 0
        assert run["attainment"]["both"] == 1.0  # SLOs no request here can miss
        assert run["output_throughput"] > 0 and run["ttft"]["p99"] >= run["ttft"]["median"] > 0
    assert [s for s, _ in results["slo_scale"]["points"]][:2] == [0.25, 0.5]
    for name in ("server-rate.png", "server-slo-scale.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert results["model"] == "tiny-llama"
    assert results["label"] == results["deployment"] == "1 prefill TP1 + 1 decode TP1"
    assert titles == ["tiny-llama on 1 prefill TP1 + 1 decode TP1\nSLOs: TTFT 10 s, TPOT 1 s"] * 2
    out = capsys.readouterr().out
    assert "Serving benchmark result" in out and "First error" not in out


def test_sharegpt_dataset_lengths_come_from_the_servers_tokenizer(server, tmp_path):
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "the cache block " * (3 + i)},
                {"from": "gpt", "value": "prefill and decode " * (2 + i)},
            ]
        }
        for i in range(6)
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--server",
                server.grpc_address,
                "--dataset",
                str(dataset),
                "--num-requests",
                "4",
                "--no-progress",
                "--result-json",
                str(out),
            ]
        )
        == 0
    )
    (run,) = json.loads(out.read_text())["runs"]
    assert run["num_ok"] == 4


def test_goodput_is_zero_when_even_the_lowest_rate_misses(server, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--server", server.grpc_address, "--num-requests", "4", "--prompt-len", "32"]
    args += ["--output-len", "4", "--goodput", "--slo-ttft", "1e-6", "--slo-tpot", "1e-6", "--no-progress"]
    assert main([*args, "--rate-low", "1", "--rate-high", "8", "--result-json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["goodput"] == 0.0 and len(results["runs"]) == 1


def test_failed_requests_are_counted_and_the_first_error_shown(server, tmp_path, capsys):
    """Two of four prompts are longer than the model's context of 1024 tokens."""
    trace = _lengths(tmp_path / "lengths.jsonl", [(20, 3), (2000, 3), (30, 3), (1500, 3)])
    out = tmp_path / "bench.json"
    args = ["bench", "--server", server.grpc_address, "--trace", trace, "--no-progress", "--result-json", str(out)]
    assert main(args) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["num_ok"], run["num_errors"]) == (2, 2)
    assert run["first_error"].startswith("INVALID_ARGUMENT: ") and "context" in run["first_error"]
    printed = capsys.readouterr().out
    assert "2 / 2" in printed and f"First error: {run['first_error']}" in printed


def test_a_run_in_which_every_request_fails_exits_1_with_the_first_error(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--server", server.grpc_address, "--num-requests", "3", "--prompt-len", "2000"]
    assert main([*args, "--output-len", "4", "--no-progress", "--result-json", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(
        "distserve: error: all 3 requests sent at once failed, the first with INVALID_ARGUMENT: "
    )
    assert "context" in captured.err and captured.err.count("\n") == 1
    assert "nan" not in captured.out and "Serving benchmark result" not in captured.out
    assert not out.exists()


FLAG_MISTAKES = [
    (["--plot-dir", "plots"], "--plot-dir needs --slo-ttft and --slo-tpot (the plots show SLO attainment)"),
    (["--goodput"], "--goodput needs --slo-ttft and --slo-tpot (the SLOs whose attainment it searches)"),
    (["--target", "0.8"], "--target needs --slo-ttft and --slo-tpot (it is a target of SLO attainment)"),
    (["--slo-ttft", "1"], "--slo-ttft and --slo-tpot go together: give both or neither"),
    (["--rate", "2", "--rates", "1,2"], "--rate and --rates exclude each other: give one of them"),
    (["--goodput", "--slo-ttft", "1", "--slo-tpot", "1", "--rate", "2"], "--goodput and --rate exclude each other"),
    (["--rate-high", "8"], "--rate-high needs --goodput (it bounds the goodput search)"),
    (["--burstiness", "2"], "--burstiness needs --rate, --rates or --goodput"),
    (["--trace", "t.jsonl", "--dataset", "d.json"], "--trace and --dataset exclude each other"),
    (["--dataset", "d.json", "--output-len", "32"], "--dataset and --output-len exclude each other"),
    (["--rates", "1,fast"], "--rates takes comma-separated numbers, got '1,fast'"),
    (["--rate", "0"], "rates must be above 0 requests per second"),
]


@pytest.mark.parametrize("flags, message", FLAG_MISTAKES, ids=[" ".join(f) for f, _ in FLAG_MISTAKES])
def test_flags_that_need_or_exclude_each_other_are_refused_before_any_request(flags, message, capsys):
    """Against an address where nothing listens: a request sent would end in exit status 1, not 2."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    assert main(["bench", "--server", address, "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distserve: error: {message}") and err.count("\n") == 1


def _check_timeline(t, colocated: bool) -> None:
    """One request's server-side timeline is complete and in order; its prefill batch computed its
    whole prompt (a second run at another rate sends new prompts: the prefix cache must not help)."""
    assert t.error is None and len(t.token_times) == t.output_len
    assert t.arrival <= t.prefill_queued <= t.prefill_start <= t.prefill_end <= t.token_times[0]
    assert t.prefill_batch_size >= 1 and t.prefill_batch_tokens >= t.prompt_len
    if colocated or t.output_len == 1:
        assert t.handover is t.decode_admitted is t.migration_start is None
        decode_begins = t.prefill_end
    else:
        assert t.prefill_end <= t.handover <= t.decode_admitted <= t.migration_start <= t.migration_end
        decode_begins = t.migration_end
    assert len(t.steps) == t.output_len - 1  # one step per token after the first, no preemption here
    for (start, end, batch), token_time in zip(t.steps, t.token_times[1:]):
        assert decode_begins <= start < end <= token_time and batch >= 1
        decode_begins = end
    assert t.finish == t.token_times[-1] and t.num_preemptions == 0


@pytest.mark.parametrize("pools", ["disaggregated", "colocated"])
def test_trace_out_writes_every_requests_timeline(ray_cluster, tmp_path, pools):
    """``--trace-out`` writes one timeline per request (queue, prefill batch, hand-over, KV pull, each
    decode step), on the workload's clock, in the simulator's schema."""
    from distserve.core.timeline import read_jsonl

    options = {"prefill": {}, "decode": {}} if pools == "disaggregated" else {"colocated": {"instances": 1}}
    config = make_cluster_config(model="tiny-llama", num_kv_blocks=128, **options)
    lengths = _lengths(tmp_path / "lengths.jsonl", [(20 + 9 * i, 1 + 2 * i) for i in range(8)])
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
        args = ["bench", "--server", server.grpc_address, "--trace", lengths, "--rates", "20,inf"]
        assert main([*args, "--no-progress", "--trace-out", str(tmp_path / "t.jsonl")]) == 0
    for rate in ("20", "inf"):
        timelines = read_jsonl(tmp_path / f"t-rate{rate}.jsonl")
        assert [(t.prompt_len, t.output_len) for t in timelines] == [(20 + 9 * i, 1 + 2 * i) for i in range(8)]
        for t in timelines:
            _check_timeline(t, colocated=pools == "colocated")
        arrivals = [t.arrival for t in timelines]  # on the workload's clock: the run starts near 0
        assert 0 <= min(arrivals) < 0.5 and (max(arrivals) > 0.1 if rate == "20" else max(arrivals) < 0.5)
