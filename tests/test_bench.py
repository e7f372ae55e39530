"""``distserve bench`` end to end against a real server over loopback: every request gets the
output length it asked for, results and plots are written, and goodput search bottoms out."""

import asyncio
import json

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


def test_bench_command_writes_results_and_plots(server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "lengths.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": 20 + 9 * i, "output_len": 4 + i}) for i in range(8)))
    out = tmp_path / "bench.json"
    args = ["bench", "--server", server.grpc_address, "--trace", str(trace), "--rates", "inf,40", "--no-progress"]
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
    assert "Serving benchmark result" in capsys.readouterr().out


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


def test_goodput_without_slos_is_refused(server):
    assert main(["bench", "--server", server.grpc_address, "--goodput", "--no-progress"]) == 2


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
    from placement.timeline import read_jsonl

    options = {"prefill": {}, "decode": {}} if pools == "disaggregated" else {"colocated": {"instances": 1}}
    config = make_cluster_config(model="tiny-llama", num_kv_blocks=128, **options)
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text("\n".join(json.dumps({"prompt_len": 20 + 9 * i, "output_len": 1 + 2 * i}) for i in range(8)))
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
        args = ["bench", "--server", server.grpc_address, "--trace", str(lengths), "--rates", "20,inf"]
        assert main([*args, "--no-progress", "--trace-out", str(tmp_path / "t.jsonl")]) == 0
    for rate in ("20", "inf"):
        timelines = read_jsonl(tmp_path / f"t-rate{rate}.jsonl")
        assert [(t.prompt_len, t.output_len) for t in timelines] == [(20 + 9 * i, 1 + 2 * i) for i in range(8)]
        for t in timelines:
            _check_timeline(t, colocated=pools == "colocated")
        arrivals = [t.arrival for t in timelines]  # on the workload's clock: the run starts near 0
        assert 0 <= min(arrivals) < 0.5 and (max(arrivals) > 0.1 if rate == "20" else max(arrivals) < 0.5)
