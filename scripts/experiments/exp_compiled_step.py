"""What compiling the whole model with torch.compile would buy a CPU decode step: the engine's
eager forward against the same model under ``torch.compile`` (inductor, dynamic shapes), in one
process, on the same requests.

    python scripts/experiments/exp_compiled_step.py [--threads 2] [--batch 4] [--rounds 3] [--dtype auto]

The 58M dummy Llama, ``--batch`` prompts of 64 random tokens, 64 greedy output tokens each (EOS
ignored), timed as a whole ``LLM.generate`` divided by its 64 steps (the prefill step included),
eager and compiled in alternation. Compiled, the paged-attention kernel and the packed linear
layers are custom ops (inductor cannot lower a packed oneDNN weight that is not a frozen
constant), so inductor fuses what lies between them: norms, rotary embedding, SiLU and the
residual adds. The compile time of the first two batch shapes is printed too. ``--dtype`` as the
engine's (``auto``: bfloat16 on a CPU with AVX-512 BF16 or AMX); the dtype run is printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from distserve import LLM, SamplingParams
from distserve.model_executor import attention, cpu_kernel, cpu_linear
from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape

# The kernel's own function, typed as custom_op wants it, as an operator inductor calls as it is.
paged_attention_op = torch.library.custom_op(
    "distserve_exp::paged_attention", cpu_kernel.paged_attention_cpu, mutates_args=()
)


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, block_size, scale, window):
    return torch.empty(q.shape, dtype=q.dtype)


@torch.library.custom_op("distserve_exp::packed_linear", mutates_args=())
def packed_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear_op.register_fake
def _(x, weight, bias, n_out):
    return x.new_empty(x.shape[0], n_out)


def packed_forward(self: cpu_linear.PackedLinear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, self.in_features)
    return packed_linear_op(rows, self.packed_weight, self.bias, self.out_features).view(
        *x.shape[:-1], self.out_features
    )


def ms_per_step(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - start) / params.max_tokens * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(64)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = str(write_llama_shape(scratch, **BENCH_LLAMA_SHAPE))
        options = {"load_format": "dummy", "cpu_threads": args.threads, "dtype": args.dtype}
        eager, compiled = LLM(model=model, **options), LLM(model=model, **options)
        dtype = str(eager.engine.executor.worker.dtype).removeprefix("torch.")
        runner = compiled.engine.executor.worker.model_runner
        for module in runner.model.modules():
            if isinstance(module, cpu_linear.PackedLinear):
                module.forward = packed_forward.__get__(module)
        attention.paged_attention_cpu = paged_attention_op  # both engines: the op runs the same kernel
        runner.model = torch.compile(runner.model, dynamic=True)
        for name, batch in (("first shape", prompts), ("batch of 1", prompts[:1])):
            start = time.perf_counter()
            compiled.generate(batch, params)
            print(f"compiled, {name}: {time.perf_counter() - start:.1f} s (compiling included)")
        ms_per_step(eager, prompts, params)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            times["eager"].append(ms_per_step(eager, prompts, params))
            times["compiled"].append(ms_per_step(compiled, prompts, params))
        same = [o.output_token_ids for o in eager.generate(prompts, params)] == [
            o.output_token_ids for o in compiled.generate(prompts, params)
        ]
    print(f"batch {args.batch}, {args.threads} threads, {dtype}, ms per step (the prefill step included):")
    for name, values in times.items():
        print(f"  {name:<9} median {statistics.median(values):5.1f}  runs {', '.join(f'{v:.1f}' for v in values)}")
    ratio = statistics.median(times["eager"]) / statistics.median(times["compiled"])
    print(f"  eager / compiled {ratio:.2f}x; greedy outputs equal: {same}")


if __name__ == "__main__":
    main()
