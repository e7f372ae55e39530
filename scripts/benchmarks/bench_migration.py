"""KV migration speed: a prefill instance's KV pulled by a decode instance, against the raw link.

A 1 prefill + 1 decode cluster serves one dummy Llama-shaped model. For each prompt length it
runs requests one at a time and reads the decode instance's migration records (bytes, start,
end: from the decode instance asking both sides to move the request's token slots until both
answered). After each request, over a pair communicator of its own between the same two
processes, it times one contiguous tensor of the same bytes sent the same way (a call to each
side, until both answered): the raw transport. Warm, the raw send reuses one buffer on each side,
which stays in the CPU's cache when small; cold, it moves memory no recent probe touched, as a
pull moves KV that no step touched since it was written; cold again in messages of 1 MiB posted
at once. It also reports migration time as a share of each request's end-to-end latency.

``--kv-transport`` is the cluster's ``cache.kv_transport``: ``auto`` reads the prefill instance's
cache in place on one node (shared memory on CPU, CUDA IPC on GPUs), and so does the raw
transfer (one contiguous copy out of it); ``group`` moves both over a two-rank group (gloo on
CPU); ``both`` runs a cluster of each, one after the other, and adds a table of the in-place
migration against the group's migration and raw transfer. ``--checksums on,off`` runs a cluster
of each ``cache.kv_transfer_checksum`` (for each transport) and adds what checking the pulls costs,
as a share of the unchecked pull.

With ``--nodes``, the prefill and the decode instance run on two Ray nodes (two raylets of a
``ray.cluster_utils.Cluster`` on this machine, labelled as plan node groups 0 and 1), so the KV
crosses from one node to the other, as does the raw transfer it is held against.

Run (about 2 minutes a cluster on 2 CPU cores):

    DISTSERVE_CACHE_DIR=/tmp/dscache python scripts/benchmarks/bench_migration.py
    python scripts/benchmarks/bench_migration.py --kv-transport both
    python scripts/benchmarks/bench_migration.py --kv-transport both --checksums on,off --prompt-lens 128,512,2048,8192
    python scripts/benchmarks/bench_migration.py --nodes
    python scripts/benchmarks/bench_migration.py --device cuda --dtype bfloat16 --prompt-lens 512,2048,8192
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.cluster_utils
from transformers.utils import logging as hf_logging

from distserve import Cluster, SamplingParams
from distserve.core.config import KV_TRANSPORTS
from distserve.engine.node_groups import NODE_LABEL
from distserve.engine.ray_runtime import one_gpu_shared_options
from distserve.kv_transfer.channel import GLOO_MESSAGE_BYTES
from distserve.model_executor.tiny_models import write_llama_shape


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-lens", default="128,512,1024,2048")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (for the latency share)")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--nodes", action="store_true", help="prefill and decode on two Ray nodes of this machine")
    p.add_argument(
        "--kv-transport",
        default="auto",
        choices=(*KV_TRANSPORTS, "both"),
        help="the clusters' cache.kv_transport ('both': a cluster of each, compared)",
    )
    p.add_argument(
        "--checksums",
        default="auto",
        help="the clusters' cache.kv_transfer_checksum, comma-separated (on,off: a cluster of each, compared)",
    )
    return p.parse_args()


@dataclass
class Row:
    """One prompt length's medians."""

    length: int
    num_bytes: int
    seconds: float  # migration
    raw: float  # one contiguous tensor of the same bytes over a channel between the same processes
    raw_cold: float  # the same from and into memory no recent probe touched, as the KV is
    raw_cold_messages: float  # that in messages of 1 MiB, posted at once
    e2e: float  # request latency
    share: float  # migration / request latency


def write_model_dir(
    root: Path, args: argparse.Namespace, name: str = "bench-migration-llama", max_positions: int = 8192 + 1024
) -> Path:
    """config.json and a tokenizer, no weights: the engine draws dummy weights from the shapes
    (``args``: hidden size, layers and KV heads; heads of 128)."""
    return write_llama_shape(
        root / name,
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 2,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.hidden_size // 128,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=max_positions,
    )


