"""Goodput of a disaggregated deployment (1 prefill + 1 decode instance) against colocated ones
with the same resources (2 instances doing both phases: prefill-first, and with chunked prefill
as vLLM colocates), on the same machine and workloads, measured with ``distserve bench`` through
the gRPC frontend.

    python scripts/experiments/exp_disagg_vs_colocated.py [--num-requests 100] [--out results/disagg-vs-colocated]

Each instance gets the same share of the machine (``--cpu-threads`` torch threads; on GPUs it
would be one GPU each). SLOs are set per workload from the colocated deployment's single-request
latencies (``--ttft-scale`` x its median TTFT, ``--tpot-scale`` x its median TPOT), then both
deployments get a goodput search at the same SLOs and target. Writes each run's JSON, plots of
attainment against rate and against an SLO scale factor (both deployments at the colocated
goodput rate), and a summary table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import ray

from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from placement.plots import plot_attainment_vs_rate, plot_attainment_vs_slo_scale

WORKLOADS = {
    # Long prompts, moderate outputs: every prefill stalls a colocated instance's decoding.
    "long-prompts": {"prompt_len": "uniform:512:768", "output_len": "64"},
    # Short prompts, long outputs: prefill is cheap, decode capacity is what counts.
    "short-prompts": {"prompt_len": "uniform:16:64", "output_len": "128"},
}
CHUNK_TOKENS = 256  # chunked prefill's budget per step: a few decode steps' worth of prefill
DEPLOYMENTS = {
    "colocated": {"colocated": {"instances": 2}},
    "chunked": {"colocated": {"instances": 2, "enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK_TOKENS}},
    "disaggregated": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
}


def bench(address: str, out: Path, label: str, workload: dict, *extra: str) -> dict:
    """One ``distserve bench`` in a process of its own; its JSON results."""
    result_json = out / f"{label}.json"
    command = [
        sys.executable,
        "-m",
        "distserve.cli",
        "bench",
        "--server",
        address,
        "--no-progress",
        "--label",
        label,
        "--prompt-len",
        workload["prompt_len"],
        "--output-len",
        workload["output_len"],
        "--result-json",
        str(result_json),
        *extra,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result_json.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per instance")
    parser.add_argument("--ttft-scale", type=float, default=4.0)
    parser.add_argument("--tpot-scale", type=float, default=2.0)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--rate-high", type=float, default=64.0)
    parser.add_argument("--out", type=Path, default=Path("results/disagg-vs-colocated"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    ray.init(include_dashboard=False, log_to_driver=False)
    slos: dict[str, tuple[float, float]] = {}
    results: dict[str, dict[str, dict]] = {name: {} for name in WORKLOADS}
    try:
        for deployment, pools in DEPLOYMENTS.items():
            config = make_cluster_config(model=args.model, num_kv_blocks=1024, cpu_threads=args.cpu_threads, **pools)
            with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
                for name, workload in WORKLOADS.items():
                    if name not in slos:  # calibrated on the first deployment, used for both
                        single = bench(
                            server.grpc_address,
                            args.out,
                            f"{name}-single",
                            workload,
                            "--num-requests",
                            "10",
                            "--max-concurrency",
                            "1",
                        )["runs"][0]
                        slos[name] = (
                            args.ttft_scale * single["ttft"]["median"],
                            args.tpot_scale * single["tpot"]["median"],
                        )
                    ttft, tpot = slos[name]
                    results[name][deployment] = bench(
                        server.grpc_address,
                        args.out,
                        f"{name}-{deployment}",
                        workload,
                        "--num-requests",
                        str(args.num_requests),
                        "--goodput",
                        "--target",
                        str(args.target),
                        "--slo-ttft",
                        f"{ttft:.6f}",
                        "--slo-tpot",
                        f"{tpot:.6f}",
                        "--rate-low",
                        "0.5",
                        "--rate-high",
                        str(args.rate_high),
                    )
                    baseline = results[name]["colocated"]
                    if deployment != "colocated" and baseline["goodput"]:
                        # Attainment under scaled SLOs at one rate for both: the baseline's goodput.
                        at_baseline = bench(
                            server.grpc_address, args.out, f"{name}-{deployment}-at-baseline-rate", workload,
                            "--num-requests", str(args.num_requests), "--rate", str(baseline["goodput"]),
                            "--slo-ttft", f"{ttft:.6f}", "--slo-tpot", f"{tpot:.6f}",
                        )  # fmt: skip
                        results[name][deployment]["slo_scale"] = at_baseline["slo_scale"]
                    goodput = results[name][deployment]["goodput"]
                    print(f"{name:<14} {deployment:<14} goodput {goodput:.3g} req/s", flush=True)
    finally:
        ray.shutdown()

    print(f"\n{'workload':<14} {'TTFT SLO ms':>11} {'TPOT SLO ms':>11}" + "".join(f" {d:>13}" for d in DEPLOYMENTS))
    for name, by_deployment in results.items():
        ttft, tpot = slos[name]
        goodputs = "".join(f" {by_deployment[d]['goodput']:>13.3g}" for d in DEPLOYMENTS)
        print(f"{name:<14} {ttft * 1e3:>11.1f} {tpot * 1e3:>11.2f}{goodputs}")
        rates = {
            d: sorted((run["rate"], run["attainment"]["both"]) for run in r["runs"]) for d, r in by_deployment.items()
        }
        scales = {d: r["slo_scale"]["points"] for d, r in by_deployment.items()}
        title = f"{args.model}, {name}"
        plot_attainment_vs_rate(rates, args.target, args.out / f"{name}-rate.png", title)
        plot_attainment_vs_slo_scale(scales, args.target, args.out / f"{name}-slo-scale.png", title)
    (args.out / "summary.json").write_text(json.dumps({"slos": slos, "results": results}, indent=2))


if __name__ == "__main__":
    main()
