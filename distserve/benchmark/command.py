"""``distserve bench``: a serving benchmark through the gRPC frontend, one rate, a sweep of rates
or a goodput search, with JSON results and attainment plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections import Counter
from pathlib import Path

from distserve.benchmark.metrics import (
    SLO,
    BenchResult,
    RequestRecord,
    attainment,
    format_result,
    summarize,
)
from distserve.v1 import distserve_pb2 as pb
from placement.goodput import find_goodput
from placement.workload import (
    RequestSpec,
    load_length_trace,
    load_sharegpt,
    parse_length,
    synthetic_workload,
)

SLO_SCALES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)

# Filled in by check_bench_args, after the checks: a flag left out can then be told from one given.
DEFAULTS = {
    "prompt_len": "lognormal:256:0.5,max=768",
    "output_len": "lognormal:64:0.5,max=256",
    "rate": math.inf,
    "rate_low": 0.5,
    "rate_high": 64.0,
    "burstiness": 1.0,
    "target": 0.9,
}
# Pairs of flags of which one would be ignored.
EXCLUSIVE = [
    ("rate", "rates"),
    ("goodput", "rate"),
    ("goodput", "rates"),
    ("trace", "dataset"),
    ("trace", "prompt_len"),
    ("trace", "output_len"),
    ("dataset", "prompt_len"),
    ("dataset", "output_len"),
]
_SLOS = "--slo-ttft and --slo-tpot"
# A flag that does nothing without one of some others: (flag, those others, what the message says).
NEEDS = [
    ("goodput", {"slo_ttft"}, f"{_SLOS} (the SLOs whose attainment it searches)"),
    ("plot_dir", {"slo_ttft"}, f"{_SLOS} (the plots show SLO attainment)"),
    ("target", {"slo_ttft"}, f"{_SLOS} (it is a target of SLO attainment)"),
    ("rate_low", {"goodput"}, "--goodput (it bounds the goodput search)"),
    ("rate_high", {"goodput"}, "--goodput (it bounds the goodput search)"),
    ("burstiness", {"rate", "rates", "goodput"}, "--rate, --rates or --goodput (without, all requests arrive at once)"),
]


class AllRequestsFailed(Exception):
    """A run in which no request succeeded: it has no figures to show."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=200, help="requests per run (default: 200)")
    work.add_argument(
        "--prompt-len",
        help="prompt lengths: N, uniform:LO:HI or lognormal:MEAN:SIGMA, with ,max=N "
        f"(default: {DEFAULTS['prompt_len']})",
    )
    work.add_argument("--output-len", help=f"output lengths, same forms (default: {DEFAULTS['output_len']})")
    work.add_argument("--dataset", help="ShareGPT-format JSON: lengths of its first exchanges (server's tokenizer)")
    work.add_argument("--trace", help="JSONL of {prompt_len, output_len} per request")
    work.add_argument("--seed", type=int, default=0, help="seed of the lengths and arrival times (default: 0)")
    arrivals = parser.add_argument_group("arrivals")
    arrivals.add_argument("--rate", type=float, help="requests per second (default: all at once)")
    arrivals.add_argument("--rates", help="comma-separated rates: one run each ('inf': all at once)")
    arrivals.add_argument("--goodput", action="store_true", help="binary-search the highest rate meeting --target")
    arrivals.add_argument(
        "--rate-low", type=float, help=f"lower bound of the goodput search, req/s (default: {DEFAULTS['rate_low']})"
    )
    arrivals.add_argument(
        "--rate-high", type=float, help=f"upper bound of the goodput search, req/s (default: {DEFAULTS['rate_high']})"
    )
    arrivals.add_argument(
        "--burstiness", type=float, help=f"gamma shape of the gaps; 1 is Poisson (default: {DEFAULTS['burstiness']})"
    )
    arrivals.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    slo = parser.add_argument_group("SLOs")
    slo.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds (with --slo-tpot)")
    slo.add_argument("--slo-tpot", type=float, help="TPOT SLO in seconds (with --slo-ttft)")
    slo.add_argument(
        "--target", type=float, help=f"attainment target of the goodput and plots (default: {DEFAULTS['target']})"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--result-json", help="write every run's figures here")
    out.add_argument("--plot-dir", help="write attainment-vs-rate and attainment-vs-SLO-scale PNGs here (needs SLOs)")
    out.add_argument(
        "--trace-out",
        help="write each request's server-side timeline (queue, prefill batch, hand-over, KV pull, every "
        "decode step) here as JSON lines; with several runs, one file per rate (NAME-rateR.jsonl)",
    )
    out.add_argument(
        "--label",
        help="name of this deployment in the printout, JSON, plot titles and plot file names "
        "(default: the server's instances, e.g. '1 prefill TP1 + 1 decode TP1'; files: server-*.png)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_bench_args(args: argparse.Namespace) -> None:
    """Refuse flags that would be ignored or contradict each other, in one sentence and before any
    request is sent; then fill in the defaults and parse ``--rates`` into a list (or None)."""
    given = {name for name, value in vars(args).items() if value is not None and value is not False}
    if ("slo_ttft" in given) != ("slo_tpot" in given):
        raise ValueError(f"{_SLOS} go together: give both or neither")
    for a, b in EXCLUSIVE:
        if {a, b} <= given:
            raise ValueError(f"{_flag(a)} and {_flag(b)} exclude each other: give one of them")
    for name, others, needed in NEEDS:
        if name in given and not others & given:
            raise ValueError(f"{_flag(name)} needs {needed}")
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rates is not None:
        try:
            args.rates = [float(rate) for rate in args.rates.split(",")]
        except ValueError:
            raise ValueError(f"--rates takes comma-separated numbers, got '{args.rates}'") from None
    if not all(rate > 0 for rate in args.rates or [args.rate]):
        raise ValueError("rates must be above 0 requests per second")


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


def deployment(info: pb.ClusterInfo) -> str:
    """The server's instances by role and layout, e.g. "1 prefill TP2 + 2 decode TP1xPP2"."""
    counts = Counter(
        (pb.Role.Name(i.role).removeprefix("ROLE_").lower(), i.tensor_parallel_size, i.pipeline_parallel_size)
        for i in info.instances
    )
    return " + ".join(f"{n} {role} TP{tp}" + (f"xPP{pp}" if pp > 1 else "") for (role, tp, pp), n in counts.items())


async def run_bench(args: argparse.Namespace, client) -> dict:
    """Every run the arguments (checked by ``check_bench_args``) ask for; the JSON-ready results.
    Raises ``AllRequestsFailed`` at the first run in which no request succeeded."""
    from distserve.benchmark.runner import run_workload
    from distserve.benchmark.trace import write_trace

    slo = SLO(args.slo_ttft, args.slo_tpot) if args.slo_ttft is not None else None
    specs = _workload(args, client)
    info = await client.cluster_info()
    label = args.label or deployment(info)
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
        if result.num_ok == 0:
            at = "sent at once" if math.isinf(rate) else f"at {rate:g} req/s"
            raise AllRequestsFailed(f"all {len(records)} requests {at} failed, the first with {result.first_error}")
        runs.append((rate, result, records))
        print(f"\n== {label}, rate {rate:g} req/s ==\n{format_result(result)}", flush=True)
        if args.trace_out:
            several = args.goodput or len(args.rates or []) > 1
            print(f"timelines: {write_trace(args.trace_out, rate, several, records)}", flush=True)
        return result

    goodput = None
    if args.goodput:
        loop = asyncio.get_running_loop()
        goodput, _ = await _find_goodput_async(loop, run, args)
        print(
            f"\n{label}: goodput {goodput:.3g} req/s at {args.target:.0%} attainment "
            f"(TTFT <= {slo.ttft:g} s, TPOT <= {slo.tpot:g} s)"
        )
    else:
        for rate in args.rates or [args.rate]:
            await run(rate)

    results = {
        "label": label,
        "model": info.model,
        "deployment": deployment(info),
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


def write_outputs(results: dict, result_json: str | None, plot_dir: str | None, name: str) -> None:
    """The JSON results, and the plots as ``NAME-rate.png`` and ``NAME-slo-scale.png``."""
    if result_json:
        Path(result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(result_json).write_text(json.dumps(results, indent=2))
        print(f"results: {result_json}")
    if plot_dir:
        from placement.plots import plot_attainment_vs_rate, plot_attainment_vs_slo_scale

        label, slo = results["label"], results["slo"]
        title = f"{results['model']} on {label}\nSLOs: TTFT {slo['ttft']:g} s, TPOT {slo['tpot']:g} s"
        # An all-at-once run ("inf") has no place on a rate axis.
        by_rate = sorted(
            (run["rate"], run["attainment"]["both"]) for run in results["runs"] if isinstance(run["rate"], float)
        )
        target, directory = results["target"], Path(plot_dir)
        paths = [
            plot_attainment_vs_rate({label: by_rate}, target, directory / f"{name}-rate.png", title),
            plot_attainment_vs_slo_scale(
                {label: results["slo_scale"]["points"]}, target, directory / f"{name}-slo-scale.png", title
            ),
        ]
        print("plots:", ", ".join(map(str, paths)))


def cmd_bench(args: argparse.Namespace, make_client) -> int:
    """``make_client()`` gives the AsyncClient; it is made on the benchmark's own event loop. A run in
    which every request failed ends the command: its first error on stderr, exit status 1."""
    check_bench_args(args)

    async def main() -> dict:
        async with make_client() as client:
            return await run_bench(args, client)

    try:
        results = asyncio.run(main())
    except AllRequestsFailed as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 1
    write_outputs(results, args.result_json, args.plot_dir, args.label or "server")
    return 0
