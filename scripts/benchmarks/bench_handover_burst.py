"""A burst of hand-overs: many prefilled prompts handed to one decode instance at once, and the time
until the last of them has had its first decode step.

A 1 prefill + 1 decode cluster of a dummy Llama shape prefills ``--requests`` prompts of
``--prompt-len`` tokens in one batch, so that their hand-overs reach the decode instance together,
and decodes ``--output-len`` tokens of each. The figures, over the requests of the largest prefill
batch (the first to arrive may be prefilled alone before the others): from their first hand-over
to the last one's second token (its first decode step), and to the end of the last pull (from the
decode instance's records).

With ``--trees A,B`` it runs the same burst with the code of each source tree in turn (each in a
process of its own with that tree first on its path, ``--repeats`` times, alternating), so that two
versions of the puller compare in one run:

    git worktree add /tmp/serial-pulls <commit before pulls in flight>
    python scripts/benchmarks/bench_handover_burst.py --trees /tmp/serial-pulls,. --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--kv-transport", default="auto", choices=("auto", "group"))
    p.add_argument("--trees", default="", help="source trees to compare, comma-separated (default: this one only)")
    p.add_argument("--repeats", type=int, default=3, help="bursts per tree")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child: one burst, as JSON
    return p.parse_args()


def burst(args: argparse.Namespace) -> dict:
    """One cluster, one burst; its figures."""
    import ray

    from distserve import Cluster, SamplingParams
    from distserve.model_executor.tiny_models import write_llama_shape

    ray.init(include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_llama_shape(
            Path(tmp) / "burst-llama",
            hidden_size=args.hidden_size,
            intermediate_size=args.hidden_size * 2,
            num_hidden_layers=args.num_layers,
            num_attention_heads=args.hidden_size // 128,
            num_key_value_heads=args.num_kv_heads,
            max_position_embeddings=args.prompt_len + args.output_len + 64,
        )
        tokens = args.requests * (args.prompt_len + args.output_len)
        cluster = Cluster(
            model=str(model),
            load_format="dummy",
            dtype="float32",
            block_size=16,
            num_kv_blocks=tokens // 16 * 2 + 64,
            max_num_batched_tokens=args.requests * args.prompt_len,
            max_num_seqs=args.requests,
            kv_transport=args.kv_transport,
        )
        try:
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            cluster.generate([[5] * 64], params)  # warm up: the channel, the first steps
            prompts = [[(7 + i + j) % 30000 + 3 for j in range(args.prompt_len)] for i in range(args.requests)]
            outputs = cluster.generate(prompts, params)
            decode = next(s.handle for s in cluster._async.orchestrator.instances if s.role == "decode")
            records = ray.get(decode.migrations.remote())
        finally:
            cluster.shutdown()
            ray.shutdown()
    by_client_id = {run_id.rsplit("-", 1)[0]: record for run_id, record in records.items()}  # "<client id>-<run>"
    # The burst: the requests of the largest prefill batch (the first arrival may run alone before it).
    largest = max(o.metrics.prefill_batch_size or 0 for o in outputs)
    batch = [o for o in outputs if o.metrics.prefill_batch_size == largest]
    pulls = [by_client_id[o.request_id] for o in batch]
    handed = min(o.metrics.handover_time for o in batch)
    return {
        "burst_seconds": max(o.metrics.token_times[1] for o in batch) - handed,
        "pulls_seconds": max(p.end for p in pulls) - handed,
        "pull_mean_seconds": statistics.mean(p.end - p.start for p in pulls),
        "prefill_batch": largest,
        "mib_per_pull": pulls[0].num_bytes / 2**20,
        "transport": pulls[0].transport,
    }


def run_tree(tree: str, args: argparse.Namespace) -> dict:
    """One burst in a process of its own with ``tree``'s code: first on its path, and its working
    directory, which Ray puts first on its workers' paths too."""
    root = Path(tree).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, str(Path(__file__).resolve()), "--json", *sys.argv[1:]]
    done = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"the burst with {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.json:
        print(json.dumps(burst(args)))
        return
    trees = args.trees.split(",") if args.trees else ["."]
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    for i in range(args.repeats):
        for tree in trees:
            started = time.monotonic()
            runs[tree].append(run_tree(tree, args))
            print(f"burst {i + 1} with {tree}: {runs[tree][-1]} ({time.monotonic() - started:.0f} s)", flush=True)
    first = runs[trees[0]][0]
    print(
        f"\n{args.requests} prompts of {args.prompt_len} tokens handed over at once (prefill batch of "
        f"{first['prefill_batch']}), {first['mib_per_pull']:.0f} MiB of KV each over {first['transport']}; "
        f"Llama shape {args.num_layers} layers x {args.num_kv_heads} KV heads of 128, float32, CPU; "
        f"medians of {args.repeats}\n"
    )
    print("| tree | first hand-over to the last first decode step, s | to the last pull's end, s | mean pull, s |")
    print("|---|---|---|---|")
    for tree, rows in runs.items():
        median = {key: statistics.median(r[key] for r in rows) for key in ("burst_seconds", "pulls_seconds")}
        mean_pull = statistics.median(r["pull_mean_seconds"] for r in rows)
        print(f"| {tree} | {median['burst_seconds']:.2f} | {median['pulls_seconds']:.2f} | {mean_pull:.3f} |")


if __name__ == "__main__":
    main()
