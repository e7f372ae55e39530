"""Time the placement search: OPT-13B, -66B and -175B on 4 nodes x 8 A100-80GB, chat workload at
DistServe's chat SLOs, each affinity algorithm alone and both together, with the number of
configurations simulated and pruned and the best pair found.

    python scripts/benchmarks/bench_placement_search.py [--processes 2] [--num-requests 1000] [--repeats 3]

The median of ``--repeats`` wall-clock times is printed (worker start-up included).
"""

from __future__ import annotations

import argparse
import statistics
import time

from distserve.core.model_presets import MODEL_PRESETS, model_shape
from placement.hardware import cluster_from_dict
from placement.latency import InstanceModels
from placement.search import Objective, PhaseProblem, search
from placement.workload import arrival_times, preset_workload

CASES = {"opt-13b": (0.25, 0.1), "opt-66b": (2.5, 0.15), "opt-175b": (4.0, 0.2)}
POOL = 20_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inter-node-bandwidth", type=float, help="bytes/s per node (default: the GPU preset's)")
    args = parser.parse_args()
    hardware = {"gpu": "A100-80GB", "num_nodes": 4, "gpus_per_node": 8}
    if args.inter_node_bandwidth:
        hardware["inter_node_bandwidth"] = args.inter_node_bandwidth
    cluster = cluster_from_dict(hardware)
    header = f"{'model':<9} {'algorithms':<10} {'seconds':>8} {'simulated':>9} {'pruned':>6}"
    print(f"{header}  best (prefill / decode, req/s/GPU)")
    total = 0.0
    for name, (ttft, tpot) in CASES.items():
        shape = model_shape(MODEL_PRESETS[name])
        requests = preset_workload("chat", POOL, seed=0, max_context=shape.max_position_embeddings)
        problem = PhaseProblem(
            InstanceModels(shape, cluster), tuple(requests), tuple(arrival_times(POOL, 1.0)),
            Objective(ttft, tpot, 0.9), args.num_requests,
        )  # fmt: skip
        for affinities in (("high",), ("low",), ("high", "low")):
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                result = search(problem, affinities, args.processes)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            if len(affinities) == 2:
                total += seconds
            best = sorted(result.high[:1] + result.low[:1], key=lambda c: -c.per_gpu)
            summary = (
                f"{best[0].affinity}: {best[0].prefill.parallelism} / {best[0].decode.parallelism}, "
                f"{best[0].per_gpu:.3f}"
                if best
                else "none"
            )
            print(f"{name:<9} {'+'.join(affinities):<10} {seconds:>8.2f} {result.simulated:>9} {result.pruned:>6}  "
                  f"{summary}", flush=True)  # fmt: skip
    print(f"all three models, both algorithms: {total:.1f} s")


if __name__ == "__main__":
    main()
