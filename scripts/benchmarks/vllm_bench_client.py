"""`vllm bench serve` as the load of a measured window (bench_serving_cpu.py's ``--clients vllm``).

vLLM's own client sends ``--streams x --waves`` requests of its random data set (``--input-len``
prompt tokens, ``--output-len`` output tokens, EOS ignored), ``--streams`` at once, all as soon as
a slot is free (request rate inf), with the same seed for every server: the same prompts. Its
start-up (imports, tokenizer, data set, its ``/tokenize`` alignment and single test request) is
left out of the window: ``started`` is called at its line "Starting main benchmark run...", and
``ended`` at the header of its results, printed once every stream has ended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from bench_peer_serving import bench_command
from peer_clients import executable

START_LINE = "Starting main benchmark run..."
END_LINE = " Serving Benchmark Result "
# Both servers then send an SSE event per token, as for our client: most of the dummy weights'
# tokens have no text, for which distserve sends no event unless token ids are asked for.
EXTRA_BODY = {"return_token_ids": True}


def run_vllm_bench(
    url: str, args: argparse.Namespace, out: Path, env: dict[str, str], started: Callable[[], None],
    ended: Callable[[], None],
) -> dict:  # fmt: skip
    """vllm bench serve against ``url`` (log and results in ``out``); what it reports: tokens (its
    ``total_output_tokens``, from every stream's usage, checked), SSE events with a choice, output
    tokens/s and mean TPOT."""
    out.mkdir(parents=True, exist_ok=True)
    num_prompts = args.streams * args.waves
    load = argparse.Namespace(
        tokenizer=args.tokenizer, prefixes=0, input_len=args.input_len, output_len=args.output_len,
        num_prompts=num_prompts, max_concurrency=args.streams, slo_ttft=1000, slo_tpot=50,
    )  # fmt: skip
    command = bench_command(executable(args.venvs, "vllm", "vllm"), url, load, math.inf, 0, out)
    command += ["--save-detailed", "--extra-body", json.dumps(EXTRA_BODY)]
    marks = {START_LINE: started, END_LINE: ended}
    seen = []
    log = out / "vllm-bench.log"
    with log.open("w") as text:
        text.write(" ".join(command) + "\n\n")
        # Unbuffered: each line arrives as it is printed, so the window opens when its run does.
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env=env | {"PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        timer = threading.Timer(args.client_timeout, os.killpg, (process.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in process.stdout:
                for mark, call in marks.items():
                    if mark in line and mark not in seen:
                        call()
                        seen.append(mark)
                text.write(line)
        finally:
            timer.cancel()
            rc = process.wait()
    result_path = out / "rate-inf.json"
    if rc != 0 or len(seen) != 2 or not result_path.exists():
        raise RuntimeError(f"vllm bench serve exited {rc} (lines seen: {seen}): see {log}")
    result = json.loads(result_path.read_text())
    expected = num_prompts * args.output_len
    if result["completed"] != num_prompts or result["failed"] or result["total_output_tokens"] != expected:
        raise RuntimeError(
            f"vllm bench serve: {result['completed']} of {num_prompts} requests completed, {result['failed']} failed, "
            f"{result['total_output_tokens']} tokens, not {expected}: see {log}"
        )
    return {
        "tokens": result["total_output_tokens"],
        "events": sum(len(itl) + 1 for itl in result["itls"]),  # its first chunk, then one gap per chunk
        "client_tokens_per_s": result["output_throughput"],
        "client_mean_tpot_ms": result["mean_tpot_ms"],
    }
