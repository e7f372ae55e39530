"""Preemption by swap against recompute under KV pressure, on 1 prefill + 1 decode instance.

    python scripts/experiments/exp_swap.py [--rates 1,2,3] [--requests 40] [--out DIR]

Two clusters of this machine (llama-58m, dummy weights, one torch thread per instance) alike but
for the decode pool's ``swap_space``: 0 (a preempted request is recomputed) and ``--swap-space``
GiB (swapped out where that costs less). The decode instance's KV pool (``--decode-blocks``) holds
a small share of what the requests in flight need at the higher rates, so decoding requests are
preempted again and again. Both clusters run at once, idle in turn: at each rate each serves its
own probe, in alternating order. Every probe draws its own Poisson arrivals and random prompts
(``--seed`` + probe number); the two modes see the same ones at a rate. SLOs come from the
recompute cluster unloaded: ``--ttft-scale`` x the median TTFT and ``--tpot-scale`` x the median
TPOT of requests measured alone. Goodput is the highest rate of the grid at which, and at every
rate below which, ``--target`` of the requests meet both. The report counts preemptions, swaps
and recomputes, and checks that nothing stays in use. ``--no-prefix-caching`` turns the decode
instances' prefix cache off, so that a recompute computes every token again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from exp_local_prefill import add_run_args, goodput, parse_classes, probe, rate_table, run_and_report, summarize

from distserve.core.slo import RequestSLO

MODES = ("recompute", "swap")


async def counts(cluster) -> dict[str, float]:
    infos = await cluster.info()
    return {
        "preemptions": sum(i.num_preemptions for i in infos),
        "swap_outs": sum(i.num_swap_outs for i in infos),
        "swap_ins": sum(i.num_swap_ins for i in infos),
        "swap_seconds": sum(i.swap_seconds for i in infos),
    }


async def settles_idle(cluster, timeout: float = 10.0) -> bool:
    """Whether nothing is in use within ``timeout`` seconds (a finished request's blocks go on its
    instance's next step): every block free, nothing queued, running, swapped or held."""
    deadline = time.monotonic() + timeout
    while True:
        infos = await cluster.info()
        if all(i.num_free_blocks == i.num_blocks and not (i.num_waiting or i.num_running or i.num_held
                                                           or i.num_swapped) for i in infos):  # fmt: skip
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace) -> dict:
    from distserve import AsyncCluster
    from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape

    classes = parse_classes(args.classes)
    model = str(write_llama_shape(args.out / "model", **BENCH_LLAMA_SHAPE))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    clusters = {}
    for mode in MODES:
        decode = {"num_kv_blocks": args.decode_blocks, "swap_space": args.swap_space if mode == "swap" else 0.0,
                  "enable_prefix_caching": not args.no_prefix_caching}  # fmt: skip
        clusters[mode] = await AsyncCluster.start(model=model, load_format="dummy", num_kv_blocks=1024,
                                                  cpu_threads=args.cpu_threads, prefill={}, decode=decode)  # fmt: skip
    try:
        for cluster in clusters.values():
            await probe(cluster, classes, 2.0, 4, args.seed - 1, vocab)  # warm up
        alone = []
        for i in range(args.calibration):
            alone += await probe(clusters["recompute"], classes, float("inf"), 1, args.seed + 10_000 + i, vocab)
        slo_ttft = args.ttft_scale * statistics.median(r["ttft"] for r in alone)
        slo_tpot = args.tpot_scale * statistics.median(r["tpot"] for r in alone)
        print(f"SLOs: TTFT {slo_ttft * 1e3:.0f} ms, TPOT {slo_tpot * 1e3:.1f} ms", flush=True)
        slo = RequestSLO(slo_ttft, slo_tpot)
        results: dict[str, dict[float, dict]] = {mode: {} for mode in MODES}
        for i, rate in enumerate(args.rates):
            for mode in MODES[i % 2 :] + MODES[: i % 2]:
                cluster, start = clusters[mode], time.monotonic()
                before = await counts(cluster)
                records = await probe(cluster, classes, rate, args.requests, args.seed + i, vocab, slo)
                summary = results[mode][rate] = summarize(records, slo_ttft, slo_tpot)
                after = await counts(cluster)
                summary.update({key: after[key] - before[key] for key in after})
                summary["idle"] = await settles_idle(cluster)
                print(f"rate {rate:g} {mode:>9}: {summary['attainment']:.1%} both, {summary['preemptions']} preempted,"
                      f" {summary['swap_outs']} swapped, {time.monotonic() - start:.0f} s", flush=True)  # fmt: skip
    finally:
        for cluster in clusters.values():
            await cluster.shutdown()
    return {"slo_ttft": slo_ttft, "slo_tpot": slo_tpot, "results": results,
            "goodput": {mode: goodput(results[mode], args.target) for mode in MODES}}  # fmt: skip


def report(summary: dict, args: argparse.Namespace) -> str:
    columns = ["both SLOs", "TTFT met", "TPOT met", "TPOT p90 (ms)", "preemptions", "swapped out / in",
               "swap copies s", "nothing in use after"]  # fmt: skip

    def cells(s: dict) -> list:
        return [
            f"{s['attainment']:.1%}",
            f"{s['ttft_met']:.1%}",
            f"{s['tpot_met']:.1%}",
            f"{s['tpot_p90'] * 1e3:.1f}",
            s["preemptions"],
            f"{s['swap_outs']} / {s['swap_ins']}",
            f"{s['swap_seconds']:.3f}",
            "yes" if s["idle"] else "no",
        ]

    return rate_table(summary, args, columns, cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 3.0])
    p.add_argument("--requests", type=int, default=40, help="requests per probe")
    p.add_argument("--classes", default="chat:128-384:128")
    p.add_argument("--decode-blocks", type=int, default=48, help="the decode instance's KV blocks (of 16 tokens)")
    p.add_argument("--swap-space", type=float, default=0.5, help="GiB of the swap cluster's decode swap space")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="decode instances without a prefix cache: a recompute computes every token again")  # fmt: skip
    add_run_args(p, calibration=6, out="results/swap")
    run_and_report(p.parse_args(), run, report)


if __name__ == "__main__":
    main()
