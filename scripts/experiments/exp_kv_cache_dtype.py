"""Accuracy of an 8-bit KV cache (``cache.kv_cache_dtype`` int8 and fp8) against the unquantized
cache on the same weights, on the tiny model families, and per-token scales (what is built)
against one scale per block and KV head.

    python scripts/experiments/exp_kv_cache_dtype.py [--backend auto] [--dtypes float32,bfloat16]

The tiny models are random weights (there is no model hub here): the tests' own recipe
(``tiny_models.make_tiny_model``) with 2,048 positions, so that a 1,024-token prompt and its
128 new tokens fit. Every run is an offline ``LLM`` in this process, greedy, EOS ignored.

1. Teacher-forced logprobs. ``--forced-seqs`` sequences of ``--forced-len`` tokens (random
   prompt tokens, then the unquantized cache's greedy continuation) are fed as prompts with
   ``prompt_logprobs``, under chunked prefill in chunks of one block (``max_num_batched_tokens``
   = block size): every chunk after the first attends over its context, its own rows included,
   as read back from the cache, so every attention read of the rows past the first chunk goes
   through the quantized cache whatever the backend (a prompt with nothing cached attends over
   its fresh K/V on the ``sdpa`` backend). The rows past the first chunk are scored: the forced
   token's |logprob difference| (largest, mean) and whether the top token is the same.
2. Greedy outputs. ``--prompts`` prompts of 64-1,024 random tokens, ``--max-tokens`` new tokens
   each, as served (no chunking): the share of outputs equal to the unquantized run's, and where
   they part, the first differing position; and the logprob of each output token up to that
   position, where both runs decode the same context (the decode steps read the cache).
3. Per-token against per-block scales, offline, in transformers' own forward pass of the same
   weights (float32) over the forced sequences: K and V of every layer rounded through int8 or
   fp8 with a scale per token and KV head (``kv_quant``, as the cache stores them) or with one
   scale per block of 16 tokens and KV head (the whole block's largest magnitude: the best a
   per-block scale can do, as if a block were requantized each time a token joins it), and
   measured as their error against the exact K/V, the attention output's error against exact
   attention on the same inputs (layer by layer, the exact output passed on), and the forced
   logprobs with every layer's K/V rounded (as the C++ kernel reads them); and transformers'
   greedy outputs of the prompts of 2 with K/V so rounded at every step (a partial block's scale
   from its tokens so far), against its exact greedy outputs. For scale, the same for K/V rounded
   to bfloat16, what a bfloat16 cache does to them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.utils import logging as hf_logging

from distserve import LLM, SamplingParams
from distserve.core.kv_cache_dtype import CODE_MAX
from distserve.model_executor.kv_quant import dequantize_kv, quantize_kv
from distserve.model_executor.tiny_models import TINY_MODELS, VOCAB_SIZE, make_tiny_model

BLOCK_SIZE = 16
POSITIONS = 2048
POSITION_FIELD = {"tiny-gpt2": "n_positions"}  # the others' is max_position_embeddings


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(TINY_MODELS))
    p.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, comma-separated")
    p.add_argument("--cache-dtypes", default="int8,fp8")
    p.add_argument("--backend", default="auto", help="attention_backend of every run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--forced-seqs", type=int, default=8)
    p.add_argument("--forced-len", type=int, default=512)
    p.add_argument("--forced-prompt", type=int, default=64, help="random tokens before the greedy continuation")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def random_tokens(gen: torch.Generator, count: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (count,), generator=gen).tolist()


# 1 and 2: the engine ------------------------------------------------------------------------------


@dataclass
class Forced:
    max_diff: float
    mean_diff: float
    top_agree: float
    positions: int


@dataclass
class Greedy:
    equal: int
    first_diffs: list[int]  # where the outputs that part first differ
    max_diff: float  # |logprob difference| of the output tokens before they part
    mean_diff: float
    positions: int


def forced_logprobs(llm: LLM, seqs: list[list[int]]) -> list[tuple[list[float], list[int]]]:
    """Each sequence's (logprob of each token, top token at each position), from the second on."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outputs = llm.generate(seqs, params)
    return [([p.logprob for p in o.prompt_logprobs[1:]], [p.top_token_ids[0] for p in o.prompt_logprobs[1:]])
            for o in outputs]  # fmt: skip


