"""The sampler on one decode step's logits: rows with a temperature only (drawn without sorting
the vocabulary) against rows with top-p (sorted to cut the tail), and greedy rows, in one process.

    python scripts/benchmarks/bench_sampler.py [--batch 16] [--vocab 32000] [--threads 1]
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0)
    cases = {
        "greedy": SamplingParams(temperature=0.0),
        "temperature 1": SamplingParams(temperature=1.0),
        "temperature 1, top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    }
    times = {name: mean_ms(sampler, logits, params, args.calls) for name, params in cases.items()}
    print(f"{args.batch} rows x {args.vocab} logits, {args.threads} thread(s), mean of {args.calls} calls")
    for name, ms in times.items():
        print(f"  {name:<26} {ms:7.2f} ms")
    ratio = times["temperature 1, top-p 0.9"] / times["temperature 1"]
    print(f"  top-p (sorted) / temperature only: {ratio:.1f}x")


if __name__ == "__main__":
    main()
