"""What decoding beside a prompt costs its prefill on a colocated instance with chunked prefill: the
time from a prompt's arrival to its first token, alone and with N requests decoding in the same
steps, and the decode-only step at each N.

    python scripts/benchmarks/bench_mixed_steps.py [--decoding 0,3,6,10] [--prompt 1024] [--context 1000]

One engine, one torch thread, the 58M dummy Llama (``--model`` for another). The decoding requests
have ``--context`` prompt tokens each and are past their prefill when the timed prompt arrives;
each figure is the fastest of ``--repeats`` prompts.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from distserve import LLM, SamplingParams
from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: the 58M dummy Llama)")
    parser.add_argument("--decoding", default="0,3,6,10", help="requests decoding beside the prompt")
    parser.add_argument("--prompt", type=int, default=1024, help="the timed prompt's tokens")
    parser.add_argument("--context", type=int, default=1000, help="each decoding request's prompt tokens")
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(write_llama_shape(scratch, **BENCH_LLAMA_SHAPE))
        llm = LLM(model, load_format="auto" if args.model else "dummy", cpu_threads=1, num_kv_blocks=2048,
                  enable_chunked_prefill=True, max_num_batched_tokens=args.chunk)  # fmt: skip
        engine = llm.engine
        rng = random.Random(0)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, 1000) for _ in range(n)]

        def first_token_seconds() -> tuple[float, list[float]]:
            """A new prompt's arrival to its first token, and the steps that took."""
            request_id = engine.add_request(tokens(args.prompt), SamplingParams(max_tokens=1, ignore_eos=True))
            start, steps = time.perf_counter(), []
            while True:
                step_start = time.perf_counter()
                deltas = engine.step()
                steps.append(time.perf_counter() - step_start)
                if any(d.request_id == request_id for d in deltas):
                    return time.perf_counter() - start, steps

        first_token_seconds()  # warm-up
        print(f"{args.prompt}-token prompt, chunks of {args.chunk}, decoding requests of {args.context} tokens")
        for n in (int(x) for x in args.decoding.split(",")):
            decoding = SamplingParams(max_tokens=100_000, ignore_eos=True)
            ids = [engine.add_request(tokens(args.context), decoding) for _ in range(n)]
            prefilling = set(ids)
            while prefilling:  # each has its first token: it decodes from now on
                prefilling -= {d.request_id for d in engine.step()}
            seconds, steps = min(first_token_seconds() for _ in range(args.repeats))
            start = time.perf_counter()
            for _ in range(5):
                engine.step()
            decode_step = (time.perf_counter() - start) / 5 if n else 0.0
            print(f"decoding {n:>3}: first token {1000 * seconds:6.0f} ms in {len(steps)} steps "
                  f"({', '.join(f'{1000 * s:.0f}' for s in steps)} ms); decode-only step {1000 * decode_step:.0f} ms",
                  flush=True)  # fmt: skip
            for request_id in ids:
                engine.abort_request(request_id)
        llm.shutdown()


if __name__ == "__main__":
    main()
