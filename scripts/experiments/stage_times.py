"""Where a request's time goes, per deployment: queueing, prefill batch, KV migration, TTFT and
TPOT from the timings the server reports on each stream's last message.

    python scripts/experiments/stage_times.py [--rates 0.5,8] [--requests 40]

Long-prompts workload of exp_disagg_vs_colocated.py (512-768 prompt tokens, 64 output tokens),
1 prefill + 1 decode against 2 colocated instances, one torch thread per instance.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import ray

from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.client import AsyncClient
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from placement.workload import arrival_times

DEPLOYMENTS = {
    "disaggregated": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
    "colocated": {"colocated": {"instances": 2}},
}
STAGES = ("queue", "prefill", "migration", "ttft", "tpot")


async def stage_times(address: str, rate: float, n: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, size=int(rng.integers(512, 769))).tolist() for _ in range(n)]
    async with AsyncClient(address) as client:
        start = time.perf_counter()

        async def one(prompt: list[int], arrival: float):
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            return (await client.complete(prompt, max_tokens=64, ignore_eos=True)).timings

        timings = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, arrival_times(n, rate))))
    return {stage: [getattr(t, stage) for t in timings] for stage in STAGES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,8")
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        print(f"{'deployment':<14} {'rate':>5} " + " ".join(f"{s + ' p50/p90 ms':>21}" for s in STAGES))
        for name, pools in DEPLOYMENTS.items():
            config = make_cluster_config(model="tiny-llama", num_kv_blocks=1024, cpu_threads=1, **pools)
            with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0)) as server:
                for rate in map(float, args.rates.split(",")):
                    times = asyncio.run(stage_times(server.grpc_address, rate, args.requests))
                    cells = [f"{np.median(v) * 1e3:>10.1f}/{np.percentile(v, 90) * 1e3:<10.1f}" for v in times.values()]
                    print(f"{name:<14} {rate:>5g} " + " ".join(cells))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
