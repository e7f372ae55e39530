"""``distserve place`` (also ``distserve-place`` and ``python -m placement``): pick TP/PP and instance
counts for a model, a cluster, a workload and its SLOs, and write the plan ``distserve launch --plan``
serves; ``distserve place simulate --plan FILE --rate R`` predicts a plan at other rates.

Exit status: 0 done, 1 no configuration meets the SLOs, 2 bad arguments or input files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distserve.core.kv_cache_dtype import KV_CACHE_DTYPES
from distserve.core.model_presets import MODEL_PRESETS, TINY_MODEL_PRESETS, ModelShape, find_model_preset, model_shape
from placement.cli_hints import parse_args
from placement.colocation import (
    DEFAULT_CHUNK_TOKENS,
    ColocatedDeployment,
    ColocatedGoodput,
    colocated_attainment,
    colocated_for_rate,
    colocated_goodput,
    fill_colocated,
    search_colocated,
)
from placement.deployment import Deployment
from placement.fitted import FittedLatency
from placement.hardware import GPUS, ClusterSpec, cluster_from_dict, gpu_preset_name, load_hardware
from placement.latency import InstanceModels, Parallelism
from placement.plan_file import cache_dtype_note, colocated_plan_document, plan_document, read_plan, write_plan
from placement.planner import (
    Prediction,
    attainment_curve,
    deployment_attainment,
    deployment_capacity,
    deployment_for_rate,
    deployment_goodput,
    fit_to_rate,
    simulate_deployment,
    unloaded_latency,
)
from placement.roofline import Efficiency
from placement.search import Candidate, Objective, PhaseProblem, SearchResult, search
from placement.workload import (
    WORKLOAD_PRESETS,
    RequestSpec,
    arrival_times,
    fit_context,
    load_length_trace,
    parse_length,
    preset_workload,
    synthetic_workload,
)

# Requests drawn for a problem; a probe simulates a prefix of them (``PhaseProblem.probe_size``).
POOL_SIZE = 20_000


class UsageError(Exception):
    """Bad arguments or input files: exit 2 with the message."""


# --- inputs -------------------------------------------------------------------------------------------------


def load_model_shape(model: str) -> ModelShape:
    """A preset name, a built-in tiny model's name or a local Hugging Face model directory (its config.json)."""
    path = Path(model).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.exists():
            raise UsageError(f"{path} has no config.json: it is not a Hugging Face model directory")
        return model_shape(json.loads(config_file.read_text()))
    preset = find_model_preset(model) or TINY_MODEL_PRESETS.get(model.lower())
    if preset is not None:
        return model_shape(preset)
    raise UsageError(
        f"unknown model {model!r}: pass a model directory, a preset ({', '.join(MODEL_PRESETS)}) or a built-in "
        f"tiny model ({', '.join(TINY_MODEL_PRESETS)})"
    )


def workload_requests(workload: dict[str, Any], n: int, seed: int, max_context: int) -> list[RequestSpec]:
    """``n`` requests of a workload note: {"preset": name}, {"prompt_len", "output_len"} or {"trace": path}."""
    if "preset" in workload:
        return preset_workload(workload["preset"], n, seed, max_context)
    if "trace" in workload:
        trace = load_length_trace(workload["trace"])
        picks = np.random.default_rng(seed).integers(0, len(trace), size=n)
        return fit_context([trace[i] for i in picks], max_context)
    prompt, output = parse_length(workload["prompt_len"]), parse_length(workload["output_len"])
    return fit_context(synthetic_workload(n, prompt, output, seed), max_context)


def hardware_note(cluster: ClusterSpec) -> dict[str, Any]:
    return {
        "gpu": dataclasses.asdict(cluster.gpu),
        "num_nodes": cluster.num_nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "intra_node_bandwidth": cluster.intra_node_bandwidth,
        "inter_node_bandwidth": cluster.inter_node_bandwidth,
    }


