"""How long a role change takes under load: 2 instances flip between 1 prefill + 1 decode and 2
colocated (chunked prefill) while requests stream, and every change is timed.

    python scripts/benchmarks/bench_role_change.py [--changes 20] [--rate 10] [--device cuda]

Per change it prints the operator's wait (``set_roles`` asked to returned: every phase, each
instance's swap, the orchestrator's bookkeeping) and each instance's own time (the call reaching
its step loop to the new role serving: the rest of a step at most, then the swap), and at the end
the medians and maxima, with each instance's engine swap alone (``LLMEngine.change_role``) and its
mean step time, which split an instance's time into the step it waited for and the swap itself.
The first steps in a new role are timed against like steps of the run (same role and kind, about
as many tokens): one far slower pays a one-time cost of its shapes (on a GPU, compiling a kernel
variant, or loading kernels lazily: run it with ``CUDA_MODULE_LOADING=LAZY`` beside the default
``EAGER`` of instances), which the slowest steps, listed with the change they followed and where
their time went, point to. Requests are greedy and checked to finish; none may be lost.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import NamedTuple

import ray
import torch

from distserve import AsyncCluster, SamplingParams
from distserve.core.role import Role
from distserve.engine.ray_runtime import one_gpu_shared_options


class StepLog(NamedTuple):
    """One step of an instance, as the benchmark keeps it."""

    end: float  # time.time() when it was recorded
    role: str
    kind: str  # prefill (prompt tokens in it) or decode
    seqs: int
    tokens: int
    seconds: float
    where: str  # its phases over 5 ms and the device allocations it made


def _time_engine_swaps(instance) -> None:
    """Run in an instance actor: time each ``LLMEngine.change_role`` call, the swap without the
    wait for the step in progress, and keep every step's end, role, shape and seconds."""
    engine, change, add = instance.engine, instance.engine.change_role, instance.engine.stats.add
    instance.bench_swaps, instance.bench_steps = [], []

    def device_allocations() -> int:
        # cudaMalloc calls so far: a step that makes many grows the allocator's pool
        return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_initialized() else 0

    allocations = device_allocations()

    def recorded(record):
        nonlocal allocations
        before, allocations = allocations, device_allocations()
        phases = ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in record.seconds.items() if seconds > 0.005)
        where = f"{phases or 'no phase over 5'} ms; {allocations - before} device allocations"
        kind = "prefill" if record.is_prefill else "decode"
        instance.bench_steps.append(StepLog(time.time(), str(engine.role.role), kind, record.batch_size,
                                            record.num_tokens, record.total, where))  # fmt: skip
        return add(record)

    engine.stats.add = recorded

    def timed(role):
        start = time.perf_counter()
        try:
            return change(role)
        finally:
            instance.bench_swaps.append(time.perf_counter() - start)

    engine.change_role = timed


def _engine_figures(instance) -> tuple[list[float], int, float]:
    """Run in an instance actor: its engine swaps' seconds, its steps and their total seconds."""
    stats = instance.engine.stats
    return instance.bench_swaps, stats.num_steps, sum(stats.totals.values())


def _steps(instance) -> list[StepLog]:
    """Run in an instance actor: every step it ran."""
    return instance.bench_steps


def _like(step: StepLog, others: list[StepLog]) -> list[float]:
    """The seconds of the steps of the same role and kind with 0.8-1.25x its tokens."""
    return [o.seconds for o in others
            if (o.role, o.kind) == (step.role, step.kind) and 0.8 <= o.tokens / step.tokens <= 1.25]  # fmt: skip


