"""What one decode step's outputs cost to send from an instance to the orchestrator: whole
``RequestOutput``s (the prompt and everything generated so far, every step) against the
``RequestDelta``s engines emit (the step's new token and text), for the same step.

    python scripts/benchmarks/bench_output_messages.py [--batch 128] [--prompt 1000] [--generated 256]

Prints bytes per step and the time to convert, pickle and unpickle one step's messages (Ray
pickles an actor call's result), and the ratio of the whole outputs to the deltas.
"""

from __future__ import annotations

import argparse
import pickle
import random
import time

from distserve.core.outputs import STAGE_FIELDS, RequestDelta, RequestMetrics, RequestOutput


def step_outputs(batch: int, prompt: int, generated: int) -> list[RequestOutput]:
    """One decode step of ``batch`` requests, each with its own lists, as the engine builds them."""
    rng = random.Random(0)
    outputs = []
    for i in range(batch):
        prompt_ids = [rng.randrange(32000) for _ in range(prompt)]
        output_ids = [rng.randrange(32000) for _ in range(generated)]
        outputs.append(
            RequestOutput(
                request_id=f"cmpl-{i:032x}-0",
                prompt=None,
                prompt_token_ids=prompt_ids,
                output_token_ids=output_ids,
                text="".join(chr(97 + t % 26) for t in output_ids) * 4,
                new_token_ids=output_ids[-1:],
                new_text="abcd",
                finished=False,
                finish_reason=None,
                num_cached_tokens=0,
                metrics=RequestMetrics(arrival_time=1.0, prefill_start=1.1, prefill_end=1.2),
            )
        )
    return outputs


def cost(outputs: list[RequestOutput], convert, repeats: int) -> tuple[int, float]:
    """(bytes, seconds) to convert, pickle and unpickle one step's messages, best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data = pickle.dumps(convert(outputs), protocol=5)
        pickle.loads(data)
        best = min(best, time.perf_counter() - start)
    return len(data), best


def _delta(output: RequestOutput) -> RequestDelta:
    """The delta an engine emits for the step that produced ``output``."""
    times = tuple(getattr(output.metrics, name) for name in STAGE_FIELDS)
    return RequestDelta(
        output.request_id, 0, output.new_token_ids, output.new_text, output.finished, output.finish_reason,
        output.num_cached_tokens, None, times,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128, help="requests in the decode step")
    parser.add_argument("--prompt", type=int, default=1000, help="prompt tokens of each request")
    parser.add_argument("--generated", type=int, default=256, help="tokens each request has generated")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    outputs = step_outputs(args.batch, args.prompt, args.generated)
    whole_bytes, whole_s = cost(outputs, list, args.repeats)
    delta_bytes, delta_s = cost(outputs, lambda outs: [_delta(o) for o in outs], args.repeats)
    print(f"{args.batch} requests, {args.prompt} prompt + {args.generated} generated tokens each, one step:")
    print(f"  RequestOutput: {whole_bytes / 1024:8.1f} KiB  {whole_s * 1e3:6.2f} ms")
    print(f"  RequestDelta:  {delta_bytes / 1024:8.1f} KiB  {delta_s * 1e3:6.2f} ms")
    print(f"  ratio:         {whole_bytes / delta_bytes:8.1f}x     {whole_s / delta_s:6.1f}x")


if __name__ == "__main__":
    main()