def build_problem(notes: dict[str, Any]) -> PhaseProblem:
    """The planning problem from plan notes (as ``search_notes`` builds them from flags)."""
    shape = load_model_shape(notes["model"])
    cluster = cluster_from_dict(notes["hardware"])
    latency = notes["latency"]
    fitted = None
    if latency.get("profiles"):
        fitted = {}
        for path in latency["profiles"]:
            profile = FittedLatency.load(path)
            fitted[Parallelism(profile.meta.get("tp", 1), profile.meta.get("pp", 1))] = profile
    models = InstanceModels(
        shape,
        cluster,
        Efficiency(**latency.get("efficiency", {})),
        fitted,
        max_batch_tokens=notes["max_batch_tokens"],
        max_batch_size=notes["max_batch_size"],
        kv_cache_dtype=cache_dtype_note(notes),
    )
    pool = max(POOL_SIZE, notes["num_requests"])
    requests = workload_requests(notes["workload"], pool, notes["seed"], shape.max_position_embeddings)
    arrivals = arrival_times(pool, 1.0, notes["burstiness"], notes["seed"])
    slo = notes["slo"]
    return PhaseProblem(
        models,
        tuple(requests),
        tuple(arrivals),
        Objective(slo["ttft"], slo["tpot"], slo["target"]),
        notes["num_requests"],
    )


def search_notes(args: argparse.Namespace) -> dict[str, Any]:
    """Plan notes (the planner's inputs) from ``distserve place`` flags."""
    if args.hardware:
        cluster = load_hardware(args.hardware)
    else:
        hardware: dict[str, Any] = {"gpu": args.gpu, "num_nodes": args.nodes, "gpus_per_node": args.gpus_per_node}
        for key in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(args, key) is not None:
                hardware[key] = getattr(args, key)
        cluster = cluster_from_dict(hardware)
    if args.trace:
        workload: dict[str, Any] = {"trace": str(args.trace)}
    elif args.prompt_len or args.output_len:
        if not (args.prompt_len and args.output_len):
            raise UsageError("give both --prompt-len and --output-len (or --workload / --trace)")
        workload = {"prompt_len": args.prompt_len, "output_len": args.output_len}
    else:
        workload = {"preset": args.workload}
    if args.profile:
        latency: dict[str, Any] = {"model": "fitted", "profiles": [str(p) for p in args.profile]}
    else:
        efficiency = Efficiency(args.compute_efficiency, args.memory_efficiency, args.communication_efficiency)
        latency = {"model": "roofline", "efficiency": dataclasses.asdict(efficiency)}
    return {
        "model": args.model,
        "hardware": hardware_note(cluster),
        "workload": workload,
        "burstiness": args.burstiness,
        "slo": {"ttft": args.slo_ttft, "tpot": args.slo_tpot, "target": args.target},
        "latency": latency,
        "max_batch_tokens": args.max_num_batched_tokens,
        "max_batch_size": args.max_num_seqs,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_requests": args.num_requests,
        "seed": args.seed,
    }


# --- choosing a deployment ----------------------------------------------------------------------------------


def fill_cluster(candidate: Candidate, cluster: ClusterSpec) -> Deployment | None:
    """As many instances of ``candidate`` as the cluster holds, each added to the phase with less goodput."""
    p, d = candidate.prefill, candidate.decode
    deployment = deployment_for_rate(candidate, min(p.goodput, d.goodput))
    if not deployment.fits(cluster):
        return None
    while True:
        behind = deployment.prefill_instances * p.goodput <= deployment.decode_instances * d.goodput
        grown = deployment.grown("prefill" if behind else "decode")
        if not grown.fits(cluster):
            return deployment
        deployment = grown


def choose(
    problem: PhaseProblem, ranked: list[Candidate], rate: float | None, top: int
) -> tuple[Deployment, Prediction | None] | None:
    """For a rate: of the ``top`` best candidates, the deployment meeting the target with the fewest
    GPUs (then the best attainment). Without one: the best candidate filling the cluster."""
    cluster = problem.models.cluster
    if rate is None:
        for candidate in ranked[:top]:
            deployment = fill_cluster(candidate, cluster)
            if deployment is not None:
                return deployment, None
        return None
    options = []
    for candidate in ranked[:top]:
        start = deployment_for_rate(candidate, rate)
        if not start.fits(cluster):
            continue
        deployment, prediction = fit_to_rate(problem, start, rate, lambda d: d.fits(cluster))
        meets = prediction.attainment >= problem.objective.target
        options.append((not meets, deployment.gpus, -prediction.attainment, deployment, prediction))
    if not options:
        return None
    *_, deployment, prediction = min(options, key=lambda o: o[:3])
    return deployment, prediction


# --- output -------------------------------------------------------------------------------------------------


