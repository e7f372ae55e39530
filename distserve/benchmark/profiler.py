"""``distserve profile``: time the engine's steps over a grid of batch shapes and fit a latency model.

Each grid point is a ``BatchInput`` handed to the same executor an ``LLMEngine`` steps with
(``UniprocExecutor``: one ``Worker`` in this process), so a sample is what an engine step spends on
the model: preparing the packed inputs and attention metadata, the forward over the paged KV cache,
and sampling. Scheduling and output processing, which do not scale with the batch, are left out.
Sequences get disjoint block tables and random token ids; KV contents do not change the time of a
forward, so decode points need no prefill before them and dummy weights (``--load-format dummy``)
time the same as real ones.

Prefill points are batches of equal prompt lengths (powers of two from 16 to ``--max-prompt-len``)
at batch sizes up to ``--max-batch-size`` within the scheduler's token budget; decode points are
batch sizes up to ``--max-batch-size`` at per-sequence contexts up to ``--max-context-len``. Varying
both the length and the batch size keeps the fitted terms (tokens vs. squared lengths, batch size
vs. total context) apart. Each point is timed ``--repeats`` times after a warm-up and its median
kept. Only a single rank is profiled: tensor and pipeline parallel instances are not supported yet.

Torch and the engine are imported inside the functions that run it so the ``distserve`` command
line stays quick to start.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from distserve.core.config import EngineConfig
from placement.fitted import DecodeSample, FittedLatency, PrefillSample, fit

MIN_LENGTH = 16
WARMUP_STEPS = 2


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    """Profile flags; the engine flags (``--model``, ``--load-format``, ...) are the caller's."""
    parser.add_argument("--config", help="YAML file with model/cache/scheduler sections; flags override it")
    parser.add_argument("--out", required=True, help="file to write the fitted latency model to (JSON)")
    parser.add_argument("--max-prompt-len", type=int, default=1024, help="longest prefill prompt (default: 1024)")
    parser.add_argument(
        "--max-context-len", type=int, help="longest decode context per sequence (default: 2 x --max-prompt-len)"
    )
    parser.add_argument("--max-batch-size", type=int, default=32, help="largest batch, both phases (default: 32)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timings per grid point; the median is kept (default: 5)"
    )


def _powers_of_two(low: int, high: int) -> list[int]:
    values = [n for n in (1 << k for k in range(high.bit_length())) if low <= n <= high]
    return values + [high] if high not in values else values


def prefill_grid(max_prompt_len: int, max_batch_size: int, token_budget: int) -> list[list[int]]:
    """Prompt lengths of each prefill batch: equal lengths, batch sizes in powers of two, within the budget."""
    return [
        [length] * batch
        for length in _powers_of_two(min(MIN_LENGTH, max_prompt_len), max_prompt_len)
        for batch in _powers_of_two(1, max_batch_size)
        if batch * length <= token_budget
    ]


def decode_grid(max_context_len: int, max_batch_size: int) -> list[tuple[int, int]]:
    """(batch size, context per sequence) of each decode step."""
    return [
        (batch, context)
        for context in _powers_of_two(min(MIN_LENGTH, max_context_len), max_context_len)
        for batch in _powers_of_two(1, max_batch_size)
    ]