def pull_records(decode) -> dict:
    """The decode instance's pull records by the client's request id (it keys them by run:
    "<client id>-<run>")."""
    return {run_id.rsplit("-", 1)[0]: record for run_id, record in ray.get(decode.migrations.remote()).items()}


class RawLink:
    """A pair communicator of its own between the two instances' first ranks: one contiguous
    tensor sent over it, timed from a call to each side until both answered, as a pull is."""

    def __init__(self, prefill, decode) -> None:
        self.src = ray.get(prefill.kv_endpoints.remote())[0]
        self.dst = ray.get(decode.kv_endpoints.remote())[0]
        self.channel = "bench-raw.0>bench-raw.1"
        address = ray.get(self.src.call("store_address"))
        ray.get(
            [
                self.src.call("connect", self.channel, True, address),
                self.dst.call("connect", self.channel, False, address),
            ]
        )

    def seconds(self, num_bytes: int, message_bytes: int = 0, cold: bool = False) -> float:
        """One send of ``num_bytes`` (``message_bytes``: in messages of that size, posted at once;
        ``cold``: from and into memory out of the CPU's caches)."""
        start = time.time()
        probe = (self.channel, num_bytes, message_bytes, cold)
        ray.get([self.src.call("send_probe", *probe), self.dst.call("recv_probe", *probe)])
        return time.time() - start


def run_cluster(
    args: argparse.Namespace, model_dir: Path, pools: dict, kv_transport: str, checksum: str
) -> tuple[str, list[Row]]:
    """How the KV moved (the migration records' transport), and a row per prompt length. Each
    request is followed by the raw sends of its bytes, so that the two see the same machine."""
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    cluster = Cluster(
        model=str(model_dir),
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=(max(lengths) + args.output_len) // 16 * 2 + 16,
        max_num_batched_tokens=max(lengths),
        kv_transport=kv_transport,
        kv_transfer_checksum=checksum,
        **pools,
    )
    try:
        orchestrator = cluster._async.orchestrator
        prefill, decode = (s.handle for s in orchestrator.instances)
        link = RawLink(prefill, decode)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        cluster.generate([[5] * 64], params)  # warm up: first channel, first steps
        rows, transports = [], set()
        for length in lengths:
            outputs, probes = [], []
            for i in range(args.repeats + 1):  # the first one warms the raw sends' buffers up
                outputs += cluster.generate([[(7 + i + j) % 30000 + 3 for j in range(length)]], params)
                num_bytes = pull_records(decode)[outputs[-1].request_id].num_bytes
                probes.append(
                    (
                        link.seconds(num_bytes),
                        link.seconds(num_bytes, cold=True),
                        link.seconds(num_bytes, GLOO_MESSAGE_BYTES, cold=True),
                    )
                )
            outputs, raw = outputs[1:], [statistics.median(p) for p in zip(*probes[1:])]
            records = pull_records(decode)
            mig = [records[o.request_id] for o in outputs]
            transports |= {r.transport for r in mig}
            seconds = statistics.median(r.end - r.start for r in mig)
            e2e = [o.metrics.finished_time - o.metrics.arrival_time for o in outputs]
            share = statistics.median((r.end - r.start) / t for r, t in zip(mig, e2e))
            rows.append(Row(length, num_bytes, seconds, *raw, statistics.median(e2e), share))
            print(f"{kv_transport}, checksum {checksum}: {length} tokens done", flush=True)
    finally:
        cluster.shutdown()
    return "+".join(sorted(transports)), rows