def format_table(title: str, ranked: list[Candidate], top: int) -> str:
    lines = [title, f"  {'prefill TP,PP':>13} {'req/s':>8} {'decode TP,PP':>13} {'req/s':>8} {'req/s/GPU':>10}"]
    for c in ranked[:top]:
        lines.append(
            f"  {str(c.prefill.parallelism):>13} {c.prefill.goodput:>8.4g} "
            f"{str(c.decode.parallelism):>13} {c.decode.goodput:>8.4g} {c.per_gpu:>10.4g}"
        )
    if not ranked:
        lines.append("  (no pair: none fits the cluster's nodes, or none met the SLOs)")
    return "\n".join(lines)


def format_prediction(p: Prediction) -> str:
    ttft = np.percentile([r.ttft for r in p.results], [50, 90])
    tpot = np.percentile([r.tpot for r in p.results], [50, 90])
    return (
        f"at {p.rate:.3g} req/s: SLO attainment {p.attainment:.1%} (TTFT {p.ttft_attainment:.1%}, "
        f"TPOT {p.tpot_attainment:.1%}); TTFT p50/p90 {ttft[0] * 1e3:.0f}/{ttft[1] * 1e3:.0f} ms, "
        f"TPOT p50/p90 {tpot[0] * 1e3:.1f}/{tpot[1] * 1e3:.1f} ms"
    )


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def why_no_pair(problem: PhaseProblem, result: SearchResult) -> str:
    """Why no pair made the tables: the SLO no configuration of a phase meets, with the least latency
    any of them reaches even unloaded; or, when both phases have one, that no pair fits the nodes."""
    objective, reasons = problem.objective, []
    for phase, slo, limit in (("prefill", "TTFT", objective.ttft), ("decode", "TPOT", objective.tpot)):
        tried = [g for (p, _), g in result.phase_goodputs.items() if p == phase]
        if any(g.goodput > 0 for g in tried):
            continue
        best, par = min((unloaded_latency(problem, phase, g.parallelism), g.parallelism) for g in tried)
        reasons.append(
            f"the {slo} SLO is {format_seconds(limit)}, and even unloaded {objective.target:.0%} of requests "
            f"take up to {format_seconds(best)} at the best {phase} TP,PP ({par})"
        )
    return "; ".join(reasons) or "no prefill and decode configurations fit the cluster's nodes together"


def rate_too_high(
    problem: PhaseProblem, ranked: list[Candidate], rate: float, tried: tuple[Deployment, Prediction] | None
) -> int:
    """Exit 1 saying what the cluster tops out at within the SLOs, and with which deployment: the best
    pair filling the cluster, or the largest deployment ``tried`` for ``rate`` when it does more."""
    options = [choose(problem, ranked, None, len(ranked))[0]]
    if tried is not None:
        print(f"largest deployment tried: {tried[0].describe()}\n  predicted {format_prediction(tried[1])}")
        options.append(tried[0])
    goodputs = [(deployment_goodput(problem, d, deployment_capacity(problem, d)), d) for d in options]
    most, deployment = max(goodputs, key=lambda pair: pair[0])
    print(
        f"no deployment on this cluster meets the SLOs at {rate:g} req/s: the most it serves within them is "
        f"{most:.3g} req/s, with {deployment.describe()}; plan for that rate or less, or add GPUs",
        file=sys.stderr,
    )
    return 1


def plot_curve(
    path: str, model: str, deployment: Deployment | ColocatedDeployment, points: list[tuple[float, float]],
    objective: Objective, rate: float | None,
) -> None:  # fmt: skip
    from placement.plots import plot_attainment_vs_rate

    title = (
        f"{model}: predicted SLO attainment\n{deployment.describe()}\n"
        f"SLOs: TTFT {format_seconds(objective.ttft)}, TPOT {format_seconds(objective.tpot)}"
    )
    marks = {f"planned rate {rate:g} req/s": rate} if rate else {}
    plot_attainment_vs_rate({"predicted": points}, objective.target, path, title, marks=marks)


def warn_profiles(notes: dict[str, Any], prog: str) -> None:
    """A sentence on stderr for each profile measured on another device or model, or with another KV
    cache dtype, than the question's. A warning, not a refusal: memory (the KV an instance holds, the
    bytes a hand-over moves) follows the question's KV cache dtype whatever the profile, and only the
    step times are the profile's own."""
    for path in notes["latency"].get("profiles", []):
        mismatch = FittedLatency.load(path).mismatch(notes["model"], notes["hardware"]["gpu"]["name"],
                                                     cache_dtype_note(notes))  # fmt: skip
        if mismatch:
            print(f"{prog}: warning: {path} was {mismatch}: its latencies will not be this cluster's",
                  file=sys.stderr)  # fmt: skip


