"""Sends a workload to a server through the gRPC client, on the arrival schedule, and records
each request's timeline as the client sees it.

Prompts are token ids of the workload's lengths, random and new in every run (distinct per
request and from any earlier run, so a server's prefix cache never shortens a prefill: a second
run at another rate against the same server would otherwise find every prompt cached); lengths
and arrival times follow the seed. Requests are sent with ``ignore_eos`` so every request produces
exactly the output length asked for; generation is greedy."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import numpy as np

from distserve.benchmark.metrics import RequestRecord
from distserve.entrypoints.client import AsyncClient, CallError
from placement.workload import RequestSpec, arrival_times

FIRST_TOKEN_ID = 10  # ids below are often special tokens


def make_prompts(specs: Sequence[RequestSpec], vocab_size: int, seed: int | None = None) -> list[list[int]]:
    """Random prompts of the specs' lengths; ``seed`` None: different ones every call."""
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_TOKEN_ID, vocab_size, size=spec.prompt_len).tolist() for spec in specs]


async def run_workload(
    client: AsyncClient,
    specs: Sequence[RequestSpec],
    rate: float,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    progress: bool = False,
    timelines: bool = False,
) -> list[RequestRecord]:
    """Send every request at its arrival time (``rate`` inf: all at once), at most
    ``max_concurrency`` in flight; a request's clock starts when it is sent. ``timelines``: ask the
    server for each request's stage-by-stage timeline too."""
    if vocab_size is None:
        vocab_size = (await client.cluster_info()).vocab_size
    prompts = make_prompts(specs, vocab_size)
    arrivals = arrival_times(len(specs), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = _progress_bar(len(specs)) if progress else None
    start = time.perf_counter()

    async def one(spec: RequestSpec, prompt: list[int], arrival: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        async with limit:
            record = RequestRecord(spec.prompt_len, spec.output_len, time.perf_counter(), scheduled=arrival)
            request = {"max_tokens": spec.output_len, "ignore_eos": True, "temperature": 0, "timeline": timelines}
            try:
                async for chunk in client.generate(prompt, **request):
                    record.token_times.extend([time.perf_counter()] * len(chunk.token_ids))
                    if chunk.HasField("timeline"):
                        record.timeline = chunk.timeline
            except CallError as e:
                record.error = f"{e.code().name}: {e.details()}"
        if bar is not None:
            bar.update(1)
        return record

    try:
        return list(await asyncio.gather(*(one(s, p, a) for s, p, a in zip(specs, prompts, arrivals))))
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", leave=False)
