"""Goodput of per-request disaggregation (``cluster.local_prefill`` on and auto) against always
disaggregating (off), on 1 prefill + 1 decode instance of this machine.

    python scripts/experiments/exp_local_prefill.py [--rates 0.8,1.2,1.6,2.0] [--requests 80] [--out DIR]

One cluster (llama-58m, dummy weights, one torch thread per instance) serves a workload that mixes
short prompts and long ones (``--classes``, half each by default); the mode is set on the running
cluster between probes, so every mode runs on the same instances, at each rate in another order.
Every probe draws its own Poisson arrivals and its own random prompts (``--seed`` + probe number),
so no mode is measured on arrivals another was. SLOs come from the cluster unloaded, always
disaggregated: ``--ttft-scale`` x the median TTFT of a long prompt and ``--tpot-scale`` x the median
TPOT, each request measured alone. A request meets them when its TTFT and its TPOT are both within;
goodput is the highest rate of the grid at which, and at every rate below which, ``--target`` of
the requests do. The report counts each mode's local prefills and splits TTFT by class.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from distserve.core.local_prefill import LOCAL_PREFILL_MODES, LocalPrefillConfig
from distserve.core.slo import RequestSLO

LLAMA_58M_DIR = "model"


def parse_classes(spec: str) -> dict[str, tuple[int, int, int]]:
    """``name:lo-hi:out,...`` -> {name: (prompt lo, prompt hi, output tokens)}."""
    classes = {}
    for part in spec.split(","):
        name, prompt, out = part.split(":")
        lo, hi = prompt.split("-")
        classes[name] = (int(lo), int(hi), int(out))
    return classes


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one(cluster, prompt: list[int], max_tokens: int, delay: float, cls: str, slo) -> dict:
    from distserve import SamplingParams

    await asyncio.sleep(delay)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for output in cluster.generate(prompt, params, slo=slo):
        last = output
    m = last.metrics
    return {"class": cls, "ttft": m.ttft, "tpot": m.tpot, "local": m.local_prefill,
            "queue": m.prefill_start - m.arrival_time,
            "batch_ms_per_1k": (m.prefill_end - m.prefill_start) / m.prefill_batch_tokens * 1e6}  # fmt: skip


async def probe(cluster, classes, rate: float, n: int, seed: int, vocab: int, slo=None) -> list[dict]:
    """``n`` requests, classes drawn evenly, Poisson arrivals at ``rate`` (inf: all at once), each
    carrying ``slo`` (a ``RequestSLO``)."""
    rng = random.Random(seed)
    names = list(classes)
    delays, t = [], 0.0
    for _ in range(n):
        delays.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    jobs = []
    for delay in delays:
        cls = rng.choice(names)
        lo, hi, out = classes[cls]
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))]
        jobs.append(one(cluster, prompt, out, delay, cls, slo))
    return await asyncio.gather(*jobs)


async def stall_counts(cluster) -> dict[str, int]:
    """Prefill steps held back by KV waiting to be pulled; hand-overs that waited for decode blocks."""
    infos = await cluster.info()
    return {"throttled_steps": sum(i.num_throttled_steps for i in infos),
            "admission_waits": sum(i.num_admission_waits for i in infos)}  # fmt: skip


def summarize(records: list[dict], slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r["ttft"] <= slo_ttft and r["tpot"] <= slo_tpot for r in records]
    summary = {
        "attainment": sum(ok) / len(ok),
        "ttft_met": sum(r["ttft"] <= slo_ttft for r in records) / len(records),
        "tpot_met": sum(r["tpot"] <= slo_tpot for r in records) / len(records),
        "local_prefills": sum(r["local"] for r in records),
        "requests": len(records),
        "tpot_p90": percentile([r["tpot"] for r in records], 0.9),
    }
    for cls in sorted({r["class"] for r in records}):
        ttfts = [r["ttft"] for r in records if r["class"] == cls]
        summary[f"ttft_p50_{cls}"], summary[f"ttft_p90_{cls}"] = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
        # A TTFT is the wait for a prefill batch and the batch: the batch's time per token says how
        # fast its instance computed, beside whatever else ran.
        mine = [r for r in records if r["class"] == cls]
        summary[f"queue_p50_{cls}"] = percentile([r["queue"] for r in mine], 0.5)
        summary[f"batch_ms_per_1k_{cls}"] = percentile([r["batch_ms_per_1k"] for r in mine], 0.5)
    return summary


def goodput(by_rate: dict[float, dict], target: float) -> float:
    """The highest rate at which, and below which everywhere, ``target`` of the requests met both SLOs."""
    best = 0.0
    for rate in sorted(by_rate):
        if by_rate[rate]["attainment"] < target:
            break
        best = rate
    return best


async def run(args: argparse.Namespace) -> dict:
    from distserve import AsyncCluster
    from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape

    classes = parse_classes(args.classes)
    model = str(write_llama_shape(args.out / LLAMA_58M_DIR, **BENCH_LLAMA_SHAPE))
    # The decode instance runs the prompts it prefills in chunks beside its decode tokens, each
    # step's chunk cut to the decoding requests' TPOT SLO: what keeps its decoding within the SLO.
    decode = {"enable_chunked_prefill": True, "tpot_aware_chunking": True,
              "max_num_batched_tokens": args.decode_chunk_tokens} if args.decode_chunk_tokens else {}  # fmt: skip
    cluster = await AsyncCluster.start(model=model, load_format="dummy", num_kv_blocks=1024,
                                       cpu_threads=args.cpu_threads, prefill={}, decode=decode)  # fmt: skip
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    try:
        await probe(cluster, classes, 2.0, 8, args.seed - 1, vocab)  # warm up both instances
        alone = []
        for i in range(args.calibration):  # one request at a time, always disaggregated
            alone += await probe(cluster, classes, float("inf"), 1, args.seed + 10_000 + i, vocab)
        long_ttfts = [r["ttft"] for r in alone if r["class"] == args.long_class]
        slo_ttft = args.ttft_scale * statistics.median(long_ttfts)
        slo_tpot = args.tpot_scale * statistics.median(r["tpot"] for r in alone)
        print(f"SLOs: TTFT {slo_ttft * 1e3:.0f} ms, TPOT {slo_tpot * 1e3:.1f} ms", flush=True)
        slo = RequestSLO(slo_ttft, slo_tpot)
        results: dict[str, dict[float, dict]] = {mode: {} for mode in args.modes}
        probe_number = 0
        for i, rate in enumerate(args.rates):
            order = args.modes[i % len(args.modes) :] + args.modes[: i % len(args.modes)]
            for mode in order:
                cluster.orchestrator.config.local_prefill = LocalPrefillConfig(mode, args.max_tokens)
                probe_number += 1
                start, before = time.monotonic(), await stall_counts(cluster)
                records = await probe(cluster, classes, rate, args.requests, args.seed + probe_number, vocab, slo)
                results[mode][rate] = summary = summarize(records, slo_ttft, slo_tpot)
                after = await stall_counts(cluster)
                summary.update({key: after[key] - before[key] for key in after})
                print(f"rate {rate:g} {mode:>4}: {summary['attainment']:.1%} both, {summary['local_prefills']} local,"
                      f" {time.monotonic() - start:.0f} s", flush=True)  # fmt: skip
    finally:
        await cluster.shutdown()
    return {"slo_ttft": slo_ttft, "slo_tpot": slo_tpot, "results": results,
            "goodput": {mode: goodput(results[mode], args.target) for mode in args.modes}}  # fmt: skip


def headline(summary: dict, args: argparse.Namespace) -> str:
    """The SLOs and each mode's goodput, a report's first line."""
    goodputs = ", ".join(f"{mode} {rate:g} req/s" for mode, rate in summary["goodput"].items())
    return (f"SLOs: TTFT {summary['slo_ttft'] * 1e3:.0f} ms, TPOT {summary['slo_tpot'] * 1e3:.1f} ms; "
            f"goodput at {args.target:.0%}: {goodputs}")  # fmt: skip


def rate_table(summary: dict, args: argparse.Namespace, columns: list[str], cells: Callable[[dict], list]) -> str:
    """A report: the headline, then a row per rate and mode of ``columns``, ``cells(summary of the probe)``."""
    lines = [headline(summary, args), "", "| " + " | ".join(["rate", "mode", *columns]) + " |",
             "|" + "---|" * (len(columns) + 2)]  # fmt: skip
    for rate in args.rates:
        for mode, by_rate in summary["results"].items():
            lines.append("| " + " | ".join([f"{rate:g}", mode, *map(str, cells(by_rate[rate]))]) + " |")
    return "\n".join(lines)


def report(summary: dict, args: argparse.Namespace) -> str:
    short, long = args.short_class, args.long_class
    columns = ["both SLOs", "TTFT met", "TPOT met", "local prefills", "TTFT p90 short / long (ms)", "TPOT p90 (ms)",
               "prefill steps held back"]  # fmt: skip

    def cells(s: dict) -> list:
        return [
            f"{s['attainment']:.1%}",
            f"{s['ttft_met']:.1%}",
            f"{s['tpot_met']:.1%}",
            f"{s['local_prefills']}/{s['requests']}",
            f"{s[f'ttft_p90_{short}'] * 1e3:.0f} / {s[f'ttft_p90_{long}'] * 1e3:.0f}",
            f"{s['tpot_p90'] * 1e3:.1f}",
            s["throttled_steps"],
        ]

    return rate_table(summary, args, columns, cells)


def add_run_args(p: argparse.ArgumentParser, calibration: int, out: str) -> None:
    """The SLO, goodput and run arguments of a goodput experiment."""
    p.add_argument("--ttft-scale", type=float, default=3.0)
    p.add_argument("--tpot-scale", type=float, default=2.0)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--calibration", type=int, default=calibration, help="requests measured alone for the SLOs")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads per instance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(out))


def run_and_report(args: argparse.Namespace, run, report) -> None:
    """Run the experiment, write ``summary.json`` and ``report.md`` under ``--out``, print the report."""
    args.out.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(run(args))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = report(summary, args)
    (args.out / "report.md").write_text(text + "\n")
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.8, 1.2, 1.6, 2.0])
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(LOCAL_PREFILL_MODES))
    p.add_argument("--requests", type=int, default=80, help="requests per probe")
    p.add_argument("--classes", default="short:16-128:64,long:384-768:32")
    p.add_argument("--short-class", default="short")
    p.add_argument("--long-class", default="long")
    p.add_argument("--max-tokens", type=int, default=LocalPrefillConfig.max_tokens, help="local_prefill.max_tokens")
    p.add_argument("--decode-chunk-tokens", type=int, default=256,
                   help="the decode instance's chunk budget, cut to the TPOT SLO; 0: prefill-first")  # fmt: skip
    add_run_args(p, calibration=8, out="results/local-prefill")
    run_and_report(p.parse_args(), run, report)


if __name__ == "__main__":
    main()