# --- commands -----------------------------------------------------------------------------------------------


def cmd_search(args: argparse.Namespace) -> int:
    notes = search_notes(args)
    warn_profiles(notes, args.prog)
    problem = build_problem(notes)
    cluster = problem.models.cluster
    affinities = ("high", "low") if args.affinity == "auto" else (args.affinity,)
    started = time.perf_counter()
    result: SearchResult = search(problem, affinities, args.processes)
    elapsed = time.perf_counter() - started
    print(
        f"{notes['model']} on {cluster.num_nodes} x {cluster.gpus_per_node} {cluster.gpu.name}, KV cache "
        f"{args.kv_cache_dtype}; SLOs TTFT {args.slo_ttft:g} s, TPOT {args.slo_tpot:g} s at {args.target:.0%}; "
        f"{result.simulated} configurations simulated, {result.pruned} pruned, {elapsed:.1f} s"
    )
    ranked = []
    if "high" in affinities:
        print(
            format_table(
                "high node-affinity (instances placed independently, KV over the network):", result.high, args.top
            )
        )
        ranked += result.high[: args.top]
    if "low" in affinities:
        print(
            format_table(
                "low node-affinity (prefill and decode stages share nodes, KV over NVLink):", result.low, args.top
            )
        )
        ranked += result.low[: args.top]
    ranked.sort(key=lambda c: -c.per_gpu)
    colocated = [] if args.no_colocated else search_colocated(problem, args.chunk_tokens, args.processes, args.top)
    if not args.no_colocated:
        print(format_colocated(colocated, args.chunk_tokens, args.top))
        verdict = compare_deployments(ranked, colocated)
        print(verdict["sentence"])
        notes["comparison"] = {k: v for k, v in verdict.items() if k != "sentence"}
    if colocated and (not ranked or colocated[0].per_gpu > ranked[0].per_gpu):
        return plan_colocated(args, problem, notes, colocated[0])
    if not ranked:
        print(f"no configuration meets the SLOs on this cluster: {why_no_pair(problem, result)}", file=sys.stderr)
        return 1
    chosen = choose(problem, ranked, args.rate, len(ranked))
    if chosen is None or (chosen[1] is not None and chosen[1].attainment < args.target):
        return rate_too_high(problem, ranked, args.rate, chosen)
    deployment, prediction = chosen
    capacity = deployment_capacity(problem, deployment)
    goodput = deployment_goodput(problem, deployment, capacity)
    print(f"plan: {deployment.describe()}")
    if prediction is not None:
        print(f"  predicted {format_prediction(prediction)}")
    print(f"  goodput {goodput:.3g} req/s ({goodput / deployment.gpus:.3g} per GPU); capacity {capacity:.3g} req/s")
    layout = deployment.node_layout(cluster.num_nodes, cluster.gpus_per_node) or []
    for i, segments in enumerate(layout):
        print(f"  node {i}: {', '.join(segments) if segments else '(free)'}")
    notes.update(
        rate=args.rate,
        instance_goodput={
            "prefill": _instance_goodput(result, "prefill", deployment.prefill),
            "decode": _instance_goodput(result, "decode", deployment.decode),
        },
        predicted={
            "attainment_at_rate": None if prediction is None else round(prediction.attainment, 4),
            "goodput": round(goodput, 4),
            "goodput_per_gpu": round(goodput / deployment.gpus, 4),
            "gpus": deployment.gpus,
        },
        nodes={f"node-{i}": segments for i, segments in enumerate(layout)},
    )
    if args.out:
        document = plan_document(
            deployment, args.model, cluster.gpus_per_node, args.max_num_batched_tokens, args.max_num_seqs, notes,
            deployment.stage_nodes(cluster.num_nodes, cluster.gpus_per_node),
        )  # fmt: skip
        write_plan(args.out, document)
        print(f"wrote {args.out}: serve it with `distserve launch --plan {args.out}`")
    if args.plot:
        measure = deployment_attainment(problem, deployment)
        points = attainment_curve(measure, args.target, goodput or capacity, [args.rate] if args.rate else [])
        plot_curve(args.plot, notes["model"], deployment, points, problem.objective, args.rate)
        print(f"wrote {args.plot}")
    return 0


