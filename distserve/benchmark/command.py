"""``distserve bench``: a serving benchmark through the gRPC frontend, one rate, a sweep of rates
or a goodput search, with JSON results and attainment plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

from distserve.benchmark.metrics import (
    SLO,
    BenchResult,
    RequestRecord,
    attainment,
    format_result,
    summarize,
)
from placement.goodput import find_goodput
from placement.workload import (
    RequestSpec,
    load_length_trace,
    load_sharegpt,
    parse_length,
    synthetic_workload,
)

SLO_SCALES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=200, help="requests per run (default: 200)")
    work.add_argument(
        "--prompt-len",
        default="lognormal:256:0.5,max=768",
        help="prompt lengths: N, uniform:LO:HI or lognormal:MEAN:SIGMA, with ,max=N (default: %(default)s)",
    )
    work.add_argument("--output-len", default="lognormal:64:0.5,max=256", help="output lengths, same forms")
    work.add_argument("--dataset", help="ShareGPT-format JSON: lengths of its first exchanges (server's tokenizer)")
    work.add_argument("--trace", help="JSONL of {prompt_len, output_len} per request")
    work.add_argument("--seed", type=int, default=0)
    arrivals = parser.add_argument_group("arrivals")
    arrivals.add_argument("--rate", type=float, default=math.inf, help="requests per second (default: all at once)")
    arrivals.add_argument("--rates", help="comma-separated rates: one run each")
    arrivals.add_argument("--goodput", action="store_true", help="binary-search the highest rate meeting --target")
    arrivals.add_argument("--rate-low", type=float, default=0.5, help="goodput search bounds (req/s)")
    arrivals.add_argument("--rate-high", type=float, default=64.0)
    arrivals.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    arrivals.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    slo = parser.add_argument_group("SLOs")
    slo.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds")
    slo.add_argument("--slo-tpot", type=float, help="TPOT SLO in seconds")
    slo.add_argument("--target", type=float, default=0.9, help="attainment target of the goodput (default: 0.9)")
    out = parser.add_argument_group("output")
    out.add_argument("--result-json", help="write every run's figures here")
    out.add_argument("--plot-dir", help="write attainment-vs-rate and attainment-vs-SLO-scale PNGs here")
    out.add_argument(
        "--trace-out",
        help="write each request's server-side timeline (queue, prefill batch, hand-over, KV pull, every "
        "decode step) here as JSON lines; with several runs, one file per rate (NAME-rateR.jsonl)",
    )
    out.add_argument("--label", default="server", help="name of this deployment in the JSON and plots")
    out.add_argument("--no-progress", action="store_true")


def _workload(args: argparse.Namespace, client) -> list[RequestSpec]:
    if args.trace:
        return load_length_trace(args.trace)[: args.num_requests]
    if args.dataset:
        from distserve.entrypoints.client import Client

        # Lengths in the server's tokens; load_sharegpt counts only the texts it keeps.
        with Client(client.address, **client.options) as tokenizer:
            return load_sharegpt(
                args.dataset,
                lambda text: len(tokenizer.tokenize(text, add_special_tokens=False)),
                args.num_requests,
                args.seed,
            )
    prompt, output = parse_length(args.prompt_len), parse_length(args.output_len)
    return synthetic_workload(args.num_requests, prompt, output, args.seed)


async def run_bench(args: argparse.Namespace, client) -> dict:
    """Every run the arguments ask for; the JSON-ready results."""
    from distserve.benchmark.runner import run_workload
    from distserve.benchmark.trace import write_trace

    slo = SLO(args.slo_ttft, args.slo_tpot) if args.slo_ttft and args.slo_tpot else None
    if args.goodput and slo is None:
        raise ValueError("--goodput needs --slo-ttft and --slo-tpot")
    specs = _workload(args, client)
    info = await client.cluster_info()
    runs: list[tuple[float, BenchResult, list[RequestRecord]]] = []

    async def run(rate: float) -> BenchResult:
        records = await run_workload(
            client,
            specs,
            rate,
            args.burstiness,
            args.max_concurrency,
            args.seed,
            info.vocab_size,
            progress=not args.no_progress,
            timelines=bool(args.trace_out),
        )
        result = summarize(records, slo, rate)
        runs.append((rate, result, records))
        print(f"\n== {args.label}, rate {rate:g} req/s ==\n{format_result(result)}", flush=True)
        if args.trace_out:
            several = args.goodput or bool(args.rates and "," in args.rates)
            print(f"timelines: {write_trace(args.trace_out, rate, several, records)}", flush=True)
        return result

    goodput = None
    if args.goodput:
        loop = asyncio.get_running_loop()
        goodput, _ = await _find_goodput_async(loop, run, args)
        print(
            f"\n{args.label}: goodput {goodput:.3g} req/s at {args.target:.0%} attainment "
            f"(TTFT <= {slo.ttft:g} s, TPOT <= {slo.tpot:g} s)"
        )
    else:
        for rate in [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]:
            await run(rate)

    results = {
        "label": args.label,
        "model": info.model,
        "workload": {
            "num_requests": len(specs),
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "dataset": args.dataset,
            "trace": args.trace,
            "burstiness": args.burstiness,
        },
        "slo": None if slo is None else {"ttft": slo.ttft, "tpot": slo.tpot},
        "target": args.target,
        "goodput": goodput,
        "runs": [result.to_dict() for _, result, _ in runs],
    }
    if slo is not None:
        # Attainment of the fastest run that met the target (else the slowest) under scaled SLOs.
        met = [r for r in runs if r[1].attainment.both >= args.target]
        rate, _, records = max(met, key=lambda r: r[0]) if met else min(runs, key=lambda r: r[0])
        results["slo_scale"] = {
            "rate": rate,
            "points": [[s, attainment(records, slo.scaled(s)).both] for s in SLO_SCALES],
        }
    return results


async def _find_goodput_async(loop, run, args):
    """``find_goodput`` probes synchronously; each probe is a run on this loop, from a thread."""

    def measure(rate: float) -> float:
        return asyncio.run_coroutine_threadsafe(run(rate), loop).result().attainment.both

    return await loop.run_in_executor(None, find_goodput, measure, args.target, args.rate_low, args.rate_high)


def write_outputs(results: dict, result_json: str | None, plot_dir: str | None) -> None:
    if result_json:
        Path(result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(result_json).write_text(json.dumps(results, indent=2))
        print(f"results: {result_json}")
    if plot_dir and results["slo"] is not None:
        from placement.plots import plot_attainment_vs_rate, plot_attainment_vs_slo_scale

        label = results["label"]
        # An all-at-once run ("inf") has no place on a rate axis.
        by_rate = sorted(
            (run["rate"], run["attainment"]["both"]) for run in results["runs"] if isinstance(run["rate"], float)
        )
        paths = [
            plot_attainment_vs_rate({label: by_rate}, results["target"], Path(plot_dir) / f"{label}-rate.png"),
            plot_attainment_vs_slo_scale(
                {label: results["slo_scale"]["points"]}, results["target"], Path(plot_dir) / f"{label}-slo-scale.png"
            ),
        ]
        print("plots:", ", ".join(map(str, paths)))


def cmd_bench(args: argparse.Namespace, make_client) -> int:
    """``make_client()`` gives the AsyncClient; it is made on the benchmark's own event loop."""

    async def main() -> dict:
        async with make_client() as client:
            return await run_bench(args, client)

    write_outputs(asyncio.run(main()), args.result_json, args.plot_dir)
    return 0
