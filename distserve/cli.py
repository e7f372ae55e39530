"""The ``distserve`` command line.

Engine flags are generated from the config dataclasses, so each flag is also a YAML key
(``--block-size`` is ``cache.block_size``) and ``--config FILE`` can set any of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing
from collections.abc import Sequence
from pathlib import Path

from distserve.benchmark.command import add_bench_args
from distserve.benchmark.profiler import add_profile_args
from distserve.cluster.config import LIMITS_FLAGS, POOL_FLAGS
from distserve.cluster.role_control.config import ROLE_CONTROL_MODES
from distserve.core.config import FIELD_SECTION, SECTIONS, EngineConfig
from distserve.core.local_prefill import LOCAL_PREFILL_MODES, LocalPrefillConfig
from distserve.core.request_limits import RequestLimits
from distserve.core.sampling_params import SamplingParams
from distserve.entrypoints.client import CallError
from distserve.entrypoints.server_config import ADMIN_KEY_ENV, API_KEY_ENV, ServerConfig
from placement.cli_hints import refuse_unknown

# Fields whose flag a command would refuse or ignore: kept out of its help. Each pool of a cluster
# sets its instances' role, and an offline engine runs both phases.
_HIDDEN_FIELDS = frozenset({"role"})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] = frozenset()) -> None:
    """One flag per dataclass field (none for ``skip``); values left unset on the command line stay
    out of the namespace. Flags in ``_HIDDEN_FIELDS`` are parsed but not listed."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("internal"):
            continue
        dest = f.name
        kind = hints[f.name]
        kwargs: dict[str, typing.Any] = {"dest": dest, "default": argparse.SUPPRESS}
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        args = typing.get_args(kind)
        if isinstance(kind, types.UnionType):  # "X | None": the flag takes an X
            kind = next(a for a in args if a is not type(None))
            args = typing.get_args(kind)
        if "parse" in f.metadata:  # a structured value, given as JSON
            kwargs["type"] = f.metadata["parse"]
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            kwargs.update(action="append", type=args[0])
        else:
            kwargs["type"] = kind
        default = f.default if f.default is not dataclasses.MISSING else None
        flags = (_flag(dest), *f.metadata.get("aliases", ()))
        shown = f"{help_text} (default: {default})" if dest not in _HIDDEN_FIELDS else argparse.SUPPRESS
        parser.add_argument(*flags, help=shown, **kwargs)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    fields = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    if args.config:
        return EngineConfig.from_yaml(args.config, **given)
    return EngineConfig.from_flat(**given)