def format_colocated(found: list[ColocatedGoodput], chunk_tokens: int, top: int) -> str:
    lines = [f"colocated (both phases per instance, chunked prefill of {chunk_tokens} tokens a step):",
             f"  {'TP,PP':>13} {'req/s':>8} {'req/s/GPU':>10}"]  # fmt: skip
    lines += [f"  {str(g.parallelism):>13} {g.goodput:>8.4g} {g.per_gpu:>10.4g}" for g in found[:top]]
    if not found:
        lines.append("  (none meets the SLOs at any rate)")
    return "\n".join(lines)


def compare_deployments(ranked: list[Candidate], colocated: list[ColocatedGoodput]) -> dict[str, Any]:
    """Which of the best disaggregated pair and the best colocated instance serves more per GPU."""
    disaggregated = ranked[0].per_gpu if ranked else 0.0
    coloc = colocated[0].per_gpu if colocated else 0.0
    if not disaggregated and not coloc:
        sentence = "neither disaggregated nor colocated instances meet the SLOs"
        winner = None
    else:
        winner = "colocated" if coloc > disaggregated else "disaggregated"
        best, other = max(coloc, disaggregated), min(coloc, disaggregated)
        by = f"{best / other:.2f}x" if other else "the other meets the SLOs at no rate"
        sentence = (f"{winner} wins: {best:.3g} against {other:.3g} req/s per GPU ({by}); "
                    f"disaggregated {disaggregated:.3g}, colocated {coloc:.3g}")  # fmt: skip
    return {"sentence": sentence, "winner": winner, "disaggregated_per_gpu": round(disaggregated, 4),
            "colocated_per_gpu": round(coloc, 4)}  # fmt: skip


def plan_colocated(args: argparse.Namespace, problem: PhaseProblem, notes: dict[str, Any],
                   best: ColocatedGoodput) -> int:  # fmt: skip
    """The colocated plan: for ``args.rate``, or filling the cluster; written with ``--out``."""
    cluster = problem.models.cluster
    if args.rate is None:
        deployment, attained = fill_colocated(best, cluster, args.chunk_tokens), None
        if deployment is None:
            print("no colocated instance fits the cluster's nodes", file=sys.stderr)
            return 1
    else:
        deployment, attained = colocated_for_rate(problem, best, args.chunk_tokens, args.rate)
        if attained < args.target:
            most = fill_colocated(best, cluster, args.chunk_tokens)
            print(f"no deployment on this cluster meets the SLOs at {args.rate:g} req/s: the most it serves within "
                  f"them is about {most.instances * best.goodput:.3g} req/s, with {most.describe()}; plan for "
                  "that rate or less, or add GPUs", file=sys.stderr)  # fmt: skip
            return 1
    goodput = deployment.instances * best.goodput
    print(f"plan: {deployment.describe()}")
    if attained is not None:
        print(f"  predicted SLO attainment {attained:.1%} at {args.rate:g} req/s")
    print(f"  goodput about {goodput:.3g} req/s ({best.per_gpu:.3g} per GPU), {best.goodput:.3g} per instance")
    notes.update(
        rate=args.rate,
        deployment="colocated",
        instance_goodput={"colocated": round(best.goodput, 4)},
        predicted={"attainment_at_rate": None if attained is None else round(attained, 4),
                   "goodput": round(goodput, 4), "goodput_per_gpu": round(best.per_gpu, 4), "gpus": deployment.gpus},
    )  # fmt: skip
    if args.out:
        document = colocated_plan_document(deployment, args.model, cluster.gpus_per_node, args.max_num_seqs, notes)
        write_plan(args.out, document)
        print(f"wrote {args.out}: serve it with `distserve launch --plan {args.out}`")
    if args.plot:
        par, chunk, count = deployment.parallelism, deployment.chunk_tokens, deployment.instances
        measure = lambda rate: colocated_attainment(problem, par, chunk, rate, count)  # noqa: E731
        points = attainment_curve(measure, args.target, goodput, [args.rate] if args.rate else [])
        plot_curve(args.plot, notes["model"], deployment, points, problem.objective, args.rate)
        print(f"wrote {args.plot}")
    return 0