def compare_forced(ref: list, test: list, skip: int) -> Forced:
    """Rows from ``skip`` on of each sequence: the tokens they predict are the sequence's ``skip + 1``th on."""
    diffs, agree = [], []
    for (ref_lp, ref_top), (lp, top) in zip(ref, test):
        diffs += [abs(a - b) for a, b in zip(ref_lp[skip:], lp[skip:])]
        agree += [a == b for a, b in zip(ref_top[skip:], top[skip:])]
    return Forced(max(diffs), statistics.fmean(diffs), statistics.fmean(agree), len(diffs))


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return [(list(o.output_token_ids), [lp.logprob for lp in o.logprobs]) for o in outs]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ, or None where they are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare_greedy(ref: list, test: list) -> Greedy:
    equal, first_diffs, diffs = 0, [], []
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, test):
        part = first_difference(ref_ids, ids)
        if part is None:
            equal += 1
        else:
            first_diffs.append(part)
        diffs += [abs(a - b) for a, b in zip(ref_lp[1:part], lp[1:part])]  # the first token is the prompt's
    return Greedy(equal, first_diffs, max(diffs, default=0.0), statistics.fmean(diffs or [0.0]), len(diffs))


def engine_runs(
    args: argparse.Namespace, model: Path, dtype: str, forced_prompts: list[list[int]], prompts: list[list[int]]
) -> tuple[str, list[str]]:
    """The attention backend the engine ran, and a row of the engine's table per 8-bit cache dtype,
    for one family and model dtype."""
    common = {"dtype": dtype, "attention_backend": args.backend, "cpu_threads": args.threads, "block_size": BLOCK_SIZE}
    runs: dict[str, tuple[list, list]] = {}
    forced_seqs: list[list[int]] = []
    for cache_dtype in ("auto", *args.cache_dtypes):
        llm = LLM(str(model), kv_cache_dtype=cache_dtype, **common)
        backend = llm.engine.executor.worker.model_runner.attention_backend
        if cache_dtype == "auto":  # the forced sequences: the prompts and the unquantized continuation
            forced_seqs = continued(llm, forced_prompts, args.forced_len)
        outs = greedy(llm, prompts, args.max_tokens)
        llm.shutdown()
        chunked = LLM(str(model), kv_cache_dtype=cache_dtype, enable_chunked_prefill=True,
                      max_num_batched_tokens=BLOCK_SIZE, **common)  # fmt: skip
        runs[cache_dtype] = (forced_logprobs(chunked, forced_seqs), outs)
        chunked.shutdown()
    rows = []
    for cache_dtype in args.cache_dtypes:
        f = compare_forced(runs["auto"][0], runs[cache_dtype][0], BLOCK_SIZE)
        g = compare_greedy(runs["auto"][1], runs[cache_dtype][1])
        parts = f"{statistics.median(g.first_diffs):.0f} / {min(g.first_diffs)}" if g.first_diffs else "-"
        rows.append(
            f"| {cache_dtype} | {f.max_diff:.4f} | {f.mean_diff:.5f} | {f.top_agree:.2%} | {f.positions} "
            f"| {g.equal}/{len(prompts)} | {parts} | {g.max_diff:.4f} | {g.mean_diff:.5f} | {g.positions} |"
        )
    return backend, rows


def continued(llm: LLM, prompts: list[list[int]], length: int) -> list[list[int]]:
    """Each prompt and its greedy continuation to ``length`` tokens."""
    outs = greedy(llm, prompts, length - len(prompts[0]))
    return [p + ids for p, (ids, _) in zip(prompts, outs)]


# 3: per-token against per-block scales, in transformers' forward pass ------------------------------