def print_rows(transport: str, rows: list[Row]) -> None:
    print(f"\nmigration and raw transfer over {transport}\n")
    print(
        "| prompt tokens | KV MiB | migration ms | GB/s | raw warm ms | migration / raw warm "
        "| raw cold ms | migration / raw cold | raw cold in 1 MiB messages ms | migration / that "
        "| request latency s | migration share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.length} | {r.num_bytes / 2**20:.1f} | {r.seconds * 1e3:.1f} | {r.num_bytes / r.seconds / 1e9:.2f} "
            f"| {r.raw * 1e3:.1f} | {r.raw / r.seconds:.2f} | {r.raw_cold * 1e3:.1f} | {r.raw_cold / r.seconds:.2f} "
            f"| {r.raw_cold_messages * 1e3:.1f} | {r.raw_cold_messages / r.seconds:.2f} | {r.e2e:.2f} | {r.share:.2%} |"
        )


def print_comparison(in_place: tuple[str, list[Row]], group: tuple[str, list[Row]]) -> None:
    """The in-place migration against the group's migration and its raw transfer, length by length."""
    (fast, fast_rows), (slow, slow_rows) = in_place, group
    print(f"\n{fast} migration against {slow} migration and raw {slow}\n")
    print(
        f"| prompt tokens | KV MiB | {fast} migration ms | {slow} migration ms | raw {slow} ms "
        f"| {fast} / {slow} migration speed | {fast} / raw {slow} speed |"
    )
    print("|---|---|---|---|---|---|---|")
    for f, g in zip(fast_rows, slow_rows):
        print(
            f"| {f.length} | {f.num_bytes / 2**20:.1f} | {f.seconds * 1e3:.1f} | {g.seconds * 1e3:.1f} "
            f"| {g.raw * 1e3:.1f} | {g.seconds / f.seconds:.2f} | {g.raw / f.seconds:.2f} |"
        )


def print_checksum_cost(transport: str, checked: list[Row], unchecked: list[Row]) -> None:
    """The same pulls with and without their checks, length by length."""
    print(f"\nchecked against unchecked pulls over {transport}\n")
    print("| prompt tokens | KV MiB | checked ms | unchecked ms | check's share of the pull | of the request |")
    print("|---|---|---|---|---|---|")
    for c, u in zip(checked, unchecked):
        extra = c.seconds - u.seconds
        print(
            f"| {c.length} | {c.num_bytes / 2**20:.1f} | {c.seconds * 1e3:.1f} | {u.seconds * 1e3:.1f} "
            f"| {extra / u.seconds:.0%} | {extra / u.e2e:.2%} |"
        )


def main() -> None:
    args = parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    nodes, pools = None, {"prefill": {}, "decode": {}}
    if args.nodes:
        nodes = ray.cluster_utils.Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "labels": {NODE_LABEL: "0"}}
        )
        nodes.add_node(num_cpus=1, labels={NODE_LABEL: "1"})
        ray.init(address=nodes.address, log_to_driver=False)
        pools = {"prefill": {"nodes": [[0]]}, "decode": {"nodes": [[1]]}}
    else:
        ray.init(include_dashboard=False, log_to_driver=False, **one_gpu_shared_options())  # one GPU: both on it
    kv_transports = KV_TRANSPORTS if args.kv_transport == "both" else (args.kv_transport,)
    checksums = args.checksums.split(",")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_model_dir(Path(tmp), args)
            runs = {(t, c): run_cluster(args, model_dir, pools, t, c) for t in kv_transports for c in checksums}
    finally:
        if nodes is not None:
            ray.shutdown()
            nodes.shutdown()
    where = "two Ray nodes (raylets) of this machine" if args.nodes else "one Ray node"
    print(
        f"\n{where}; model: Llama-shaped, {args.num_layers} layers, {args.num_kv_heads} KV heads of 128, {args.dtype} "
        f"on {args.device}; {args.output_len} output tokens; medians of {args.repeats}"
    )
    for (_, checksum), (transport, rows) in runs.items():
        print_rows(f"{transport}, checksum {checksum}", rows)
    if len(kv_transports) == 2:
        print_comparison(*(runs[t, checksums[0]] for t in kv_transports))
    if {"on", "off"} <= set(checksums):
        for t in kv_transports:
            print_checksum_cost(runs[t, "on"][0], runs[t, "on"][1], runs[t, "off"][1])


if __name__ == "__main__":
    main()