def _instance_goodput(result: SearchResult, phase: str, par: Parallelism) -> float | None:
    g = result.phase_goodputs.get((phase, par))
    return None if g is None else round(g.goodput, 4)


def cmd_simulate(args: argparse.Namespace) -> int:
    deployment, notes, _ = read_plan(args.plan)
    for key in ("slo_ttft", "slo_tpot", "target"):
        if getattr(args, key) is not None:
            notes["slo"][key.removeprefix("slo_")] = getattr(args, key)
    warn_profiles(notes, args.prog)
    problem = build_problem(notes)
    print(f"{deployment.describe()}")
    if isinstance(deployment, ColocatedDeployment):
        par, chunk, count = deployment.parallelism, deployment.chunk_tokens, deployment.instances
        measure = lambda rate: colocated_attainment(problem, par, chunk, rate, count)  # noqa: E731
        knee = count * colocated_goodput(problem, par, chunk).goodput
        rates = args.rates or [args.rate or notes.get("rate") or knee]
        points = [(rate, measure(rate)) for rate in rates]
        for rate, attained in points:
            print(f"  at {rate:.3g} req/s: SLO attainment {attained:.1%}")
    else:
        measure = deployment_attainment(problem, deployment)
        capacity = deployment_capacity(problem, deployment)
        rates = args.rates or [args.rate or notes.get("rate") or capacity]
        points = []
        for rate in rates:
            prediction = simulate_deployment(problem, deployment, rate)
            points.append((rate, prediction.attainment))
            print(f"  {format_prediction(prediction)}")
        knee = deployment_goodput(problem, deployment, capacity) or capacity
    if args.json:
        print(json.dumps([{"rate": r, "attainment": a} for r, a in points]))
    if args.plot:
        curve = attainment_curve(measure, problem.objective.target, knee or max(rates), rates)
        plot_curve(args.plot, notes["model"], deployment, curve, problem.objective, notes.get("rate"))
        print(f"wrote {args.plot}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from distserve.core.timeline import read_jsonl, write_jsonl
    from placement import compare

    run = read_jsonl(args.trace)
    if not run:
        raise UsageError(f"{args.trace}: no request timelines")
    fitted = FittedLatency.load(args.profile)
    setup = compare.RunSetup(**{f: getattr(args, f) for f in compare.RunSetup.__dataclass_fields__})
    contention = delays = None
    if args.calibrate:
        calibration = read_jsonl(args.calibrate)
        contention = compare.fit_contention(calibration, fitted.prefill_time, fitted.decode_time)
        delays = compare.fit_delays(calibration)
        if not setup.colocated_instances:
            setup.transfer_fixed, setup.transfer_per_token = compare.fit_transfer(calibration)
        print(
            f"calibrated from {args.calibrate}: transfer {setup.transfer_fixed * 1e3:.2f} ms + "
            f"{setup.transfer_per_token * 1e6:.2f} us/token; {delays}; contention {contention}"
        )
    sim = compare.simulate_like(run, setup, fitted.prefill_time, fitted.decode_time, contention, delays)
    if args.sim_out:
        write_jsonl(args.sim_out, sim)
        print(f"wrote {args.sim_out}")
    failed = sum(t.error is not None for t in run)
    print(f"{len(run)} requests ({failed} failed in the run) against the simulation with {args.profile}")
    print(compare.format_stages(compare.compare_stages(run, sim)))
    steps = compare.compare_steps(run, fitted.decode_time)
    if steps.count:
        by_batch = ", ".join(f"{b}: {r:.2f} ({n})" for b, (n, r) in steps.by_batch.items())
        print(f"real step time / model, median over {steps.count} steps: {steps.median_ratio:.2f}")
        print(f"  by batch size (ratio, steps): {by_batch}")
        for label, (count, ratio) in compare.step_slowdown(run, fitted.decode_time).items():
            print(f"  {label}: {ratio:.2f} ({count} steps)")
    if args.slo_ttft and args.slo_tpot:
        real, predicted = (compare.attainment(t, args.slo_ttft, args.slo_tpot) for t in (run, sim))
        print(f"attainment: real {real:.1%}, simulated {predicted:.1%} ({(predicted - real) * 100:+.1f} points)")
    return 0


# --- parsers ------------------------------------------------------------------------------------------------


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None
    if not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return rates


def _gpu_name(text: str) -> str:
    # An unknown name passes through unchanged, for argparse's "invalid choice" message.
    return gpu_preset_name(text) or text


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def search_parser(prog: str = "distserve place") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        usage=f"%(prog)s --model MODEL --slo-ttft S --slo-tpot S [options]\n"
        f"       {prog} simulate --plan FILE [--rate R | --rates R1,R2,...] [options]\n"
        f"       {prog} compare --trace RUN --profile FILE [options]",
        description="Pick TP/PP and instance counts for a model, a cluster, a workload and its SLOs; write a plan "
        f"file for `distserve launch --plan`. '{prog} simulate' predicts a plan's attainment at given rates and "
        f"'{prog} compare' compares a real run's request timelines with their simulation (each has --help).",
    )
    p.set_defaults(prog=prog)
    p.add_argument(
        "--model",
        required=True,
        help=f"model directory (config.json), preset ({', '.join(MODEL_PRESETS)}) or "
        f"built-in tiny model ({', '.join(TINY_MODEL_PRESETS)})",
    )
    hw = p.add_argument_group("cluster")
    hw.add_argument(
        "--gpu",
        default="A100-80GB",
        type=_gpu_name,
        choices=sorted(GPUS),
        help="GPU type, in any case (default: A100-80GB)",
    )
    hw.add_argument("--nodes", type=_positive(int), default=1, help="nodes (default: 1)")
    hw.add_argument("--gpus-per-node", type=_positive(int), default=8, help="GPUs per node (default: 8)")
    hw.add_argument("--intra-node-bandwidth", type=_positive(float), help="bytes/s per GPU within a node")
    hw.add_argument("--inter-node-bandwidth", type=_positive(float), help="bytes/s per node across nodes")
    hw.add_argument("--hardware", help="YAML cluster spec (gpu, num_nodes, ...); replaces the flags above")
    wl = p.add_argument_group("workload")
    wl.add_argument(
        "--workload", default="chat", choices=sorted(WORKLOAD_PRESETS), help="length preset (default: chat)"
    )
    wl.add_argument("--prompt-len", help="prompt length distribution, e.g. lognormal:512:0.8,max=2048")
    wl.add_argument("--output-len", help="output length distribution, e.g. 128 or uniform:64:256")
    wl.add_argument("--trace", help="JSONL trace of {prompt_len, output_len}, resampled")
    wl.add_argument("--burstiness", type=_positive(float), default=1.0, help="gamma shape of gaps; 1 is Poisson")
    slo = p.add_argument_group("objective")
    slo.add_argument("--slo-ttft", type=_positive(float), required=True, help="TTFT SLO, seconds")
    slo.add_argument("--slo-tpot", type=_positive(float), required=True, help="TPOT SLO, seconds")
    slo.add_argument("--target", type=_positive(float), default=0.9, help="attainment target (default: 0.9)")
    slo.add_argument(
        "--rate", type=_positive(float), help="expected req/s to size the plan for (default: fill the cluster)"
    )
    srch = p.add_argument_group("search")
    srch.add_argument(
        "--affinity",
        choices=("auto", "high", "low"),
        default="auto",
        help="node-affinity algorithm; auto runs both and picks the plan (default: auto)",
    )
    srch.add_argument(
        "--profile",
        action="append",
        type=Path,
        help="fitted latency file from `distserve profile` (repeat per TP,PP); default: roofline",
    )
    for name, what in (("compute", "peak FLOP/s"), ("memory", "memory bandwidth"), ("communication", "link bandwidth")):
        default = getattr(Efficiency, name)
        srch.add_argument(f"--{name}-efficiency", type=_positive(float), default=default,
                          help=f"roofline: achieved fraction of {what} (default: {default})")  # fmt: skip
    # The engine's names (launch, generate); the planner's first names stay as aliases.
    srch.add_argument("--max-num-batched-tokens", "--max-batch-tokens", type=_positive(int), default=4096,
                      help="prefill token budget per batch, as the engine's (default: 4096)")  # fmt: skip
    srch.add_argument("--max-num-seqs", "--max-batch-size", type=_positive(int), default=256,
                      help="decode batch limit, as the engine's (default: 256)")  # fmt: skip
    srch.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                      help="what the KV cache stores, as the engine's flag: auto (the model's dtype), int8 or fp8 "
                      "(a byte a value and a float32 scale per token and KV head); sets the KV tokens an "
                      "instance holds and the bytes a decode step reads and a hand-over moves, and the plan "
                      "serves with it (default: auto)")  # fmt: skip
    srch.add_argument("--num-requests", type=_positive(int), default=1000,
                      help="requests per simulation, at least (default: 1000)")  # fmt: skip
    srch.add_argument("--seed", type=int, default=0, help="seed of the workload and arrival draws (default: 0)")
    srch.add_argument("--processes", type=_positive(int), help="worker processes (default: CPU count)")
    srch.add_argument("--top", type=_positive(int), default=5, help="rows per table (default: 5)")
    srch.add_argument(
        "--chunk-tokens",
        type=_positive(int),
        default=DEFAULT_CHUNK_TOKENS,
        help="colocated instances: tokens per chunked-prefill step, as the engine's "
        f"max_num_batched_tokens with --enable-chunked-prefill (default: {DEFAULT_CHUNK_TOKENS})",
    )
    srch.add_argument(
        "--no-colocated",
        action="store_true",
        help="plan disaggregated deployments only, without simulating colocated ones to compare",
    )
    out = p.add_argument_group("output")
    out.add_argument("--out", help="plan file to write (YAML for distserve launch --plan)")
    out.add_argument("--plot", help="PNG of predicted attainment against rate for the plan")
    return p