def _sampling_options(args: argparse.Namespace) -> dict[str, typing.Any]:
    """The SamplingParams fields given on the command line (``--seed`` is the engine's, see cmd_generate)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(SamplingParams)
        if f.name != "seed" and hasattr(args, f.name)
    }


def _model_from_prompts(args: argparse.Namespace) -> None:
    """``distserve generate MODEL PROMPT...``, as ``vllm serve MODEL``: with no ``--model``, a first
    of several positionals that names a model (a model directory, a built-in tiny model or a preset)
    is the model."""
    if "model" in args or len(args.prompts) < 2:
        return
    from distserve.model_executor.model_loader import names_a_model

    if names_a_model(args.prompts[0]):
        args.model, args.prompts = args.prompts[0], args.prompts[1:]


def cmd_generate(args: argparse.Namespace) -> int:
    _model_from_prompts(args)
    if args.server:
        return _generate_remote(args)
    from distserve.entrypoints.llm import LLM

    engine = LLM(config=_engine_config(args)).engine  # LLM refuses a one-phase role here
    try:
        # One seed: locally the engine's (dummy weights and every unseeded request), remotely the
        # requests'. Flags left out take the model's defaults, as they do on a server.
        params = engine.input_processor.default_params(**_sampling_options(args))
        for i, prompt in enumerate(args.prompts):
            engine.add_request(prompt, params, request_id=str(i))
        stream = len(args.prompts) == 1
        texts = {str(i): "" for i in range(len(args.prompts))}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if stream:
                    print(delta.new_text, end="", flush=True)
                texts[delta.request_id] += delta.new_text
    finally:
        engine.shutdown()
    if stream:
        print()
    else:
        for i, prompt in enumerate(args.prompts):
            print(f"--- {prompt!r}\n{texts[str(i)]}")
    return 0


def _client_options(args: argparse.Namespace) -> dict[str, typing.Any]:
    """Client keyword options from --api-key, --tls-ca and (``distserve roles``) --admin-key."""
    root_certificates = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    return {"api_key": args.api_key, "root_certificates": root_certificates, "admin_key": vars(args).get("admin_key")}


def _client(args: argparse.Namespace):
    from distserve.entrypoints.client import Client

    return Client(args.server, **_client_options(args))


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream each prompt's text from a server, then its timings on stderr."""
    engine_flags = sorted(set(vars(args)) & set(FIELD_SECTION) - {"seed"}) + (["config"] if args.config else [])
    if engine_flags:
        raise ValueError(f"engine settings ({', '.join(engine_flags)}) are the server's: leave them out with --server")
    params = _sampling_options(args)
    if "seed" in args:
        params["seed"] = args.seed
    with _client(args) as client:
        for prompt in args.prompts:
            if len(args.prompts) > 1:
                print(f"--- {prompt!r}")
            for chunk in client.generate(prompt, **params):
                print(chunk.text, end="", flush=True)
            t = chunk.timings
            print()
            print(
                f"[{chunk.usage.completion_tokens} tokens, TTFT {t.ttft * 1e3:.1f} ms, TPOT {t.tpot * 1e3:.1f} ms]",
                file=sys.stderr,
            )
    return 0