def report_first_steps(names: list[str], steps: list[list[StepLog]], changes: list[float], first: int = 3) -> None:
    """An instance's first steps after each change (the new role's first steps) against the median of
    like steps (same role and kind, about as many tokens) over the run: a first step far above it
    pays a one-time cost of the new role's shapes (on a GPU, loading or compiling kernels). Then the
    slowest steps of the run, with the change they followed."""
    for name, mine in zip(names, steps):
        ratios = []
        for at in changes:
            after = [s for s in mine if s.end > at][:first]
            against_like = [s.seconds / statistics.median(like) for s in after if len(like := _like(s, mine)) >= 3]
            if against_like:
                ratios.append(max(against_like))
        if ratios:
            print(
                f"{name}: the slowest of the first {first} steps after a change against like steps' median: "
                f"median {statistics.median(ratios):.1f}x, max {max(ratios):.1f}x, over 3x after "
                f"{sum(r > 3 for r in ratios)} of {len(ratios)} changes"
            )
        start = mine[0].end if mine else 0.0
        for step in sorted(mine, key=lambda s: -s.seconds)[:8]:
            before = [i for i, at in enumerate(changes) if at < step.end]
            since = f"{step.end - changes[before[-1]]:.2f} s after change {len(before)}" if before else "before changes"
            print(
                f"  {step.seconds * 1e3:8.1f} ms ({step.seconds / statistics.median(_like(step, mine)):.1f}x like "
                f"steps) at {step.end - start:6.2f} s, {step.role}, {step.kind} {step.seqs} seqs {step.tokens} "
                f"tokens, {since}: {step.where}"
            )


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    options = dict(model=args.model, device=args.device, cpu_threads=1, num_kv_blocks=1024,
                   enable_chunked_prefill=True, max_num_batched_tokens=256, load_format=args.load_format)  # fmt: skip
    async with AsyncCluster(prefill={}, decode={}, **options) as cluster:
        names = [i.name for i in await cluster.info()]
        handles = [state.handle for state in cluster.orchestrator.instances]
        await asyncio.gather(*[h.__ray_call__.remote(_time_engine_swaps) for h in handles])
        layouts = [(Role.COLOCATED, Role.COLOCATED), (Role.PREFILL, Role.DECODE)]
        stop = asyncio.Event()
        finished, lost = [], []

        async def request(prompt: list[int], n: int) -> None:
            try:
                async for output in cluster.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                                            ignore_eos=True)):  # fmt: skip
                    last = output
                finished.append(len(last.output_token_ids) == n)
            except Exception as e:
                lost.append(e)

        async def load() -> None:
            tasks = []
            while not stop.is_set():
                await asyncio.sleep(rng.expovariate(args.rate))
                long = rng.random() < 0.5
                prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(512, 768) if long else rng.randint(16, 64))]
                tasks.append(asyncio.create_task(request(prompt, 64 if long else 128)))
            await asyncio.gather(*tasks)

        loader = asyncio.create_task(load())
        waits, swaps, asked = [], [], []
        halfway = []  # each instance's figures halfway: the second half's steps are warm ones
        for i in range(args.changes):
            if i == args.changes // 2:
                halfway = await asyncio.gather(*[h.__ray_call__.remote(_engine_figures) for h in handles])
            await asyncio.sleep(args.every)
            held = sum(x.num_running + x.num_held + x.num_pending for x in await cluster.info())
            started = time.perf_counter()
            asked.append(time.time())
            records = await cluster.set_roles(dict(zip(names, layouts[i % 2])))
            waits.append(time.perf_counter() - started)
            swaps += [r.seconds for r in records]
            print(
                f"change {i + 1:>2}: -> {'+'.join(map(str, layouts[i % 2]))} with {held} requests in instances: "
                f"{waits[-1] * 1e3:.1f} ms asked to done; instances "
                + ", ".join(f"{r.old_role}->{r.new_role} {r.seconds * 1e3:.2f} ms" for r in records),
                flush=True,
            )
        stop.set()
        await loader
        figures = await asyncio.gather(*[h.__ray_call__.remote(_engine_figures) for h in handles])
        step_logs = await asyncio.gather(*[h.__ray_call__.remote(_steps) for h in handles])
    print(
        f"\n{args.changes} changes at {args.rate:g} req/s: asked to done median {statistics.median(waits) * 1e3:.1f} "
        f"ms, max {max(waits) * 1e3:.1f} ms; an instance's swap median {statistics.median(swaps) * 1e3:.2f} ms, "
        f"max {max(swaps) * 1e3:.2f} ms"
    )
    for name, (engine_swaps, steps, seconds), (_, steps_before, seconds_before) in zip(names, figures, halfway):
        warm_steps = steps - steps_before
        print(
            f"{name}: engine swap median {statistics.median(engine_swaps) * 1e3:.2f} ms, max "
            f"{max(engine_swaps) * 1e3:.2f} ms; {steps} steps, mean {seconds / max(steps, 1) * 1e3:.2f} ms; "
            f"second half {warm_steps} steps, mean {(seconds - seconds_before) / max(warm_steps, 1) * 1e3:.2f} ms"
        )
    report_first_steps(names, step_logs, asked)
    print(f"requests: {len(finished)} finished, {sum(finished)} with all their tokens, {len(lost)} failed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--rate", type=float, default=10.0, help="req/s, half long prompts, half short")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between changes")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--load-format", default="auto", help="dummy: random weights of the model's shape")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, **one_gpu_shared_options())  # one GPU: both on it
    asyncio.run(main(args))