def simulate_parser(prog: str = "distserve place simulate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Predict a plan's SLO attainment at given rates.")
    p.set_defaults(prog=prog.removesuffix(" simulate"))
    p.add_argument("--plan", required=True, help="plan file written by distserve place --out")
    p.add_argument("--rate", type=_positive(float), help="req/s (default: the plan's rate, else its capacity)")
    p.add_argument("--rates", type=_rates, help="comma-separated req/s")
    p.add_argument("--slo-ttft", type=_positive(float), help="override the plan's TTFT SLO")
    p.add_argument("--slo-tpot", type=_positive(float), help="override the plan's TPOT SLO")
    p.add_argument("--target", type=_positive(float), help="override the plan's attainment target")
    p.add_argument("--json", action="store_true", help="also print the (rate, attainment) points as JSON")
    p.add_argument("--plot", help="PNG of predicted attainment against rate, across the plan's knee and these rates")
    return p


def compare_parser(prog: str = "distserve place compare") -> argparse.ArgumentParser:
    from placement.compare import RunSetup

    defaults = RunSetup()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Simulate the requests of a real run (distserve bench --trace-out) on the same deployment "
        "and say, stage by stage, where the simulation and the run part ways.",
    )
    p.add_argument("--trace", required=True, help="request timelines of the run (distserve bench --trace-out)")
    p.add_argument("--profile", required=True, type=Path, help="fitted latency file from distserve profile")
    dep = p.add_argument_group("deployment the run was made on")
    for name, setting in RunSetup.__dataclass_fields__.items():
        default = getattr(defaults, name)
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(default, bool) else {"type": type(default)}
        dep.add_argument(f"--{name.replace('_', '-')}", default=default, **kind,
                         help=f"{setting.metadata['help']} (default: {default})")  # fmt: skip
    p.add_argument("--slo-ttft", type=_positive(float), help="TTFT SLO, seconds: compare attainment too")
    p.add_argument("--slo-tpot", type=_positive(float), help="TPOT SLO, seconds")
    p.add_argument(
        "--calibrate",
        help="timelines of a loaded run on the same deployment: fit the KV transfer time, the serving path's "
        "delays and how much batches slow down beside other work (alone, beside another instance's batch, "
        "during a pull) from them",
    )
    p.add_argument("--sim-out", help="write the simulated timelines here (JSON lines)")
    return p


COMMANDS = {
    "simulate": (simulate_parser, cmd_simulate),
    "compare": (compare_parser, cmd_compare),
}


def main(argv: Sequence[str] | None = None, prog: str = "distserve place") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        make_parser, command = COMMANDS[argv[0]]
        args = parse_args(make_parser(f"{prog} {argv[0]}"), argv[1:])
    else:
        command = cmd_search
        args = parse_args(search_parser(prog), argv[1:] if argv and argv[0] == "search" else argv)
    try:
        return command(args)
    except (UsageError, ValueError, OSError, KeyError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        print(f"{prog}: error: {detail}", file=sys.stderr)
        return 2


def entry_point() -> None:
    """The ``distserve-place`` console script."""
    sys.exit(main(prog="distserve-place"))