def cmd_status(args: argparse.Namespace) -> int:

    with _client(args) as client:
        info = client.cluster_info(timeout=args.timeout)
        health = client.health(timeout=args.timeout)
    state = "draining" if info.draining else health
    print(
        f"{info.model}: {state}, {info.num_pending_requests}/{info.max_pending_requests} requests in flight, "
        f"context {info.max_model_len} tokens"
    )
    defaults = info.default_sampling_params.ListFields()
    if defaults:
        given = ", ".join(f"{field.name} {value:g}" for field, value in defaults)
        print(f"sampling defaults (the model's generation_config.json): {given}")
    columns = ("instance", "role", "node", "TPxPP", "KV used", "KV dtype", "waiting", "running", "held", "pending",
               "preempted", "swapped", "prompt cached", "state")  # fmt: skip
    rows = [columns]
    for i in info.instances:
        used = i.num_blocks - i.num_free_blocks
        rows.append(
            (
                i.name,
                _role_name(i.role),
                i.node_id[:8] or "-",  # enough of the hex id to tell nodes apart
                f"{i.tensor_parallel_size}x{i.pipeline_parallel_size}",
                f"{used}/{i.num_blocks} ({used / max(i.num_blocks, 1):.0%})",
                i.kv_cache_dtype or "-",  # "-": a server from before the field
                str(i.num_waiting),
                str(i.num_running),
                str(i.num_held),
                str(i.num_pending),
                str(i.num_preemptions),
                f"{i.num_swapped} ({i.num_swap_outs} out)",
                f"{i.cached_prompt_tokens / i.prompt_tokens:.0%}" if i.prompt_tokens else "-",
                f"failed: {i.failure}" if i.failure else "ok",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(columns))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    pulls = [(i.name, p) for i in info.instances for p in i.kv_pulls]
    if pulls:
        print("KV pulled (decode <- prefill: transport, pulls, bytes, time, rate):")
    for name, p in pulls:
        rate = f"{p.bytes / p.seconds / 2**20:.0f} MiB/s" if p.seconds else "-"
        print(f"  {name} <- {p.source}: {p.transport}, {p.pulls}, {p.bytes / 2**20:.1f} MiB, {p.seconds:.2f} s, {rate}")
    for i in info.instances:
        if i.num_kv_checksum_mismatches:
            print(f"  {i.name}: {i.num_kv_checksum_mismatches} pulls failed their checksum (each request ran again)")
    if info.kv_tiers:
        print("KV tier (node: blocks held, hits / lookups, from other nodes, evicted):")
    for t in info.kv_tiers:
        held = f"{t.entries}/{t.capacity_blocks} ({t.entries * t.bytes_per_block / 2**20:.0f} MiB)"
        hits = f"{t.hit_blocks}/{t.queried_blocks}"
        print(f"  {t.node_id[:8]}: {held}, {hits}, {t.remote_hit_blocks}, {t.evicted_blocks}")
    if len(info.api_servers) > 1:
        print("API servers (index, pid, requests in flight, CPU seconds, restarts):")
    for server in info.api_servers if len(info.api_servers) > 1 else []:
        print(f"  {server.index}: pid {server.pid}, {server.num_pending_requests}, {server.cpu_seconds:.1f} s, "
              f"{server.restarts}")  # fmt: skip
    print(f"roles: {info.role_control}" + (", latest changes:" if info.role_changes else ""))
    for change in info.role_changes[-5:]:
        _print_role_change(change)
    return 0 if health == "SERVING" and not any(i.failure for i in info.instances) else 1


def _role_name(role: int) -> str:
    from distserve.v1 import distserve_pb2 as pb

    return pb.Role.Name(role).removeprefix("ROLE_").lower()


def _print_role_change(change) -> None:
    when = time.strftime("%H:%M:%S", time.localtime(change.started))
    outcome = f"failed: {change.error}" if change.error else f"{change.seconds * 1e3:.0f} ms"
    print(f"  {when} {change.instance}: {_role_name(change.old_role)} -> {_role_name(change.new_role)}, "
          f"{outcome} ({change.reason})")  # fmt: skip


def cmd_roles(args: argparse.Namespace) -> int:
    from distserve.v1 import distserve_pb2 as pb

    roles = {}
    for change in args.changes:
        name, _, role = change.partition("=")
        value = getattr(pb, f"ROLE_{role.upper()}", None) if role and role.islower() else None
        if not name or value is None or role == "unspecified":
            print(f"distserve roles: '{change}' is not INSTANCE=ROLE with ROLE prefill, decode or colocated",
                  file=sys.stderr)  # fmt: skip
            return 2
        roles[name] = value
    with _client(args) as client:
        if roles or args.control:
            changes = client.set_roles(roles, timeout=args.timeout, role_control=args.control).changes
            for change in changes:
                _print_role_change(change)
            if roles and not changes:
                print("no role changed: every instance has its role already")
            if args.control:
                print(f"role control: {args.control}")
            return 0 if all(not change.error for change in changes) else 1
        info = client.cluster_info(timeout=args.timeout)
    print(f"role control: {info.role_control}")
    for i in info.instances:
        print(f"  {i.name}: {_role_name(i.role)}")
    if info.role_changes:
        print("latest changes:")
        for change in info.role_changes:
            _print_role_change(change)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from distserve.benchmark.profiler import cmd_profile as run

    return run(args, _engine_config(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from distserve.benchmark.command import cmd_bench as run
    from distserve.entrypoints.client import AsyncClient

    return run(args, lambda: AsyncClient(args.server, **_client_options(args)))


def cmd_launch(args: argparse.Namespace) -> int:
    import logging

    from distserve.entrypoints.launch import launch, load_launch_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config", "plan", "model_tag")}
    if args.model_tag is not None:
        if flags.setdefault("model", args.model_tag) != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag} and --model {flags['model']}")
    cluster_config, server_config = load_launch_config(args.config, args.plan, flags)
    launch(cluster_config, server_config)
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from distserve.model_executor.tiny_models import make_tiny_model

    out = make_tiny_model(args.name, args.out)
    print(f"wrote {args.name} to {out}")
    return 0


def _add_client_args(parser: argparse.ArgumentParser, required: bool) -> None:
    group = parser.add_argument_group("server")
    group.add_argument(
        "--server", required=required, help="HOST[:PORT] of a distserve gRPC server (port default: 50051)"
    )
    group.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV), help=f"the server's API key (default: ${API_KEY_ENV})"
    )
    group.add_argument("--tls-ca", help="PEM root certificate(s) to verify the server with: connects over TLS")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("distserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from distserve.model_executor.tiny_models import TINY_MODELS

    parser = argparse.ArgumentParser(prog="distserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--version", action="version", version=f"distserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        usage="%(prog)s [options] [MODEL] PROMPT [PROMPT ...]",
        help="generate text for prompts, in this process or on a server (--server)",
        description="Generate text for prompts. `distserve generate MODEL PROMPT...` takes the first of several "
        "positionals as the model when it names one and --model is not given.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt texts (after an optional MODEL)")
    gen.add_argument("--config", help="YAML file with model/cache/scheduler sections; flags override it")
    _add_client_args(gen, required=False)
    for cls in SECTIONS.values():
        add_dataclass_args(gen.add_argument_group(cls.__name__), cls)
    # --seed is the engine's; with --server it seeds the requests (see cmd_generate).
    add_dataclass_args(gen.add_argument_group("SamplingParams"), SamplingParams, skip=frozenset({"seed", "n"}))
    gen.set_defaults(func=cmd_generate)

    launch = sub.add_parser(
        "launch",
        aliases=["serve"],
        usage="%(prog)s [MODEL] [options]",
        help="serve a cluster over gRPC and OpenAI-compatible HTTP until SIGINT/SIGTERM (alias: serve)",
    )
    launch.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="model to serve, as --model (local directory or built-in name)"
    )
    launch.add_argument("--config", help="YAML file: engine sections, cluster: pools, server:; flags override it")
    launch.add_argument("--plan", help="plan file written by the placement planner (a cluster file)")
    pools = launch.add_argument_group("pools")
    for dest, role, key in POOL_FLAGS:
        pools.add_argument(
            _flag(dest),
            dest=dest,
            type=int,
            default=argparse.SUPPRESS,
            help=f"{key.replace('_', ' ')} of the {role} pool",
        )
    serving = launch.add_argument_group("API servers")
    serving.add_argument(
        "--api-servers",
        type=int,
        default=argparse.SUPPRESS,
        help="API server processes sharing the gRPC and HTTP ports, each admitting and streaming its own requests; "
        "the first manages the cluster (default: 1)",
    )
    serving.add_argument(
        "--server-lease",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds an instance keeps the requests of an API server that stopped asking for their outputs "
        "(default: 10)",
    )
    control = launch.add_argument_group("role control")
    control.add_argument(
        "--role-control",
        choices=ROLE_CONTROL_MODES,
        default=argparse.SUPPRESS,
        help="fixed: roles change only by `distserve roles`; adaptive: also by a controller that moves instances "
        "between colocated and prefill/decode from the SLOs' live attainment (needs --slo-ttft and --slo-tpot)",
    )
    for name, what in (("ttft", "time to first token"), ("tpot", "time per output token")):
        control.add_argument(
            f"--slo-{name}", type=float, default=argparse.SUPPRESS, help=f"{what} SLO in seconds, for adaptive roles"
        )
    local = launch.add_argument_group("per-request disaggregation")
    local.add_argument(
        "--local-prefill",
        choices=LOCAL_PREFILL_MODES,
        default=argparse.SUPPRESS,
        help="which prompts a decode instance prefills itself: off (none: every request is disaggregated), "
        "on (those with at most --local-prefill-max-tokens tokens to compute, its prefix cache's left out), "
        "auto (those, while the queues say it is no slower)",
    )
    local.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=argparse.SUPPRESS,
        help=f"most prompt tokens a decode instance computes for a request it prefills (default: "
        f"{LocalPrefillConfig.max_tokens})",
    )
    limits = launch.add_argument_group("request limits (over one: INVALID_ARGUMENT / HTTP 400)")
    for dest, key in LIMITS_FLAGS:
        f = RequestLimits.__dataclass_fields__[key]
        shown = "" if f.default is None else f" (default: {f.default})"
        limits.add_argument(
            _flag(dest), dest=dest, type=int, default=argparse.SUPPRESS, help=f.metadata["help"] + shown
        )
    add_dataclass_args(launch.add_argument_group("ServerConfig"), ServerConfig)
    for cls in SECTIONS.values():
        add_dataclass_args(launch.add_argument_group(cls.__name__), cls)
    launch.set_defaults(func=cmd_launch)

    status = sub.add_parser("status", help="a server's instances, roles, parallelism, KV use and queues")
    _add_client_args(status, required=True)
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server (default: 10)")
    status.set_defaults(func=cmd_status)

    roles = sub.add_parser(
        "roles",
        usage="%(prog)s --server HOST:PORT [--control {fixed,adaptive}] [INSTANCE=ROLE ...]",
        help="change instances' roles on a running server (prefill, decode, colocated), or list them",
        description="Give instances new roles while the server serves: weights and KV cache stay, requests "
        "move on to other instances or stay where the new role can serve them. Without INSTANCE=ROLE or "
        "--control, list the roles and the latest changes.",
    )
    roles.add_argument("changes", nargs="*", metavar="INSTANCE=ROLE", help="an instance name and its new role")
    roles.add_argument(
        "--control",
        choices=ROLE_CONTROL_MODES,
        help="fixed: take roles back from the controller (before these changes); adaptive: hand them to it "
        "(after them; the server needs its SLOs)",
    )
    _add_client_args(roles, required=True)
    roles.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"the server's admin key, which role changes need (default: ${ADMIN_KEY_ENV})",
    )
    roles.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the changes (default: 120)")
    roles.set_defaults(func=cmd_roles)

    bench = sub.add_parser(
        "bench",
        usage="%(prog)s --server HOST:PORT [options]",
        help="serving benchmark through a server's gRPC API: latency, attainment, goodput",
    )
    _add_client_args(bench, required=True)
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    prof = sub.add_parser(
        "profile",
        usage="%(prog)s --out FILE [options]",
        help="time engine steps over batch shapes and fit a latency model for the planner",
    )
    add_profile_args(prof)
    for cls in SECTIONS.values():
        add_dataclass_args(prof.add_argument_group(cls.__name__), cls)
    prof.set_defaults(func=cmd_profile)

    # Listed for --help; main() hands `place` argv to the planner's own parser, which needs neither torch nor Ray.
    sub.add_parser("place", help="placement planner: TP/PP and instance counts for a workload and SLOs (place --help)")

    make = sub.add_parser("make-model", help="write a built-in tiny model as a Hugging Face directory")
    make.add_argument("name", choices=TINY_MODELS, help="built-in tiny model (random weights, local tokenizer)")
    make.add_argument("--out", required=True, help="directory to write")
    make.set_defaults(func=cmd_make_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["place"]:
        from placement.cli import main as place_main

        return place_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "generate":  # prompts after options: argparse takes one run of positionals only
        args.prompts += [arg for arg in unknown if not arg.startswith("-")]
        unknown = [arg for arg in unknown if arg.startswith("-")]
    if unknown:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        refuse_unknown(subparsers.choices[args.command], unknown)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input, a missing file, a port already taken
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
    except CallError as e:  # one sentence: who answered what, or that no server answers there
        print(f"distserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a command handles signals itself
        print("distserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
