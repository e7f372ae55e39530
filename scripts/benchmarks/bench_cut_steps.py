"""TPOT-aware chunking on one colocated instance: do steps cut to the TPOT SLO take what the
step-time line said they would?

    python scripts/benchmarks/bench_cut_steps.py [--rate 0.3] [--seconds 90] [--slo-tpot 0.0645]

One engine in this process (the 58M-parameter Llama of the offline benchmark, dummy weights, one
torch thread), chunked prefill with a 256-token budget and ``tpot_aware_chunking``; requests of
768-1280 prompt tokens and 64 output tokens arrive as a Poisson stream, each with the TPOT SLO.
For every step that ran decode tokens beside prompt chunks it compares the step's seconds with
the line's prediction for its tokens (the line as it stood when the step was scheduled) and with
the cut's aim (``TPOT_SLO_SHARE`` of the SLO), then gives the requests' TPOT against the SLO.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from distserve import SamplingParams
from distserve.benchmark.metrics import Stats
from distserve.core.config import EngineConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape
from distserve.scheduling.scheduler import TPOT_SLO_SHARE

CHUNK_TOKENS = 256


def main(args: argparse.Namespace) -> None:
    model = write_llama_shape(tempfile.mkdtemp(prefix="bench-cut-steps-"), **BENCH_LLAMA_SHAPE)
    config = EngineConfig.from_flat(model=str(model), load_format="dummy", cpu_threads=1, num_kv_blocks=1024,
                                    enable_chunked_prefill=True, max_num_batched_tokens=CHUNK_TOKENS,
                                    tpot_aware_chunking=True)  # fmt: skip
    engine = LLMEngine(config, max_step_records=1_000_000)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seqs, mixed = [], []  # mixed: (step record, the line's prediction for its tokens)
    start = time.time()
    next_arrival = start
    while time.time() - start < args.seconds or engine.has_unfinished_requests():
        while time.time() >= next_arrival and next_arrival - start < args.seconds:
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(768, 1280))]
            seq = engine.make_sequence(prompt, params, tpot_slo=args.slo_tpot)
            engine.add_sequence(seq)
            seqs.append(seq)
            next_arrival += rng.expovariate(args.rate)
        line, steps = engine.step_time.line(), engine.stats.num_steps
        engine.step()
        if engine.stats.num_steps == steps:  # nothing to run: wait for the next arrival
            time.sleep(max(0.0, min(0.01, next_arrival - time.time())))
            continue
        record = engine.stats.records[-1]
        if line is not None and record.is_prefill and record.batch_size > 1:
            mixed.append((record, line.seconds(record.num_tokens)))
    aim = TPOT_SLO_SHARE * args.slo_tpot
    actual = Stats.of([record.total for record, _ in mixed])
    ratios = Stats.of([record.total / predicted for record, predicted in mixed])
    print(
        f"{args.rate:g} req/s for {args.seconds:g} s, one thread: {engine.stats.num_steps} steps, {len(mixed)} of "
        f"them decode tokens beside prompt chunks ({statistics.median(r.num_tokens for r, _ in mixed):.0f} tokens "
        f"at the median)"
    )
    print(
        f"those steps: median {actual.median * 1e3:.1f} ms, 90th percentile {actual.p90 * 1e3:.1f} ms against "
        f"the aim of {aim * 1e3:.1f} ms; actual / predicted: median {ratios.median:.2f}, 90th percentile "
        f"{ratios.p90:.2f}; over the aim: {sum(record.total > aim for record, _ in mixed)}"
    )
    # From the steps' ends (the engine alone: token arrival times are the orchestrator's to keep).
    tpots = [(s.metrics.steps[-1][1] - s.metrics.steps[0][1]) / (len(s.metrics.steps) - 1) for s in seqs
             if len(s.metrics.steps) > 1]  # fmt: skip
    tpot = Stats.of(tpots)
    print(
        f"TPOT of {len(tpots)} requests: median {tpot.median * 1e3:.1f} ms, 90th percentile {tpot.p90 * 1e3:.1f} "
        f"ms; within the SLO of {args.slo_tpot * 1e3:.1f} ms: {sum(t <= args.slo_tpot for t in tpots)}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.3, help="requests per second")
    parser.add_argument("--seconds", type=float, default=90.0, help="how long requests arrive")
    parser.add_argument("--slo-tpot", type=float, default=0.0645, help="seconds per output token")
    main(parser.parse_args())
