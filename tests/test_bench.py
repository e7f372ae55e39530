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
