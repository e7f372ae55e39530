"""The sampler on one decode step's logits: rows with a temperature only (drawn without sorting
the vocabulary) against rows with top-p or top-k (ordered to cut the tail), and greedy rows, in
one process. Logits are normal draws times ``--scale``: 1 is nearly flat (a random model's, whose
top-p 0.9 reaches past the 1,024 likeliest tokens, so the whole vocabulary is sorted), 6 peaked
as a trained model's (the 1,024 likeliest hold the top-p mass).

    python scripts/benchmarks/bench_sampler.py [--batch 16] [--vocab 32000] [--threads 1] [--scale 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from distserve.core.sampling_params import SamplingParams
from distserve.model_executor.sampler import Sampler


def mean_ms(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, calls: int) -> float:
    rows = [params] * logits.shape[0]
    steps = list(range(logits.shape[0]))
    sampler(logits, rows, steps)  # first-call costs out of the figure
    start = time.perf_counter()
    for _ in range(calls):
        sampler(logits, rows, steps)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--scale", type=float, default=1.0, help="logits are normal draws times this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * args.scale
    sampler = Sampler(seed=0)
    cases = {
        "greedy": SamplingParams(temperature=0.0),
        "temperature 1": SamplingParams(temperature=1.0),
        "temperature 1, top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
        "temperature 1, top-k 50": SamplingParams(temperature=1.0, top_k=50),
    }
    times = {name: mean_ms(sampler, logits, params, args.calls) for name, params in cases.items()}
    print(f"{args.batch} rows x {args.vocab} logits (scale {args.scale:g}), {args.threads} thread(s), "
          f"mean of {args.calls} calls")  # fmt: skip
    for name, ms in times.items():
        print(f"  {name:<26} {ms:7.2f} ms")
    ratio = times["temperature 1, top-p 0.9"] / times["temperature 1"]
    print(f"  top-p / temperature only: {ratio:.1f}x")


if __name__ == "__main__":
    main()