def _median_seconds(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # the sampled token ids come back as a list: the device has finished
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_engine(
    config: EngineConfig,
    prefill_batches: list[list[int]],
    decode_points: list[tuple[int, int]],
    repeats: int,
    log: Callable[[str], None] = lambda line: None,
) -> tuple[list[PrefillSample], list[DecodeSample], dict[str, Any]]:
    """Median step seconds of each prefill batch and decode point, and facts of what was measured."""
    import torch

    from distserve.core.sampling_params import SamplingParams
    from distserve.engine.executor import UniprocExecutor
    from distserve.model_executor.model_loader import resolve_model
    from distserve.model_executor.model_runner import BatchInput, SeqInput

    if config.parallel.world_size != 1:
        raise ValueError("profile runs a single rank: tensor and pipeline parallel sizes must be 1")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    resolved = resolve_model(config.model)
    longest = max([max(lengths) for lengths in prefill_batches] + [context for _, context in decode_points])
    if longest > resolved.max_model_len:
        raise ValueError(f"the grid reaches {longest} tokens, beyond the model's {resolved.max_model_len}")
    bs = config.cache.block_size
    blocks_per_batch = [sum(-(-n // bs) for n in lengths) for lengths in prefill_batches]
    blocks_per_batch += [batch * -(-context // bs) for batch, context in decode_points]
    executor = UniprocExecutor(config, max(blocks_per_batch) * bs)
    rng = random.Random(config.model.seed)
    vocab_size = resolved.shape.vocab_size
    params = SamplingParams()

    def batch_input(is_prefill: bool, contexts: list[int]) -> BatchInput | None:
        """Disjoint block tables from block 0; None when the KV cache is too small for the batch."""
        seqs, next_block = [], 0
        for context in contexts:
            num_blocks = -(-context // bs)
            table = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            tokens = [rng.randrange(vocab_size) for _ in range(context if is_prefill else 1)]
            seqs.append(SeqInput(tokens, 0 if is_prefill else context - 1, table, params, 0))
        return BatchInput(is_prefill, seqs) if next_block <= executor.num_blocks else None

    def measure(batch: BatchInput | None, label: str) -> float | None:
        if batch is None:
            log(f"skipped {label}: the KV cache has {executor.num_blocks} blocks")
            return None
        seconds = _median_seconds(lambda: executor.execute_model(batch), repeats)
        log(f"{label}: {seconds * 1e3:.2f} ms")
        return seconds

    # Warm-up: first calls pay for allocator growth, kernel selection and lazy initialisation.
    warmup = [batch_input(True, prefill_batches[0]), batch_input(True, prefill_batches[-1])]
    warmup.append(batch_input(False, [decode_points[0][1]]))
    for batch in filter(None, warmup):
        for _ in range(WARMUP_STEPS):
            executor.execute_model(batch)
    prefill: list[PrefillSample] = []
    for lengths in prefill_batches:
        seconds = measure(batch_input(True, lengths), f"prefill {len(lengths)} x {lengths[0]}")
        if seconds is not None:
            prefill.append((lengths, seconds))
    decode: list[DecodeSample] = []
    for batch, context in decode_points:
        seconds = measure(batch_input(False, [context] * batch), f"decode {batch} x {context}")
        if seconds is not None:
            decode.append((batch, batch * context, seconds))

    worker = executor.worker
    device = worker.device
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    meta = {
        "device": device_name,
        "model": config.model.model,
        "dtype": str(worker.dtype).removeprefix("torch."),
        "kv_cache_dtype": config.cache.kv_cache_dtype,  # decode's context term reads this cache's bytes
        "tp": 1,
        "pp": 1,
        "block_size": bs,
        "load_format": config.model.load_format,
        "repeats": repeats,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    executor.shutdown()
    return prefill, decode, meta


def run_profile(
    config: EngineConfig,
    max_prompt_len: int,
    max_context_len: int,
    max_batch_size: int,
    repeats: int,
    log: Callable[[str], None] = lambda line: None,
) -> FittedLatency:
    """Profile the engine over the default grid and fit the latency model."""
    for name, value in (("max_prompt_len", max_prompt_len), ("max_context_len", max_context_len)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    prefill_batches = prefill_grid(max_prompt_len, max_batch_size, config.scheduler.max_num_batched_tokens)
    if not prefill_batches:
        raise ValueError(f"no prefill batch fits the token budget of {config.scheduler.max_num_batched_tokens}")
    prefill, decode, meta = profile_engine(
        config, prefill_batches, decode_grid(max_context_len, max_batch_size), repeats, log
    )
    return fit(prefill, decode, meta)


def cmd_profile(args: argparse.Namespace, config: EngineConfig) -> int:
    """``distserve profile`` with the engine ``config`` its flags give."""
    max_context_len = args.max_context_len or 2 * args.max_prompt_len
    fitted = run_profile(config, args.max_prompt_len, max_context_len, args.max_batch_size, args.repeats, print)
    a, b, c = fitted.prefill
    d, e, f = fitted.decode
    meta = fitted.meta
    print(f"{meta['model']} on {meta['device']} ({meta['dtype']}, KV cache {meta['kv_cache_dtype']})")
    print(f"prefill s = {a:.4g} + {b:.4g} * tokens + {c:.4g} * sum(len^2)   r2 {meta['prefill_r2']:.4f}")
    print(f"decode  s = {d:.4g} + {e:.4g} * batch + {f:.4g} * context       r2 {meta['decode_r2']:.4f}")
    fitted.save(args.out)
    print(f"wrote {args.out}")
    return 0