def round_per_token(x: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """``[batch, kv_heads, tokens, dim]`` through the cache's own quantize and dequantize."""
    rows = x.transpose(1, 2).flatten(0, 1)  # [batch * tokens, kv_heads, dim]
    out = dequantize_kv(quantize_kv(rows, cache_dtype), cache_dtype, x.dtype)
    return out.view(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)


def round_per_block(x: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """The same with one scale per block of ``BLOCK_SIZE`` tokens and KV head: the block's largest magnitude."""
    batch, heads, tokens, dim = x.shape
    pad = -tokens % BLOCK_SIZE
    blocks = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(batch, heads, -1, BLOCK_SIZE, dim)
    scale = (blocks.abs().amax(dim=(-2, -1), keepdim=True) / CODE_MAX[cache_dtype]).clamp_min(1e-30)
    scaled = blocks / scale
    if cache_dtype == "int8":
        codes = scaled.round().clamp(-127, 127)
    else:
        codes = scaled.to(torch.float8_e4m3fn).float()
    return (codes * scale).view(batch, heads, -1, dim)[:, :, :tokens].to(x.dtype)


def round_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """A bfloat16 cache's own rounding (8 significant bits), for scale."""
    return x.to(torch.bfloat16).to(x.dtype)


def roundings(cache_dtypes: list[str]) -> list[tuple[str, str, Callable[[torch.Tensor], torch.Tensor]]]:
    """(KV, scale, rounding) of each row of the scales table."""
    found = [(c, f"per {name}", partial(fn, cache_dtype=c)) for c in cache_dtypes
             for name, fn in (("token", round_per_token), ("block", round_per_block))]  # fmt: skip
    return [*found, ("bfloat16", "none", round_bfloat16)]


class Rounding:
    """The attention function transformers calls (``attn_implementation="kv_rounding"``): K/V through
    ``round``, errors recorded; the exact output returned unless ``propagate``."""

    def __init__(self) -> None:
        self.round: Callable[[torch.Tensor], torch.Tensor] = round_bfloat16
        self.propagate = False
        self.errors: dict[str, list[float]] = {"k": [], "v": [], "out": []}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        k, v = self.round(key), self.round(value)
        exact, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        rounded, _ = sdpa_attention_forward(module, query, k, v, attention_mask, **kwargs)
        for name, got, want in (("k", k, key), ("v", v, value), ("out", rounded, exact)):
            # per row (token and head): |error| / |row|, the relative error of a vector
            err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-30)
            self.errors[name].append(err.mean().item())
        return (rounded if self.propagate else exact), None


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens of each prompt (one at a time: no padding), EOS ignored."""
    found = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        found.append(out[0, len(prompt) :].tolist())
    return found


def scale_runs(
    args: argparse.Namespace, model: Path, seqs: list[list[int]], prompts: list[list[int]], rounding: Rounding
) -> list[str]:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="kv_rounding").eval()
    ids = torch.tensor(seqs)
    targets = ids[:, 1:, None]
    rows = []
    with torch.inference_mode():
        rounding.propagate = False
        exact = hf(ids).logits.float().log_softmax(-1)[:, :-1]
        exact_greedy = hf_greedy(hf, prompts, args.max_tokens)
        for cache_dtype, scale, fn in roundings(args.cache_dtypes):
            rounding.round, rounding.errors = fn, {"k": [], "v": [], "out": []}
            rounding.propagate = False
            hf(ids)
            errors = {name: statistics.fmean(values) for name, values in rounding.errors.items()}
            rounding.propagate = True
            got = hf(ids).logits.float().log_softmax(-1)[:, :-1]
            diff = (got.gather(-1, targets) - exact.gather(-1, targets)).abs()
            agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
            parts = [first_difference(a, b) for a, b in zip(exact_greedy, hf_greedy(hf, prompts, args.max_tokens))]
            differ = [p for p in parts if p is not None]
            where = f"{statistics.median(differ):.0f} / {min(differ)}" if differ else "-"
            rows.append(
                f"| {cache_dtype} | {scale} | {errors['k']:.4f} | {errors['v']:.4f} | {errors['out']:.4f} "
                f"| {diff.max().item():.4f} | {diff.mean().item():.5f} | {agree:.2%} "
                f"| {len(parts) - len(differ)}/{len(parts)} | {where} |"
            )
    rounding.propagate = False
    return rows


def main() -> None:
    args = parse_args()
    args.cache_dtypes = args.cache_dtypes.split(",")
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    rounding = Rounding()
    AttentionInterface.register("kv_rounding", rounding)
    AttentionMaskInterface.register("kv_rounding", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(64, 1025, (args.prompts,), generator=gen).tolist()
    print(f"torch threads {torch.get_num_threads()}; attention backend {args.backend}; prompts of "
          f"{min(lengths)}-{max(lengths)} tokens; forced sequences {args.forced_seqs} x {args.forced_len}")  # fmt: skip
    engine_tables, scale_tables = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families.split(","):
            positions = {POSITION_FIELD.get(family, "max_position_embeddings"): POSITIONS}
            model = make_tiny_model(family, Path(scratch) / family, **positions)
            forced_prompts = [random_tokens(gen, args.forced_prompt) for _ in range(args.forced_seqs)]
            prompts = [random_tokens(gen, n) for n in lengths]
            for dtype in args.dtypes.split(","):
                backend, rows = engine_runs(args, model, dtype, forced_prompts, prompts)
                engine_tables[family, dtype, backend] = rows
                print(f"{family} {dtype} done", flush=True)
            llm = LLM(str(model), dtype="float32", attention_backend=args.backend, block_size=BLOCK_SIZE)
            seqs = continued(llm, forced_prompts, args.forced_len)
            llm.shutdown()
            scale_tables[family] = scale_runs(args, model, seqs, prompts, rounding)
    print("\nteacher-forced logprobs (rows past the first chunk) and greedy outputs, against the unquantized cache\n")
    print(
        "| family | dtype | backend | KV | forced max abs diff | mean | top token same | positions "
        "| greedy equal | first diff median / min | decode logprob max diff | mean | positions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (family, dtype, backend), rows in engine_tables.items():
        for row in rows:
            print(f"| {family} | {dtype} | {backend} {row}")
    print("\nper-token against per-block scales (transformers' forward, float32, the forced sequences)\n")
    print("| family | KV | scale | K rel err | V rel err | attention out rel err | logprob max diff | mean "
          "| top token same | greedy equal | first diff median / min |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for family, rows in scale_tables.items():
        for row in rows:
            print(f"| {family} {row}")


if __name__ == "__main__":
    main()
