"""The linear layers of one decode step of the 58M benchmark Llama, by how the GEMM is called, at
the batch sizes a served load has: torch's ``linear`` (MKL, weights [out, in]), ``mm`` on weights
stored transposed, MKL's packed GEMM and oneDNN's packed GEMM (torch's own ops, weights reordered
once for the batch size). A decode step's time is mostly these on CPU: this says which call to make.

    python scripts/benchmarks/bench_gemm.py [--threads 1] [--batches 1,2,4,8,16,32,64] [--dtype float32]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE python scripts/benchmarks/bench_gemm.py --dtype bfloat16  # as without AVX-512 BF16

Each figure is the median over ``--repeats`` passes of all 57 linears (8 layers of q, k, v, o,
gate, up, down, and the LM head), in milliseconds, with the bytes of weights read per second, in
``--dtype`` (weights and inputs; MKL's packed GEMM is float32 only). Each call's output is checked
against torch's float32 linear on the same values first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE

LAYER_SHAPES = ("q", "k", "v", "o", "gate", "up", "down")


def step_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """The step's weights, [out, in]."""
    hidden, inner = BENCH_LLAMA_SHAPE["hidden_size"], BENCH_LLAMA_SHAPE["intermediate_size"]
    shapes = [(hidden, hidden)] * 4 + [(inner, hidden)] * 2 + [(hidden, inner)]
    layers = [torch.randn(out, inp) / inp**0.5 for _ in range(BENCH_LLAMA_SHAPE["num_hidden_layers"])
              for out, inp in shapes]  # fmt: skip
    return [w.to(dtype) for w in [*layers, torch.randn(32000, hidden) / hidden**0.5]]


def time_pass(call: Callable[[torch.Tensor, object], torch.Tensor], items: list, inputs: dict, repeats: int) -> float:
    for _ in range(2):
        for weight, prepared in items:
            call(inputs[weight.shape[1]], prepared)
    passes = []
    for _ in range(repeats):
        start = time.perf_counter()
        for weight, prepared in items:
            call(inputs[weight.shape[1]], prepared)
        passes.append(time.perf_counter() - start)
    return statistics.median(passes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    weights = step_weights(dtype)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    calls = {
        "linear": (lambda w, m: w, lambda x, w: torch.nn.functional.linear(x, w)),
        "mm, W^T stored": (lambda w, m: w.t().contiguous(), torch.mm),
        "MKL packed": (
            lambda w, m: (w, torch.ops.mkl._mkl_reorder_linear_weight(w, m)),
            lambda x, p: torch.ops.mkl._mkl_linear(x, p[1], p[0], None, x.shape[0]),
        ),
        "oneDNN packed": (
            lambda w, m: torch.ops.mkldnn._reorder_linear_weight(w, m),
            lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        ),
    }
    if dtype != torch.float32:
        del calls["MKL packed"]
    # Sums in float32 either way: in bfloat16 the output's rounding (2^-8 of a value) parts them.
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-4
    print(f"{len(weights)} linears, {nbytes / 2**20:.0f} MiB of {args.dtype} weights, {args.threads} threads; "
          "ms per pass")  # fmt: skip
    print(f"{'batch':>5}" + "".join(f"{name:>16}" for name in calls) + f"{'GB/s (best)':>13}")
    for batch in (int(b) for b in args.batches.split(",")):
        inputs = {n: torch.randn(batch, n).to(dtype) for n in {w.shape[1] for w in weights}}
        x, head = inputs[weights[-1].shape[1]], weights[-1]
        reference = torch.nn.functional.linear(x.float(), head.float())
        row = []
        for prepare, call in calls.values():
            items = [(w, prepare(w, batch)) for w in weights]
            out = call(x, items[-1][1])
            torch.testing.assert_close(out.float(), reference, rtol=rtol, atol=1e-4)
            row.append(time_pass(call, items, inputs, args.repeats))
        print(f"{batch:>5}" + "".join(f"{s * 1000:>16.1f}" for s in row) + f"{nbytes / min(row) / 1e9:>13.1f}")


if __name__ == "__main__":
    main()
