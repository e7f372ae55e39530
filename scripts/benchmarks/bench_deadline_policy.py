"""Prefill order under overload: earliest TTFT deadline first (``deadline``) against the same
order among the prompts that can still meet their deadline (``deadline-feasible``), on one
colocated instance, the same arrivals in turn.

    python scripts/benchmarks/bench_deadline_policy.py [--loads 0.8,1,1.2] [--seconds 60] [--repeats 2]

Two engines in this process, one per policy (the 58M-parameter Llama of the offline benchmark,
dummy weights, one torch thread each, chunked prefill of 256 tokens a step), run one at a time.
Requests of 768-1280 prompt tokens and 16 output tokens arrive as a Poisson stream, half of them
with a tight TTFT SLO (2.5x the mean prompt's prefill alone) and half with a loose one (10x); the
load is the arrival rate times that prefill time. Each load and repeat sends the same arrivals to
both engines, in alternating order. Prints each class's TTFTs met, and how long the late requests
waited (the feasible order serves them last).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from distserve import SamplingParams
from distserve.core.config import EngineConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape

POLICIES = ("deadline", "deadline-feasible")
PROMPT_TOKENS = (768, 1280)
SLO_SCALES = {"tight": 2.5, "loose": 10.0}


def make_engine(model: str, policy: str) -> LLMEngine:
    config = EngineConfig.from_flat(model=model, load_format="dummy", cpu_threads=1, num_kv_blocks=1024,
                                    enable_chunked_prefill=True, max_num_batched_tokens=256,
                                    policy=policy)  # fmt: skip
    return LLMEngine(config)


def prefill_seconds(engine: LLMEngine, repeats: int = 3) -> float:
    """The median time to the first token of one mean-length prompt, alone."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(repeats):
        rng = random.Random(i)  # another prompt each time: no prefix-cache hit shortens it
        prompt = [rng.randrange(3, 1000) for _ in range(sum(PROMPT_TOKENS) // 2)]
        start = time.time()
        engine.add_sequence(engine.make_sequence(prompt, params))
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.time() - start)
    return statistics.median(times)


def arrivals(rate: float, seconds: float, seed: int) -> list[tuple[float, str, list[int]]]:
    """(seconds after the start, class, prompt) of a Poisson stream."""
    rng, at, out = random.Random(seed), 0.0, []
    while (at := at + rng.expovariate(rate)) < seconds:
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(*PROMPT_TOKENS))]
        out.append((at, rng.choice(list(SLO_SCALES)), prompt))
    return out


def run(engine: LLMEngine, requests: list, slos: dict[str, float]) -> list[tuple[str, float]]:
    """Send ``requests`` on their schedule; (class, TTFT) of each."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    start, sent = time.time(), []
    pending = list(requests)
    while pending or engine.has_unfinished_requests():
        while pending and time.time() - start >= pending[0][0]:
            at, cls, prompt = pending.pop(0)
            arrival = start + at
            seq = engine.make_sequence(prompt, params, ttft_deadline=arrival + slos[cls])
            engine.add_sequence(seq)
            sent.append((cls, arrival, seq))
        if engine.has_unfinished_requests():
            engine.step()
        elif pending:
            time.sleep(max(0.0, min(0.01, start + pending[0][0] - time.time())))
    return [(cls, seq.metrics.prefill_end - arrival) for cls, arrival, seq in sent]


def main(args: argparse.Namespace) -> None:
    model = str(write_llama_shape(tempfile.mkdtemp(prefix="bench-deadline-"), **BENCH_LLAMA_SHAPE))
    engines = {policy: make_engine(model, policy) for policy in POLICIES}
    alone = prefill_seconds(engines[POLICIES[0]])
    slos = {cls: scale * alone for cls, scale in SLO_SCALES.items()}
    print(f"one torch thread per engine; a {sum(PROMPT_TOKENS) // 2}-token prompt alone: {alone * 1e3:.0f} ms; "
          f"TTFT SLOs: " + ", ".join(f"{cls} {slo:.2f} s" for cls, slo in slos.items()))  # fmt: skip
    print("| load | req/s | repeat | policy | tight met | loose met | all met | late requests' TTFT p50 / max |")
    print("|---|---|---|---|---|---|---|---|")
    totals = {(load, policy): [0, 0] for load in args.loads for policy in POLICIES}
    for load in args.loads:
        rate = load / alone
        for repeat in range(args.repeats):
            requests = arrivals(rate, args.seconds, seed=repeat)
            for policy in POLICIES[repeat % 2 :] + POLICIES[: repeat % 2]:
                ttfts = run(engines[policy], requests, slos)
                met = {cls: sum(t <= slos[cls] for c, t in ttfts if c == cls) for cls in SLO_SCALES}
                sent = {cls: sum(c == cls for c, _ in ttfts) for cls in SLO_SCALES}
                late = [t for c, t in ttfts if t > slos[c]]
                totals[load, policy][0] += sum(met.values())
                totals[load, policy][1] += len(ttfts)
                waited = f"{statistics.median(late):.1f} / {max(late):.1f} s" if late else "-"
                print(f"| {load:g} | {rate:.2f} | {repeat} | {policy} | {met['tight']}/{sent['tight']} | "
                      f"{met['loose']}/{sent['loose']} | {sum(met.values()) / len(ttfts):.1%} | {waited} |",
                      flush=True)  # fmt: skip
    print("\n| load | " + " | ".join(POLICIES) + " | ratio |")
    print("|---|---|---|---|")
    for load in args.loads:
        shares = [met / sent for met, sent in (totals[load, policy] for policy in POLICIES)]
        ratio = f"{shares[1] / shares[0]:.2f}x" if shares[0] else "-"
        print(f"| {load:g} | " + " | ".join(f"{share:.1%}" for share in shares) + f" | {ratio} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.8, 1.0, 1.2],
                        help="arrival rate times the mean prompt's prefill alone, comma-separated")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=60.0, help="how long requests arrive, each run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each load, other arrivals each")
    main(parser.parse_args())
