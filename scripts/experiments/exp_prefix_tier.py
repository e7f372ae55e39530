"""Multi-turn chat with and without the shared prefix tier, on 2 prefill + 1 decode and on 1 + 1.

    python scripts/experiments/exp_prefix_tier.py [--rates 0.5,1,1.5] [--conversations 16] [--out DIR]

Four clusters of this machine (llama-58m, dummy weights, one torch thread per instance), started
together and probed in turn, at each rate in another order: 2P+1D and 1P+1D, each with
``cache.kv_tier_space`` ``--tier-space`` GiB and without a tier. A probe is ``--conversations``
conversations starting at Poisson arrivals of ``rate`` a second; each re-sends its whole history
every turn: a system prompt all of them share, then its user messages and the answers so far,
and the new user message; a turn is sent a think time (exponential, mean ``--think`` s) after the
previous answer ended. Every probe draws its own system prompt, messages and arrivals (``--seed``
+ probe number); the four clusters see the same ones at a rate. SLOs come from the 1P+1D cluster
without a tier, unloaded: ``--ttft-scale`` x the median TTFT of a prompt of a turn's mean length
computed from scratch, and ``--tpot-scale`` x the median TPOT. Goodput is the highest rate of the
grid at which, and at every rate below which, ``--target`` of the turns meet both. The report
gives TTFT p50/p90, TPOT p90, the prompt tokens the instances computed against those they were
sent (prefix cache and tier hits left out), the tier's share of the hits, and checks that nothing
stays in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from exp_local_prefill import add_run_args, goodput, percentile, rate_table, run_and_report
from exp_swap import settles_idle

from distserve.core.slo import RequestSLO

LAYOUTS = {"2P+1D": {"prefill": {"instances": 2}, "decode": {}}, "1P+1D": {"prefill": {}, "decode": {}}}


MODES = [f"{layout} {tier}" for layout in LAYOUTS for tier in ("tier", "no tier")]


async def turn(cluster, prompt: list[int], max_tokens: int, slo) -> tuple[dict, list[int]]:
    from distserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for output in cluster.generate(prompt, params, slo=slo):
        last = output
    m = last.metrics
    return {
        "ttft": m.ttft,
        "tpot": m.tpot,
        "prompt": len(prompt),
        "cached": last.num_cached_tokens,
    }, last.output_token_ids


async def conversation(cluster, rng: random.Random, system: list[int], start: float, args, vocab, slo) -> list[dict]:
    await asyncio.sleep(start)
    history, records = list(system), []
    for _ in range(args.turns):
        history += [rng.randrange(10, vocab) for _ in range(rng.randint(*args.user_tokens))]
        record, answer = await turn(cluster, history, args.answer_tokens, slo)
        records.append(record)
        history += answer
        await asyncio.sleep(rng.expovariate(1 / args.think))
    return records


async def probe(cluster, rate: float, seed: int, args, vocab: int, slo=None) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(args.system_tokens)]
    starts, t = [], 0.0
    for _ in range(args.conversations):
        starts.append(t)
        t += rng.expovariate(rate)
    rngs = [random.Random(rng.random()) for _ in starts]
    done = await asyncio.gather(*(conversation(cluster, r, system, s, args, vocab, slo) for r, s in zip(rngs, starts)))
    return [record for records in done for record in records]


async def prompt_counts(cluster) -> dict[str, int]:
    infos = await cluster.info()
    return {"sent": sum(i.prompt_tokens for i in infos), "cached": sum(i.cached_prompt_tokens for i in infos),
            "tier": sum(i.tier_hit_tokens for i in infos)}  # fmt: skip


def summarize(records: list[dict], slo_ttft: float, slo_tpot: float) -> dict:
    ttfts = [r["ttft"] for r in records]
    return {
        "attainment": sum(r["ttft"] <= slo_ttft and r["tpot"] <= slo_tpot for r in records) / len(records),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "tpot_p90": percentile([r["tpot"] for r in records], 0.9),
        "turns": len(records),
    }


async def run(args: argparse.Namespace) -> dict:
    from distserve import AsyncCluster
    from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape

    model = str(write_llama_shape(args.out / "model", **BENCH_LLAMA_SHAPE))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    clusters = {}
    for mode in MODES:
        layout, tier = mode.split(" ", 1)
        clusters[mode] = await AsyncCluster.start(
            model=model, load_format="dummy", num_kv_blocks=args.blocks, cpu_threads=args.cpu_threads,
            kv_tier_space=args.tier_space if tier == "tier" else 0.0, **LAYOUTS[layout],
        )  # fmt: skip
    baseline = clusters["1P+1D no tier"]
    try:
        for cluster in clusters.values():  # warm up
            await probe(cluster, 2.0, args.seed - 1, argparse.Namespace(**{**vars(args), "conversations": 2}), vocab)
        # Turn k of T sends the system prompt, k user messages and k - 1 answers.
        user = sum(args.user_tokens) / 2
        mean_turn = args.system_tokens + user * (args.turns + 1) / 2 + args.answer_tokens * (args.turns - 1) / 2
        alone = []
        for i in range(args.calibration):  # one prompt of a turn's mean length, nothing of it cached
            rng = random.Random(args.seed + 10_000 + i)
            prompt = [rng.randrange(10, vocab) for _ in range(int(mean_turn))]
            alone.append((await turn(baseline, prompt, args.answer_tokens, None))[0])
        slo_ttft = args.ttft_scale * statistics.median(r["ttft"] for r in alone)
        slo_tpot = args.tpot_scale * statistics.median(r["tpot"] for r in alone)
        print(f"SLOs: TTFT {slo_ttft * 1e3:.0f} ms, TPOT {slo_tpot * 1e3:.1f} ms", flush=True)
        slo = RequestSLO(slo_ttft, slo_tpot)
        names = MODES
        results: dict[str, dict[float, dict]] = {mode: {} for mode in names}
        for i, rate in enumerate(args.rates):
            for mode in names[i % len(names) :] + names[: i % len(names)]:
                cluster, start = clusters[mode], time.monotonic()
                before = await prompt_counts(cluster)
                records = await probe(cluster, rate, args.seed + i, args, vocab, slo)
                summary = results[mode][rate] = summarize(records, slo_ttft, slo_tpot)
                after = await prompt_counts(cluster)
                counts = {key: after[key] - before[key] for key in after}
                summary.update(prompt_tokens=counts["sent"], computed=counts["sent"] - counts["cached"],
                               tier_hits=counts["tier"], idle=await settles_idle(cluster))  # fmt: skip
                print(f"rate {rate:g} {mode:>14}: {summary['attainment']:.1%} both, TTFT p90 "
                      f"{summary['ttft_p90'] * 1e3:.0f} ms, computed {summary['computed']}/{counts['sent']}, "
                      f"{time.monotonic() - start:.0f} s", flush=True)  # fmt: skip
        tiers = {mode: [vars(t) for t in await clusters[mode].tier_info()] for mode in names}
    finally:
        for cluster in clusters.values():
            await cluster.shutdown()
    return {"slo_ttft": slo_ttft, "slo_tpot": slo_tpot, "results": results, "tiers": tiers,
            "goodput": {mode: goodput(results[mode], args.target) for mode in names}}  # fmt: skip


def report(summary: dict, args: argparse.Namespace) -> str:
    columns = ["both SLOs", "TTFT p50 (ms)", "TTFT p90 (ms)", "TPOT p90 (ms)", "prompt tokens computed / sent",
               "from the tier", "nothing in use after"]  # fmt: skip

    def cells(s: dict) -> list:
        return [
            f"{s['attainment']:.1%}",
            f"{s['ttft_p50'] * 1e3:.0f}",
            f"{s['ttft_p90'] * 1e3:.0f}",
            f"{s['tpot_p90'] * 1e3:.1f}",
            f"{s['computed']} / {s['prompt_tokens']}",
            s["tier_hits"],
            "yes" if s["idle"] else "no",
        ]

    return rate_table(summary, args, columns, cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 1.5])
    p.add_argument("--conversations", type=int, default=16, help="conversations per probe")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256, help="the system prompt all conversations share")
    p.add_argument("--user-tokens", type=lambda s: tuple(int(x) for x in s.split("-")), default=(32, 96))
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--think", type=float, default=1.0, help="mean seconds between an answer and the next turn")
    p.add_argument("--blocks", type=int, default=1024, help="KV blocks (of 16 tokens) per instance")
    p.add_argument("--tier-space", type=float, default=0.5, help="GiB of the tier on the node")
    add_run_args(p, calibration=6, out="results/prefix-tier")
    run_and_report(p.parse_args(), run, report)


if __name__ == "__main__":
    main()
