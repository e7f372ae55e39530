"""Goodput of adaptive roles against static deployments of the same 2 instances, on long prompts,
short prompts, and a workload that alternates between the two.

    python scripts/experiments/exp_adaptive_roles.py [--phase-seconds 10] [--out results/adaptive-roles]

Deployments (one torch thread per instance): **colocated** (2 instances, prefill-first), **chunked**
(2 colocated instances with chunked prefill), **disaggregated** (1 prefill + 1 decode), **adaptive**
(starts as 1 prefill + 1 decode, chunked prefill whenever colocated, ``--role-control adaptive``;
with ``--tpot-aware-chunking`` these chunked deployments cut their chunks to the decoding requests'
TPOT SLOs) and, as its bound, the **oracle** (each class's better static layout set the moment its phase
begins) and the **staged-oracle** (the same, but an instance leaving a decode role keeps it until
the requests in flight finish). Each request class has its SLOs, set as for the static comparison
(``exp_disagg_vs_colocated.py``): from the prefill-first colocated deployment's single-request
latencies, ``--ttft-scale`` x the median TTFT and ``--tpot-scale`` x the median TPOT (or per class,
``--class-scales``). Requests carry their class's SLOs, by which the controller and the attainment
judge them. Goodput is the highest Poisson rate at which ``--target`` of the requests meet both of
their SLOs: by bisection, or with ``--rates`` over a fixed grid probed ``--repeats`` times (the
highest rate at which, and below which everywhere, the pooled probes meet the target), which one
unlucky probe cannot throw into the wrong half of the range. The alternating workload switches class
every ``--phase-seconds``; its probes last ``--cycles`` cycles (long, then short). Before a workload
is measured, every deployment serves it at a quarter of ``--rate-high``: a single-class one for
``--warmup-seconds``, an alternating one for a cycle (adaptive roles settle into a layout for it, or
see each class once; static ones are unchanged by it).

With ``--one-cluster``, all but colocated are one cluster (the adaptive deployment's) whose roles
and role control are set by hand before each probe, every deployment in turn at each rate, in
another order at each: the comparison is then not between separately started processes, whose speed
differs by a few points of attainment from one start to the next, nor between minutes apart, over
which this machine's speed drifts by as much. Each probe keeps the steps its instances ran, and the
report gives its step time against the run's, like step for like step. ``--same-arrivals`` sends
every repeat the same requests, so that a deployment's repeats differ only in when they ran; only
then does the report fit each deployment's attainment at the run's typical step time.

``--report --rejudge`` judges a finished run's static deployments by other SLO scales (their
latencies do not depend on the SLOs): which scales pull the classes apart, and, from the long and
short probes averaged at each rate, what an alternating workload would give each static deployment
and each class in its better one, before an alternating run is spent on them.

The load runs in a process of its own (``drive``), so that the client does not share the
server's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

from distserve.cluster.role_control.config import RoleControlConfig

# Each class's prompt and output lengths (uniform between the bounds). Long prompts, moderate
# outputs: every prefill stalls a colocated instance's decoding. Short prompts, long outputs:
# prefill is cheap, decode capacity and smooth steps count.
DEFAULT_CLASSES = "long:512-768:64,short:16-64:128"
CLASS_NAMES = ("long", "short")
LLAMA_58M = "llama-58m"
CHUNK_TOKENS = 256
DEPLOYMENTS = {
    "colocated": {"colocated": {"instances": 2}},
    "chunked": {"colocated": {"instances": 2}, "enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK_TOKENS},
    "disaggregated": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
    "adaptive": {
        "prefill": {"instances": 1},
        "decode": {"instances": 1},
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": CHUNK_TOKENS,
    },
}
DEPLOYMENTS["oracle"] = DEPLOYMENTS["adaptive"]  # roles set by the load at each phase change, not by the controller
# The oracle whose instance leaving a decode role keeps it until the requests in flight finish: the
# change's cost to what is decoding, apart from the rest of it.
DEPLOYMENTS["staged-oracle"] = DEPLOYMENTS["oracle"]
ORACLES = ("oracle", "staged-oracle")
ROLE_CHANGING = ("adaptive", *ORACLES)  # deployments whose roles change during a probe
# The oracle's layout of the 2 instances for each class: the better static one for it.
ORACLE_LAYOUTS = {"long": ("colocated", "colocated"), "short": ("prefill", "decode")}
# With --one-cluster, each deployment as the roles set on the adaptive deployment's cluster before
# its probes (None: set as the probes go, by the oracle's load); adaptive starts as on its own.
ONE_CLUSTER_LAYOUTS = {"chunked": ("colocated", "colocated"), "disaggregated": ("prefill", "decode"),
                       "oracle": None, "staged-oracle": None, "adaptive": ("prefill", "decode")}  # fmt: skip
# The controller's settings, as shipped (``RoleControlConfig``'s defaults); --role-control and
# --memory change them for a run.
ROLE_CONTROL = {name: getattr(RoleControlConfig, name) for name in ("interval", "window", "min_requests", "patience",
                "min_dwell", "arrival_window", "mix_arrivals", "forecast")}  # fmt: skip
WORKLOADS = ("long", "short", "alternating")
_probe_count = itertools.count()  # each probe's prompts are its own


# The load: one process per probe -----------------------------------------------------------------


def parse_classes(text: str) -> dict[str, dict[str, tuple[int, int]]]:
    """``long:512-768:64,short:16-64:128`` -> {class: {"prompt": (low, high), "output": (low, high)}}."""

    def span(item: str) -> tuple[int, int]:
        low, _, high = item.partition("-")
        return int(low), int(high or low)

    classes = {}
    for item in text.split(","):
        name, prompt, output = item.split(":")
        classes[name] = {"prompt": span(prompt), "output": span(output)}
    if set(classes) != {"long", "short"}:
        raise ValueError(f"the classes are long and short, not {', '.join(classes)}")
    return classes


def _request(rng: random.Random, tokens: random.Random, lengths: dict) -> tuple[list[int], int]:
    """A prompt and an output length drawn by ``rng`` from a class's lengths, the prompt's tokens by
    ``tokens``: probes that share their arrivals and lengths then share no prompt, and none is
    served from the prefix cache that an earlier probe filled."""
    prompt_len, max_tokens = rng.randint(*lengths["prompt"]), rng.randint(*lengths["output"])
    return [tokens.randrange(3, 1000) for _ in range(prompt_len)], max_tokens


async def _one(client, cls: str, request: tuple[list[int], int], slo: tuple[float, float], sent: float = 0.0) -> dict:
    prompt, max_tokens = request
    start = time.perf_counter()
    times = []
    error = None
    try:
        async for chunk in client.generate(
            prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
            slo_ttft=slo[0], slo_tpot=slo[1],
        ):  # fmt: skip
            times += [time.perf_counter()] * len(chunk.token_ids)
    except Exception as e:
        error = str(e)
    if error or not times:
        return {"class": cls, "sent": sent, "ok": False, "error": error}
    ttft = times[0] - start
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"class": cls, "sent": sent, "ttft": ttft, "tpot": tpot, "ok": ttft <= slo[0] and tpot <= slo[1]}


async def _drive(args: argparse.Namespace) -> None:
    from distserve.entrypoints.client import AsyncClient
    from distserve.v1 import distserve_pb2 as pb

    slos = json.loads(args.slos)
    classes = parse_classes(args.classes)
    rng, tokens = random.Random(args.seed), random.Random(args.salt)
    async with AsyncClient(args.server) as client:
        arrivals, t = [], rng.expovariate(args.rate)
        while t < args.seconds:
            arrivals.append(t)
            t += rng.expovariate(args.rate)
        if args.sequential:  # one at a time, after one to warm the connection up
            records = []
            for _ in range(args.sequential + 1):
                request = _request(rng, tokens, classes[args.workload])
                records.append(await _one(client, args.workload, request, tuple(slos[args.workload])))
            Path(args.out).write_text(json.dumps(records[1:]))
            return
        layouts, roles_now, changing, staged = {}, {}, None, args.oracle == "staged-oracle"
        if args.oracle:  # the roles for each class, set the moment its phase begins
            info = (await client.cluster_info()).instances
            roles_now = {i.name: pb.Role.Name(i.role).removeprefix("ROLE_").lower() for i in info}
            layouts = {cls: dict(zip(roles_now, roles)) for cls, roles in ORACLE_LAYOUTS.items()}
        tasks, t0, current = [], time.perf_counter(), None
        for t in arrivals:
            cls = args.workload if args.workload != "alternating" else ("long", "short")[int(t // args.phase) % 2]
            if layouts and cls != current:
                current = cls
                in_flight = [task for task in tasks if not task.done()] if staged else []
                changing = asyncio.create_task(_oracle_change(client, layouts[cls], roles_now, in_flight, changing))
                tasks.append(changing)
                roles_now = layouts[cls]
            request = _request(rng, tokens, classes[cls])
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(client, cls, request, tuple(slos[cls]), t)))
        records = [r for r in await asyncio.gather(*tasks) if isinstance(r, dict)]
    Path(args.out).write_text(json.dumps(records))


async def _oracle_change(client, roles: dict, roles_now: dict, in_flight: list, previous) -> None:
    """Set ``roles`` after the ``previous`` change; an instance leaving a decode role keeps it until
    the requests ``in_flight`` have finished (none given: at once)."""
    if previous is not None:
        await previous
    keep = {n for n, role in roles.items() if in_flight and roles_now.get(n) == "decode" and role != "decode"}
    await client.set_roles({n: role for n, role in roles.items() if n not in keep})
    if keep:
        await asyncio.gather(*in_flight, return_exceptions=True)
        await client.set_roles({n: roles[n] for n in keep})


def probe(
    address: str,
    workload: str,
    rate: float,
    seconds: float,
    phase: float,
    slos: dict,
    classes: str,
    out: Path,
    oracle: str,
    seed: int = 0,
    instances: list | tuple = (),
) -> dict:
    """One run of the load at ``rate`` (arrivals and lengths drawn from ``seed``, prompts new to the
    cluster): its attainment, per class too, each request's record (class, when it was sent, TTFT,
    TPOT, met) and, from the ``instances`` (the orchestrator's), every step they ran meanwhile."""
    command = [
        sys.executable, __file__, "drive", "--server", address, "--workload", workload, "--rate", str(rate),
        "--seconds", str(seconds), "--phase", str(phase), "--slos", json.dumps(slos), "--out", str(out),
        "--classes", classes, "--seed", str(seed), "--salt", str(next(_probe_count)),
        *(["--oracle", oracle] if oracle else []),
    ]  # fmt: skip
    steps_before = step_counts(instances)
    started = time.time()
    subprocess.run(command, check=True)
    ended = time.time()
    records = json.loads(out.read_text())
    result = {"rate": rate, "started": started, "ended": ended, "requests": len(records),
              "attainment": _share(records), "steps": steps_since(instances, steps_before),
              "records": records}  # fmt: skip
    for cls in CLASS_NAMES:
        mine = [r for r in records if r["class"] == cls]
        if mine:
            result[cls] = {"attainment": _share(mine), "ttft_p50": _p50(mine, "ttft"), "tpot_p50": _p50(mine, "tpot")}
    return result


def step_counts(instances: list | tuple) -> dict[str, int]:
    """Each instance's steps so far, by name."""
    import ray

    counts = ray.get([s.handle.recent_steps.remote(1 << 62) for s in instances])  # past any step: the count alone
    return {s.name: count for s, (count, _) in zip(instances, counts)}


def steps_since(instances: list | tuple, counts: dict[str, int]) -> dict[str, list[tuple]]:
    """Each instance's steps since ``counts``, by name: (whether it ran prompts, sequences, tokens,
    seconds) a step."""
    import ray

    recent = ray.get([s.handle.recent_steps.remote(counts.get(s.name, 0)) for s in instances])
    return {s.name: [(r.is_prefill, r.batch_size, r.num_tokens, round(r.total, 6)) for r in records]
            for s, (_, records) in zip(instances, recent)}  # fmt: skip


def relative_step_times(probes: list[dict]) -> list[float | None]:
    """Each probe's step time against the run's: the median, over its steps, of a step's seconds
    over the median seconds of the run's steps alike (the same kind, sequences and tokens to 32),
    those of every deployment. The layouts run steps of other sizes, so their step times cannot be
    compared whole; step for like step, 1.2 says this probe's steps ran a fifth slower than the
    run's did, whatever slowed them (the machine, or the instances' processes)."""
    cells: dict[tuple, list[float]] = {}

    def cell(step: list) -> tuple:
        return step[0], step[1], step[2] // 32

    for p in probes:
        for steps in p.get("steps", {}).values():
            for step in steps:
                cells.setdefault(cell(step), []).append(step[3])
    typical = {key: statistics.median(times) for key, times in cells.items() if len(times) >= 5}
    times = []
    for p in probes:
        ratios = [step[3] / typical[cell(step)] for steps in p.get("steps", {}).values() for step in steps
                  if cell(step) in typical]  # fmt: skip
        times.append(statistics.median(ratios) if ratios else None)
    return times


def _share(records: list[dict]) -> float:
    return sum(r["ok"] for r in records) / len(records) if records else 0.0


def _p50(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def goodput(run_probe, low: float, high: float, steps: int, target: float) -> tuple[float, list[dict]]:
    """Bisection on the rate: the highest probed rate meeting ``target``, and every probe."""
    probes, best = [], 0.0
    for _ in range(steps):
        rate = (low + high) / 2
        result = run_probe(rate)
        probes.append(result)
        if result["attainment"] >= target:
            best, low = max(best, rate), rate
        else:
            high = rate
    return best, probes


def grid_goodput(run_probe, rates: list[float], repeats: int, target: float, seed: int = 0) -> tuple[float, list[dict]]:
    """Every rate of the grid ``repeats`` times (rates in turn, each repeat with other arrivals):
    the highest rate at which, and below which everywhere, the requests of all its probes together
    meet ``target``; and every probe. Unlike a bisection, one unlucky probe moves the result by one
    grid step at most, not into the other half of the range."""
    probes = [run_probe(rate, seed=seed + repeat) for repeat in range(repeats) for rate in rates]
    return grid_best(probes, target), probes


def grid_best(probes: list[dict], target: float) -> float:
    """The highest rate at which, and below which everywhere, the pooled probes meet ``target``."""
    return highest_met(pooled(probes), target)


def highest_met(attainment: list[tuple[float, float]], target: float) -> float:
    """The highest rate at which, and below which everywhere, (rate, attainment) meets ``target``."""
    best = 0.0
    for rate, met in attainment:
        if met < target:
            break
        best = rate
    return best


def pooled(probes: list[dict]) -> list[tuple[float, float]]:
    """(rate, attainment of the requests of all its probes together), by rate."""
    by_rate: dict[float, list[dict]] = {}
    for p in probes:
        by_rate.setdefault(p["rate"], []).append(p)
    return [
        (rate, sum(p["attainment"] * p["requests"] for p in mine) / max(1, sum(p["requests"] for p in mine)))
        for rate, mine in sorted(by_rate.items())
    ]


# The experiment ----------------------------------------------------------------------------------


def calibrate(address: str, classes: str, out: Path) -> dict[str, tuple[float, float]]:
    """Each class's single-request latencies (median TTFT and TPOT of 10 requests, one at a time), on
    prompts of its own: classes of one length would otherwise share them, and the second be served
    from the prefix cache."""
    loose = {cls: (1e9, 1e9) for cls in CLASS_NAMES}
    unloaded = {}
    for cls in CLASS_NAMES:
        command = [sys.executable, __file__, "drive", "--server", address, "--workload", cls, "--classes", classes,
                   "--sequential", "10", "--slos", json.dumps(loose), "--out", str(out),
                   "--salt", str(next(_probe_count))]  # fmt: skip
        subprocess.run(command, check=True)
        records = json.loads(out.read_text())
        unloaded[cls] = (_p50(records, "ttft"), _p50(records, "tpot"))
    return unloaded


def role_control(text: str) -> dict[str, float]:
    """``window=12,forecast=off`` -> the controller's settings it names (of ROLE_CONTROL's keys)."""
    settings = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ROLE_CONTROL:
            raise ValueError(f"{key!r} is not one of {', '.join(ROLE_CONTROL)}")
        kind = type(ROLE_CONTROL[key])
        settings[key] = value.lower() in ("1", "true", "on") if kind is bool else kind(value)
    return settings


def class_scales(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Each class's (TTFT, TPOT) scales: ``--ttft-scale``/``--tpot-scale``, or ``--class-scales``."""
    scales = {cls: (args.ttft_scale, args.tpot_scale) for cls in CLASS_NAMES}
    for item in filter(None, args.class_scales.split(",")):
        cls, ttft, tpot = item.split(":")
        scales[cls] = (float(ttft), float(tpot))
    return scales


def scaled(unloaded: dict, scales: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    return {cls: (scales[cls][0] * ttft, scales[cls][1] * tpot) for cls, (ttft, tpot) in unloaded.items()}


def rejudged(summary: dict, slos: dict) -> dict:
    """The summary with every request judged by ``slos`` instead. A static deployment's latencies do
    not depend on its SLOs, so this is what it would have met under them; an adaptive deployment's
    controller acted on the SLOs it ran under, and it is left out."""
    results: dict = {}
    for workload, by_deployment in summary["results"].items():
        for name, result in by_deployment.items():
            if name == "adaptive":
                continue
            probes = []
            for p in result["probes"]:
                records = [{**r, "ok": "ttft" in r and r["ttft"] <= slos[r["class"]][0]
                            and r["tpot"] <= slos[r["class"]][1]} for r in p["records"]]  # fmt: skip
                probes.append({**p, "records": records, "attainment": _share(records)})
            results.setdefault(workload, {})[name] = {**result, "probes": probes,
                                                      "goodput": grid_best(probes, summary["target"])}  # fmt: skip
    return {**summary, "slos": slos, "results": results}


def alternating_from_classes(results: dict, target: float) -> dict[str, tuple[float, list]]:
    """Each static deployment's long and short probes at a rate, their attainments averaged, as an
    alternating workload of equal phases would give were a phase's backlog not carried into the
    next; and each class in its better deployment, the most roles could reach. Name: (goodput,
    [(rate, attainment)])."""
    long, short = results.get("long", {}), results.get("short", {})
    curves = {name: (dict(pooled(long[name]["probes"])), dict(pooled(short[name]["probes"])))
              for name in long if name in short and name != "adaptive"}  # fmt: skip
    if not curves:
        return {}
    rates = sorted(set.intersection(*(set(lc) & set(sc) for lc, sc in curves.values())))
    mixes = {name: [(r, (lc[r] + sc[r]) / 2) for r in rates] for name, (lc, sc) in curves.items()}
    mixes["each class in its better"] = [
        (r, (max(lc[r] for lc, _ in curves.values()) + max(sc[r] for _, sc in curves.values())) / 2) for r in rates
    ]
    return {name: (highest_met(mix, target), mix) for name, mix in mixes.items()}


def at_typical_step_time(
    by_deployment: dict, step_time: dict[int, float | None]
) -> dict[float, tuple[float, dict[str, float]]]:
    """At each rate where every deployment has two probes or more with a relative step time: each
    one's attainment at 1.0 (the run's typical step times), from one least-squares line per
    deployment of attainment against step time, all of one slope (fitted within deployments). The
    probes of one deployment at a rate differ in little but when they ran; the slope says how much
    of that the machine's speed explains, and the deployments are then compared as if they had all
    run at one speed. Rate: (the slope, attainment a unit of step time; each deployment's)."""
    by_rate: dict[float, dict[str, list[tuple[float, float]]]] = {}
    for name, r in by_deployment.items():
        for p in r["probes"]:
            if step_time.get(id(p)) is not None:
                by_rate.setdefault(p["rate"], {}).setdefault(name, []).append((step_time[id(p)], p["attainment"]))
    fitted = {}
    for rate, points in sorted(by_rate.items()):
        if len(points) < len(by_deployment) or min(map(len, points.values())) < 2:
            continue
        means = {name: tuple(map(statistics.fmean, zip(*xy))) for name, xy in points.items()}
        sxy = sum((x - means[n][0]) * (y - means[n][1]) for n, xy in points.items() for x, y in xy)
        sxx = sum((x - means[n][0]) ** 2 for n, xy in points.items() for x, _ in xy)
        slope = sxy / sxx if sxx > 0 else 0.0
        fitted[rate] = slope, {name: my + slope * (1.0 - mx) for name, (mx, my) in means.items()}
    return fitted


def _change_row(c) -> tuple:
    """A role change as summary.json keeps it."""
    return (c.instance, c.old_role, c.new_role, c.started, c.seconds, c.reason)


def one_cluster(args: argparse.Namespace, running, slos: dict, scratch: Path) -> dict:
    """Chunked, disaggregated, oracle and adaptive as one cluster's roles and role control, set by
    hand before each probe: at each rate every deployment in turn, in another order at each rate
    and repeat, so that the deployments compared at a rate are measured minutes apart at most and a
    drift of the machine's speed falls on each of them; none is measured on processes of its own.
    Adaptive starts each repeat as 1 prefill + 1 decode after a warm-up, as on a cluster of its own,
    and each later turn from the roles it left (its memory kept): a cluster that has been running."""
    from distserve.entrypoints.client import Client

    names = args.deployments.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    results: dict = {}
    measured: dict[str, dict[str, list[dict]]] = {}  # workload: deployment: probes, as they end
    with Client(running.grpc_address) as client:
        instances = [i.name for i in client.cluster_info().instances]
        for workload in args.workloads.split(","):
            seconds = 2 * args.cycles * args.phase_seconds if workload == "alternating" else args.probe_seconds
            warmup = 2 * args.phase_seconds if workload == "alternating" else args.warmup_seconds

            def run_probe(
                rate: float, duration: float = seconds, oracle: str = "", seed: int = 0, workload: str = workload
            ) -> dict:
                return probe(running.grpc_address, workload, rate, duration, args.phase_seconds, slos, args.classes,
                             scratch, oracle, seed, running.cluster.orchestrator.instances)  # fmt: skip

            run_probe(args.rate_high / 4, warmup)  # the cluster's first requests of this workload
            probes = measured.setdefault(workload, {name: [] for name in names})
            for repeat in range(args.repeats):
                adaptive_roles = None  # adaptive's roles when its last turn ended
                for turn, rate in enumerate(rates):
                    shift = (repeat * len(rates) + turn) % len(names)
                    for name in names[shift:] + names[:shift]:
                        if name == "adaptive":
                            roles = adaptive_roles or dict(zip(instances, ONE_CLUSTER_LAYOUTS[name]))
                            client.set_roles(roles, role_control="adaptive")
                            if adaptive_roles is None:  # it sees each class (or settles) first
                                run_probe(args.rate_high / 4, warmup)
                        else:
                            layout = ONE_CLUSTER_LAYOUTS[name]
                            client.set_roles(dict(zip(instances, layout)) if layout else {}, role_control="fixed")
                        seed = args.seed + (0 if args.same_arrivals else repeat)
                        result = run_probe(rate, oracle=name if name in ORACLES else "", seed=seed)
                        if name == "adaptive":
                            client.set_roles({}, role_control="fixed")  # stays as it is until set again
                            adaptive_roles = {i.name: i.role for i in client.cluster_info().instances}
                        result["role_changes"] = [
                            _change_row(c)
                            for c in running.cluster.role_changes
                            if result["started"] <= c.started <= result["ended"]
                        ]
                        probes[name].append(result)
                        # A run of an hour or more keeps what it measured if it is stopped part way.
                        (args.out / "probes.json").write_text(json.dumps(measured, default=str))
            for name in names:
                best = grid_best(probes[name], args.target)
                changes = [c for p in probes[name] for c in p["role_changes"]]
                results.setdefault(workload, {})[name] = {"goodput": best, "probes": probes[name],
                                                          "role_changes": changes}  # fmt: skip
                print(f"{workload:<12} {name:<14} goodput {best:.3g} req/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help=f"a model distserve loads, or {LLAMA_58M!r}: the offline benchmark's 58M-parameter Llama, dummy weights",
    )
    parser.add_argument(
        "--classes",
        default=DEFAULT_CLASSES,
        help="each class's prompt and output lengths, class:prompt-range:output-range",
    )
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per instance")
    parser.add_argument(
        "--policy",
        default="fcfs",
        help="every instance's prefill queue order (deadline: earliest TTFT deadline first, by each class's SLO)",
    )
    parser.add_argument("--ttft-scale", type=float, default=4.0)
    parser.add_argument("--tpot-scale", type=float, default=3.0)
    parser.add_argument(
        "--class-scales", default="", help="per-class SLO scales instead, e.g. long:2:10,short:4:3 (class:TTFT:TPOT)"
    )
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--phase-seconds", type=float, default=10.0, help="the alternating workload's phase")
    parser.add_argument("--cycles", type=int, default=2, help="cycles (long, then short) per alternating probe")
    parser.add_argument("--probe-seconds", type=float, default=8.0, help="a single-class probe's length")
    parser.add_argument("--rate-high", type=float, default=48.0)
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=10.0,
        help="load at a quarter of --rate-high before a single-class workload is measured "
        "(an alternating one: a cycle)",
    )
    parser.add_argument("--steps", type=int, default=5, help="bisection steps per goodput")
    parser.add_argument("--rates", default="", help="probe this grid of rates (comma-separated) instead of bisecting")
    parser.add_argument("--repeats", type=int, default=2, help="with --rates: probes per rate, other arrivals each")
    parser.add_argument(
        "--same-arrivals",
        action="store_true",
        help="with --one-cluster: every repeat the same arrivals, so that repeats differ only in when they ran",
    )
    parser.add_argument("--slos-from", type=Path, help="take the SLOs from an earlier run's summary.json")
    parser.add_argument(
        "--seed", type=int, default=0, help="arrivals of repeat r drawn from seed + r (another seed: fresh arrivals)"
    )
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument(
        "--tpot-aware-chunking",
        action="store_true",
        help="deployments with chunked prefill cut a step's chunks to fit the TPOT SLO of the requests decoding",
    )
    parser.add_argument(
        "--finish-decoding-as-prefill",
        action="store_true",
        help="adaptive and oracle: an instance becoming prefill decodes what it held to the end",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--one-cluster",
        action="store_true",
        help="with --rates: chunked, disaggregated, oracle and adaptive on one cluster, in turn",
    )
    parser.add_argument(
        "--role-control",
        default="",
        help="the adaptive controller's settings other than these defaults, e.g. window=12,arrival_window=6 "
        f"(defaults: {','.join(f'{k}={v}' for k, v in ROLE_CONTROL.items())})",
    )
    parser.add_argument(
        "--memory",
        type=float,
        default=RoleControlConfig.memory,
        help="seconds the adaptive controller trusts a layout's measured attainment for",
    )
    parser.add_argument("--out", type=Path, default=Path("results/adaptive-roles"))
    parser.add_argument("--report", action="store_true", help="only print and plot the summary.json in --out")
    parser.add_argument(
        "--rejudge",
        action="store_true",
        help="with --report: judge the static deployments' requests by the SLO scales given "
        "(of the run's single-request latencies) instead of the run's",
    )
    args = parser.parse_args()
    for flag, parse in (("classes", parse_classes), ("role_control", role_control)):
        try:
            parse(getattr(args, flag))
        except ValueError as e:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        summary = {"model": args.model, "target": args.target, **json.loads((args.out / "summary.json").read_text())}
        if args.rejudge:
            if not summary.get("unloaded"):
                parser.error(f"{args.out / 'summary.json'} has no single-request latencies to scale")
            summary = rejudged(summary, scaled(summary["unloaded"], class_scales(args)))
            (args.out / "summary-rejudged.json").write_text(json.dumps(summary, indent=2))  # for --slos-from
        report(summary, args.out, "-rejudged" if args.rejudge else "")
        return

    import ray

    from distserve.cluster.api import make_cluster_config
    from distserve.entrypoints.server import BackgroundServer
    from distserve.entrypoints.server_config import ADMIN_KEY_ENV, ServerConfig
    from distserve.model_executor.tiny_models import BENCH_LLAMA_SHAPE, write_llama_shape

    model = {"model": args.model}
    if args.model == LLAMA_58M:
        model = {"model": str(write_llama_shape(args.out / "model", **BENCH_LLAMA_SHAPE)), "load_format": "dummy"}

    def server(pools: dict, **control) -> BackgroundServer:
        if args.tpot_aware_chunking and pools.get("enable_chunked_prefill"):
            pools = {**pools, "tpot_aware_chunking": True}
        config = make_cluster_config(**model, num_kv_blocks=1024, cpu_threads=args.cpu_threads,
                                     policy=args.policy, **pools, **control)  # fmt: skip
        return BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0))

    ray.init(include_dashboard=False, log_to_driver=False)
    # Role changes need the server's admin key: one for this run, which the servers, the clients
    # and the probe processes all read from the environment.
    os.environ.setdefault(ADMIN_KEY_ENV, secrets.token_urlsafe(16))
    scratch = args.out / "probe.json"
    results: dict = {}
    try:
        if args.slos_from:
            earlier = json.loads(args.slos_from.read_text())
            if earlier.get("classes", DEFAULT_CLASSES) != args.classes:
                raise SystemExit(f"{args.slos_from} has SLOs for --classes {earlier.get('classes', DEFAULT_CLASSES)}")
            slos = {cls: tuple(v) for cls, v in earlier["slos"].items()}
            unloaded = earlier.get("unloaded")
        else:
            with server(DEPLOYMENTS["colocated"]) as calibration:
                unloaded = calibrate(calibration.grpc_address, args.classes, scratch)
            slos = scaled(unloaded, class_scales(args))
        print("SLOs (TTFT, TPOT) ms: " + ", ".join(f"{c} {t * 1e3:.1f}/{p * 1e3:.2f}" for c, (t, p) in slos.items()))
        control = {"slo_ttft": slos["long"][0], "slo_tpot": slos["long"][1], "memory": args.memory, **ROLE_CONTROL,
                   **role_control(args.role_control)}  # fmt: skip
        if args.one_cluster:
            with server(DEPLOYMENTS["adaptive"], role_control={"mode": "fixed", **control}) as running:
                results = one_cluster(args, running, slos, scratch)
        for name in [] if args.one_cluster else args.deployments.split(","):
            pools = dict(DEPLOYMENTS[name])
            if args.finish_decoding_as_prefill and name in ROLE_CHANGING:
                pools["finish_decoding_as_prefill"] = True
            adaptive = {"role_control": {"mode": "adaptive", **control}} if name == "adaptive" else {}
            with server(pools, **adaptive) as running:
                for workload in args.workloads.split(","):
                    seconds = 2 * args.cycles * args.phase_seconds if workload == "alternating" else args.probe_seconds

                    def run_probe(
                        rate: float,
                        workload: str = workload,
                        seconds: float = seconds,
                        oracle: str = name if name in ORACLES else "",
                        seed: int = 0,
                    ) -> dict:
                        return probe(running.grpc_address, workload, rate, seconds, args.phase_seconds, slos,
                                     args.classes, scratch, oracle, seed,
                                     running.cluster.orchestrator.instances)  # fmt: skip

                    # Adaptive roles settle into a steady workload's layout, and see each class of an
                    # alternating one (a cycle), before it is measured.
                    warmup = 2 * args.phase_seconds if workload == "alternating" else args.warmup_seconds
                    run_probe(args.rate_high / 4, seconds=warmup)

                    if args.rates:
                        rates = [float(r) for r in args.rates.split(",")]
                        best, probes = grid_goodput(run_probe, rates, args.repeats, args.target, args.seed)
                    else:
                        best, probes = goodput(run_probe, 0.0, args.rate_high, args.steps, args.target)
                    changes = running.cluster.role_changes if name in ROLE_CHANGING else []
                    results.setdefault(workload, {})[name] = {
                        "goodput": best, "probes": probes,
                        "role_changes": [
                            _change_row(c) for c in changes
                        ],
                    }  # fmt: skip
                    print(f"{workload:<12} {name:<14} goodput {best:.3g} req/s", flush=True)
    finally:
        ray.shutdown()
    summary = {"model": args.model, "classes": args.classes, "policy": args.policy, "target": args.target, "slos": slos,
               "same_arrivals": args.same_arrivals, "seed": args.seed, "unloaded": unloaded,
               "role_control": {**ROLE_CONTROL, **role_control(args.role_control)},
               "results": results}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    report(summary, args.out)


def report(summary: dict, out: Path, tag: str = "") -> None:
    """The goodput table, and per workload a plot of each deployment's probes (attainment against rate,
    to ``{workload}-rate{tag}.png``)."""
    from placement.plots import plot_attainment_vs_rate

    results = summary["results"]
    print(f"\n{'workload':<12}" + "".join(f" {d:>13}" for d in results[next(iter(results))]))
    for workload, by_deployment in results.items():
        print(f"{workload:<12}" + "".join(f" {r['goodput']:>13.3g}" for r in by_deployment.values()))
        series = {name: pooled(r["probes"]) for name, r in by_deployment.items()}
        slos = ", ".join(f"{c} {t * 1e3:.0f}/{p * 1e3:.1f} ms" for c, (t, p) in summary["slos"].items())
        title = f"{summary['model']}, {workload} prompts, 2 instances\nSLOs (TTFT/TPOT): {slos}"
        print(f"  {plot_attainment_vs_rate(series, summary['target'], out / f'{workload}-rate{tag}.png', title)}")
    for workload, by_deployment in results.items():
        probes = [p for r in by_deployment.values() for p in r["probes"]]
        if not any(p.get("steps") for p in probes):
            continue
        step_time = dict(zip(map(id, probes), relative_step_times(probes)))
        print(f"{workload}, each probe as rate:attainment@step time against the run's, like step for like step:")
        for name, r in by_deployment.items():
            cells = " ".join(f"{p['rate']:g}:{p['attainment']:.1%}@{step_time[id(p)] or float('nan'):.2f}"
                             for p in r["probes"])  # fmt: skip
            print(f"  {name:<14} {cells}")
        if not summary.get("same_arrivals"):
            continue  # repeats on other arrivals differ by more than the machine's speed: no fit
        for rate, (slope, at_one) in at_typical_step_time(by_deployment, step_time).items():
            print(f"  at {rate:g} req/s, steps 10% slower: {slope * 10:+.1f} points of attainment; at the run's "
                  "typical step time: " + ", ".join(f"{name} {met:.1%}" for name, met in at_one.items()))  # fmt: skip
    mixes = alternating_from_classes(results, summary["target"])
    if mixes:
        print("alternating, from the single-class probes (long and short averaged at each rate):")
        for name, (best, mix) in mixes.items():
            cells = " ".join(f"{r:g}:{met:.1%}" for r, met in mix)
            print(f"  {name:<26} goodput {best:>5.3g}   {cells}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "drive":
        drive = argparse.ArgumentParser()
        drive.add_argument("drive")
        for flag in ("--server", "--workload", "--slos", "--out", "--classes"):
            drive.add_argument(flag, required=True)
        for flag, default in (("--rate", 1.0), ("--seconds", 10.0), ("--phase", 10.0)):
            drive.add_argument(flag, type=float, default=default)
        drive.add_argument("--seed", type=int, default=0)
        drive.add_argument("--salt", type=int, default=0, help="draws the prompts' tokens")
        drive.add_argument("--sequential", type=int, default=0, help="send this many requests one at a time")
        drive.add_argument("--oracle", choices=ORACLES, help="set ORACLE_LAYOUTS as each phase begins")
        options = drive.parse_args()
        asyncio.run(_drive(options))
    else:
        main()
