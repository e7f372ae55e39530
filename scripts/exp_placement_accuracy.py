"""Accuracy of the placement simulator against the real system: SLO attainment predicted from a
profile of the engine against attainment measured by ``distserve bench`` on a real 1 prefill +
1 decode deployment, at the same rates, on the same requests.

    python scripts/exp_placement_accuracy.py [--num-requests 200] [--out results/placement-accuracy]

1. ``distserve profile`` (in this process, one torch thread as each instance gets) fits the latency
   model of the model's forward passes, beside a one-thread matmul loop that stands in for the
   other instance (``--no-co-runner`` profiles alone): on a 2-core machine the two instances share
   the cores' caches and memory bandwidth (or the one physical core behind two hyperthreads), and a
   profile taken alone is up to a third faster than either instance runs under load.
2. A sequential calibration run (``--max-concurrency 1``) measures what the profile leaves out at no
   load: the serving path's fixed cost per request on TTFT (RPCs, scheduling, streaming) and per
   decode step on TPOT (scheduling, output processing, the KV migration spread over the tokens).
   They are added to the fitted model's constant terms. SLOs are set from the same run.
3. The simulator picks five rates whose predicted attainment spans 100% down to about 50%.
4. The real cluster is benchmarked at those rates with the same lengths, prompts' order and arrival
   times (``distserve bench`` and the simulator draw both from the same seed), and the largest
   absolute attainment difference is reported, for the calibrated and the raw profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import ray

from distserve.benchmark.profiler import run_profile
from distserve.cluster.api import make_cluster_config
from distserve.core.config import EngineConfig
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.model_executor.tiny_models import VOCAB_SIZE, write_llama_shape
from placement.fitted import FittedLatency
from placement.goodput import find_goodput
from placement.plots import plot_attainment_vs_rate
from placement.simulator import DecodeInstanceSpec, PrefillInstanceSpec, SimRequest, attainment, simulate
from placement.workload import arrival_times, parse_length, synthetic_workload

PROMPT_LEN = "uniform:32:256"
OUTPUT_LEN = "uniform:16:48"
# A Llama shape with dummy weights, big enough that a forward pass costs far more CPU than the serving
# path spends per token (RPCs, streaming, the client), which shares the machine's cores with the instances.
SHAPE = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 8, "vocab_size": VOCAB_SIZE}
NUM_KV_BLOCKS = 1024
BLOCK_SIZE = 16
CO_RUNNER = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a"
TARGETS = (0.99, 0.9, 0.75, 0.62, 0.5)  # predicted attainments the five rates are picked at


def bench(address: str, out: Path, label: str, *extra: str) -> dict:
    """One ``distserve bench`` in a process of its own; its JSON results."""
    result_json = out / f"{label}.json"
    command = [
        sys.executable, "-m", "distserve.cli", "bench", "--server", address, "--no-progress", "--label", label,
        "--prompt-len", PROMPT_LEN, "--output-len", OUTPUT_LEN, "--result-json", str(result_json), *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result_json.read_text())


def predict(fitted: FittedLatency, n: int, rate: float, seed: int) -> list:
    """Simulated results of the bench's requests (same lengths and arrivals) on 1 prefill + 1 decode."""
    specs = synthetic_workload(n, parse_length(PROMPT_LEN), parse_length(OUTPUT_LEN), seed)
    arrivals = arrival_times(n, rate, 1.0, seed)
    requests = [SimRequest(t, s.prompt_len, s.output_len) for t, s in zip(arrivals, specs)]
    kv_tokens = NUM_KV_BLOCKS * BLOCK_SIZE
    prefill = PrefillInstanceSpec(1, fitted.prefill_time, None, 4096, kv_tokens)
    decode = DecodeInstanceSpec(1, fitted.decode_time, None, 256, kv_tokens)
    return simulate(requests, prefill, decode, lambda tokens: 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or name (default: the SHAPE above, dummy weights)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-scale", type=float, default=3.0, help="TTFT SLO over the no-load median")
    parser.add_argument("--tpot-scale", type=float, default=2.0, help="TPOT SLO over the no-load median")
    parser.add_argument("--co-runner", action=argparse.BooleanOptionalAction, default=True,
                        help="profile beside a one-thread matmul loop standing in for the other instance")
    parser.add_argument("--out", type=Path, default=Path("results/placement-accuracy"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    model = {"model": args.model} if args.model else {
        "model": str(write_llama_shape(args.out / "model", **SHAPE)), "load_format": "dummy"
    }
    engine = EngineConfig.from_flat(**model, cpu_threads=1, block_size=BLOCK_SIZE)
    # Under load the other instance computes at the same time on the machine's other core, and they
    # share what cores share (hyperthread siblings, cache, memory bandwidth): profile beside such a load.
    co_runner = subprocess.Popen([sys.executable, "-c", CO_RUNNER]) if args.co_runner else None
    try:
        raw = run_profile(engine, max_prompt_len=256, max_context_len=320, max_batch_size=32, repeats=5)
    finally:
        if co_runner is not None:
            co_runner.kill()
    raw.save(args.out / "profile.json")
    print(f"profile: prefill {raw.prefill}, decode {raw.decode} (r2 {raw.meta['prefill_r2']:.3f}, "
          f"{raw.meta['decode_r2']:.3f})", flush=True)

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        config = make_cluster_config(
            **model, num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE, cpu_threads=1,
            prefill={"instances": 1}, decode={"instances": 1},
        )  # fmt: skip
        with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
            # Requests one at a time, at a rate slow enough that the simulator sees no overlap either.
            calibration = bench(server.grpc_address, args.out, "calibration", "--num-requests", "30",
                                "--max-concurrency", "1", "--seed", str(args.seed + 1))["runs"][0]
            # The run's lengths, drawn as distserve bench drew them.
            specs = synthetic_workload(30, parse_length(PROMPT_LEN), parse_length(OUTPUT_LEN), args.seed + 1)
            ttft_median, tpot_median = calibration["ttft"]["median"], calibration["tpot"]["median"]
            ttft_overhead = ttft_median - statistics.median(raw.prefill_time([s.prompt_len]) for s in specs)
            tpot_overhead = tpot_median - statistics.median(
                raw.decode_time(1, s.prompt_len + s.output_len // 2) for s in specs
            )
            fitted = dataclasses.replace(
                raw,
                prefill=(raw.prefill[0] + max(0.0, ttft_overhead), *raw.prefill[1:]),
                decode=(raw.decode[0] + max(0.0, tpot_overhead), *raw.decode[1:]),
            )
            ttft_slo, tpot_slo = args.ttft_scale * ttft_median, args.tpot_scale * tpot_median
            print(f"no-load overheads: TTFT +{ttft_overhead * 1e3:.1f} ms, TPOT +{tpot_overhead * 1e3:.2f} ms/token; "
                  f"SLOs TTFT {ttft_slo * 1e3:.1f} ms, TPOT {tpot_slo * 1e3:.2f} ms", flush=True)

            def predicted(fit: FittedLatency, rate: float) -> float:
                return attainment(predict(fit, args.num_requests, rate, args.seed), ttft_slo, tpot_slo)

            rates = []
            for target in TARGETS:
                rate, _ = find_goodput(lambda r: predicted(fitted, r), target, 0.05, 500.0, tolerance=0.01,
                                       max_iters=30)
                rates.append(round(rate, 3))
            rows = []
            for rate in rates:
                run = bench(server.grpc_address, args.out, f"rate-{rate}", "--num-requests", str(args.num_requests),
                            "--rate", str(rate), "--seed", str(args.seed), "--slo-ttft", f"{ttft_slo:.6f}",
                            "--slo-tpot", f"{tpot_slo:.6f}")["runs"][0]
                real = run["attainment"]["both"]
                rows.append({"rate": rate, "real": real, "predicted": predicted(fitted, rate),
                             "predicted_raw_profile": predicted(raw, rate)})
                print(f"rate {rate:>7.3f} req/s: real {real:6.1%}  predicted {rows[-1]['predicted']:6.1%}  "
                      f"(raw profile {rows[-1]['predicted_raw_profile']:6.1%})", flush=True)
    finally:
        ray.shutdown()

    worst = max(abs(r["real"] - r["predicted"]) for r in rows)
    worst_raw = max(abs(r["real"] - r["predicted_raw_profile"]) for r in rows)
    print(f"largest absolute difference: {worst * 100:.1f} points (raw profile: {worst_raw * 100:.1f} points)")
    series = {
        "real (distserve bench)": [(r["rate"], r["real"]) for r in rows],
        "simulated": [(r["rate"], r["predicted"]) for r in rows],
        "simulated, raw profile": [(r["rate"], r["predicted_raw_profile"]) for r in rows],
    }
    title = f"{Path(model['model']).name}: 1 prefill + 1 decode"
    plot_attainment_vs_rate(series, None, args.out / "accuracy.png", title)
    summary = {"slo": {"ttft": ttft_slo, "tpot": tpot_slo}, "overheads": {"ttft": ttft_overhead, "tpot": tpot_overhead},
               "rows": rows, "largest_difference": worst, "largest_difference_raw": worst_raw}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
