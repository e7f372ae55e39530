"""Placement search, deployments, plan files and the ``distserve place`` command line."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from distserve.core.model_presets import MODEL_PRESETS, model_shape
from placement.cli import build_problem, main
from placement.deployment import Deployment
from placement.fitted import FittedLatency
from placement.hardware import cluster_from_dict
from placement.latency import InstanceModels, Parallelism
from placement.plan_file import read_plan
from placement.planner import (
    attainment_curve,
    deployment_attainment,
    deployment_for_rate,
    fit_to_rate,
    simulate_deployment,
)
from placement.search import (
    Objective,
    PhaseGoodput,
    PhaseProblem,
    capacity,
    high_affinity,
    low_affinity,
    phase_attainment,
    phase_goodput,
    search,
)
from placement.workload import WORKLOAD_PRESETS, RequestSpec, arrival_times, fit_context, preset_workload

A100x8 = {"gpu": "A100-80GB", "num_nodes": 1, "gpus_per_node": 8}
OPT13B = model_shape(MODEL_PRESETS["opt-13b"])


def problem_with(models, requests, objective, min_requests=200, seed=0):
    return PhaseProblem(models, tuple(requests), tuple(arrival_times(len(requests), 1.0, seed=seed)), objective,
                        min_requests)  # fmt: skip


def constant_models(prefill_s, step_s, max_batch_tokens, max_batch_size, nodes=1):
    """Instances whose prefill batch takes ``prefill_s`` and decode step ``step_s``, whatever the batch."""
    fitted = FittedLatency((prefill_s, 0.0, 0.0), (step_s, 0.0, 0.0), {"tp": 1, "pp": 1})
    cluster = cluster_from_dict({**A100x8, "num_nodes": nodes})
    return InstanceModels(OPT13B, cluster, fitted={Parallelism(1, 1): fitted},
                          max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size)  # fmt: skip


def test_parallelism_parse_and_errors():
    assert Parallelism.parse("3,3") == Parallelism(3, 3)
    assert Parallelism.parse("4") == Parallelism(4, 1)
    assert str(Parallelism(2, 1)) == "2,1"
    for bad in ("a,b", "1,2,3"):
        with pytest.raises(ValueError, match="TP,PP"):
            Parallelism.parse(bad)
    with pytest.raises(ValueError):
        Parallelism(0, 1)


def test_workload_presets_have_their_shapes():
    means = {}
    for name in WORKLOAD_PRESETS:
        reqs = preset_workload(name, 20000, seed=1)
        means[name] = (np.mean([r.prompt_len for r in reqs]), np.mean([r.output_len for r in reqs]))
    assert means["code"][0] < means["chat"][0] < means["summarization"][0]
    assert means["summarization"][1] < means["chat"][1]
    assert means["chat"][0] == pytest.approx(750, rel=0.1)  # the cap at 4096 trims the tail
    clipped = preset_workload("summarization", 2000, seed=1, max_context=2048)
    assert max(r.prompt_len + r.output_len for r in clipped) <= 2048
    assert fit_context([RequestSpec(10, 5000)], 100) == [RequestSpec(1, 99)]
    with pytest.raises(ValueError, match="unknown workload"):
        preset_workload("poetry", 10)


def test_candidates_respect_heads_nodes_and_memory():
    models = InstanceModels(model_shape(MODEL_PRESETS["opt-175b"]), cluster_from_dict({**A100x8, "num_nodes": 4}))
    pars = models.candidates(min_kv_tokens=2048)
    assert Parallelism(3, 3) in pars and Parallelism(4, 3) in pars
    # 350 GB of weights do not fit on 4 A100-80GBs; 7 does not divide 96 heads; PP is at most the nodes.
    assert Parallelism(4, 1) not in pars and Parallelism(2, 2) not in pars
    assert all(p.tp != 7 and p.pp <= 4 and p.tp <= 8 for p in pars)
    for par in pars:
        assert models.kv_capacity_tokens(par) >= 2048


def test_capacity_is_exact_for_constant_latency():
    reqs = [RequestSpec(100, 11)] * 400
    models = constant_models(prefill_s=0.05, step_s=0.01, max_batch_tokens=100, max_batch_size=8)
    problem = problem_with(models, reqs, Objective(1.0, 1.0))
    # One prompt per batch: 1 / 50 ms. Eight sequences per step, ten steps each: 8 / 100 ms.
    assert capacity(problem, "prefill", Parallelism(1, 1)) == pytest.approx(20.0, rel=1e-6)
    assert capacity(problem, "decode", Parallelism(1, 1)) == pytest.approx(80.0, rel=1e-6)


def test_phase_goodput_meets_the_target_and_no_more():
    reqs = [RequestSpec(100, 11)] * 3000
    models = constant_models(prefill_s=0.05, step_s=0.01, max_batch_tokens=100, max_batch_size=8)
    objective = Objective(ttft=0.2, tpot=1.0, target=0.9)
    problem = problem_with(models, reqs, objective, min_requests=1000)
    par = Parallelism(1, 1)
    g = phase_goodput(problem, "prefill", par)
    assert 0 < g.goodput < capacity(problem, "prefill", par)
    assert phase_attainment(problem, "prefill", par, g.goodput) >= 0.9
    assert phase_attainment(problem, "prefill", par, g.goodput * 1.1) < 0.9
    # M/D/1 with D = 50 ms: the 90th-percentile wait stays under 150 ms only well below saturation.
    assert 0.4 * 20 < g.goodput < 0.95 * 20
    # A looser SLO admits more, a tighter one less.
    looser = problem_with(models, reqs, Objective(0.4, 1.0, 0.9), min_requests=1000)
    assert phase_goodput(looser, "prefill", par).goodput > g.goodput
    impossible = problem_with(models, reqs, Objective(0.04, 1.0, 0.9), min_requests=1000)
    assert phase_goodput(impossible, "prefill", par).goodput == 0.0


def test_decode_goodput_is_capped_at_capacity():
    # A loose TPOT SLO: a finite run passes above capacity, but a sustained load would not.
    reqs = [RequestSpec(100, 11)] * 3000
    models = constant_models(prefill_s=0.05, step_s=0.01, max_batch_tokens=100, max_batch_size=8)
    problem = problem_with(models, reqs, Objective(1.0, 1.0, 0.9), min_requests=500)
    g = phase_goodput(problem, "decode", Parallelism(1, 1))
    assert g.goodput == pytest.approx(80.0, rel=1e-6)


@pytest.fixture(scope="module")
def opt13b_problem():
    models = InstanceModels(OPT13B, cluster_from_dict({**A100x8, "num_nodes": 2, "gpus_per_node": 4}))
    reqs = preset_workload("chat", 4000, seed=0, max_context=2048)
    return problem_with(models, reqs, Objective(0.25, 0.1, 0.9), min_requests=200)


def test_pruned_search_finds_the_exhaustive_best(opt13b_problem):
    problem = opt13b_problem
    result = search(problem, ("high", "low"), processes=1)
    assert result.simulated + result.pruned == 2 * len(problem.models.candidates(2048))
    everything = [
        phase_goodput(problem, phase, par) for phase in ("prefill", "decode") for par in problem.models.candidates(2048)
    ]
    cluster = problem.models.cluster
    for found, exhaustive in ((result.high, high_affinity(everything, cluster)),
                              (result.low, low_affinity(everything, cluster))):  # fmt: skip
        assert found and found[0].per_gpu == pytest.approx(exhaustive[0].per_gpu)


def test_search_in_processes_matches_in_process(opt13b_problem):
    single = search(opt13b_problem, ("high",), processes=1)
    pooled = search(opt13b_problem, ("high",), processes=2)
    assert [(c.prefill, c.decode) for c in single.high[:3]] == [(c.prefill, c.decode) for c in pooled.high[:3]]


def test_pairs_follow_each_algorithm(opt13b_problem):
    result = search(opt13b_problem, ("high", "low"), processes=1)
    for c in result.low:
        p, d = c.prefill.parallelism, c.decode.parallelism
        assert p.pp == d.pp and p.tp + d.tp <= 4
        assert c.per_gpu == pytest.approx(min(c.prefill.goodput, c.decode.goodput) / (p.gpus + d.gpus))
    for c in result.high:
        p, d = c.prefill, c.decode
        assert c.per_gpu == pytest.approx(1 / (p.parallelism.gpus / p.goodput + d.parallelism.gpus / d.goodput))
    assert [c.per_gpu for c in result.high] == sorted((c.per_gpu for c in result.high), reverse=True)


def test_node_layout():
    one, two, four = Parallelism(1), Parallelism(2), Parallelism(4)
    assert Deployment("high", four, 1, two, 2).node_layout(1, 8) == [
        ["prefill-0 stage 0: 4 GPUs", "decode-0 stage 0: 2 GPUs", "decode-1 stage 0: 2 GPUs"]
    ]
    assert Deployment("high", four, 2, one, 1).node_layout(1, 8) is None
    # DistServe's OPT-175B unit: stage i of a 3,3 prefill and a 4,3 decode instance on node i.
    layout = Deployment("low", Parallelism(3, 3), 1, Parallelism(4, 3), 1).node_layout(4, 8)
    assert layout[:3] == [[f"prefill-0 stage {i}: 3 GPUs", f"decode-0 stage {i}: 4 GPUs"] for i in range(3)]
    assert layout[3] == []
    assert Deployment("low", Parallelism(3, 3), 2, Parallelism(4, 3), 2).node_layout(4, 8) is None
    with pytest.raises(ValueError, match="equal PP"):
        Deployment("low", Parallelism(3, 3), 1, Parallelism(4, 2), 1)


def test_deployment_for_rate_and_growth():
    from placement.search import Candidate

    par = Parallelism(1, 1)
    candidate = Candidate("high", PhaseGoodput("prefill", par, 10.0), PhaseGoodput("decode", par, 4.0))
    d = deployment_for_rate(candidate, 9.0)
    assert (d.prefill_instances, d.decode_instances) == (1, 3)

    # Prefill: 5 ms a prompt, 200 req/s. Decode: 8 sequences a 10 ms step, 10 steps each, 80 req/s.
    # At 100 req/s one decode instance falls behind; growth adds decode instances, not prefill ones.
    reqs = [RequestSpec(100, 11)] * 5000
    models = constant_models(prefill_s=0.005, step_s=0.01, max_batch_tokens=100, max_batch_size=8, nodes=2)
    problem = problem_with(models, reqs, Objective(0.1, 0.02, 0.9), min_requests=2000)
    start = Deployment("high", par, 1, par, 1)
    assert simulate_deployment(problem, start, 100.0).tpot_attainment < 0.9
    grown, prediction = fit_to_rate(problem, start, 100.0, lambda dep: dep.gpus <= 16)
    assert prediction.attainment >= 0.9
    assert grown.prefill_instances == 1 and grown.decode_instances == 2
    # No room to grow: the deployment is returned as it is, with its (failing) prediction.
    stuck, prediction = fit_to_rate(problem, start, 100.0, lambda dep: dep.gpus <= 2)
    assert stuck == start and prediction.attainment < 0.9


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


# Disaggregated planning alone: the comparison with colocation has tests of its own.
SEARCH = ["--no-colocated", "--model", "opt-13b", "--nodes", "1", "--gpus-per-node", "4", "--slo-ttft", "0.25",
          "--slo-tpot", "0.1", "--num-requests", "200", "--processes", "1"]  # fmt: skip


def test_cli_writes_a_plan_that_launch_reads(tmp_path, capsys, monkeypatch):
    import placement.plots

    drawn = []
    plot = placement.plots.plot_attainment_vs_rate
    monkeypatch.setattr(placement.plots, "plot_attainment_vs_rate",
                        lambda *args, **kwargs: drawn.append((args, kwargs)) or plot(*args, **kwargs))  # fmt: skip
    plan, png = tmp_path / "plan.yaml", tmp_path / "plan.png"
    code, out, err = run_cli([*SEARCH, "--rate", "5", "--out", str(plan), "--plot", str(png)], capsys)
    assert code == 0, err
    assert "high node-affinity" in out and "low node-affinity" in out and "plan:" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    deployment, notes, document = read_plan(plan)
    (_, _, _, title), marks = drawn[0][0], drawn[0][1]["marks"]
    assert title == f"opt-13b: predicted SLO attainment\n{deployment.describe()}\nSLOs: TTFT 250 ms, TPOT 100 ms"
    assert marks == {"planned rate 5 req/s": 5}
    assert notes["rate"] == 5 and notes["predicted"]["attainment_at_rate"] >= 0.9
    assert notes["predicted"]["gpus"] == deployment.gpus <= 4
    assert document["model"] == {"model": "opt-13b", "load_format": "dummy"}

    from distserve.entrypoints.launch import load_launch_config

    cluster, _ = load_launch_config(plan=str(plan))
    engines = cluster.instance_configs()
    prefill = [e for name, e in engines if "-prefill-" in name]
    decode = [e for name, e in engines if "-decode-" in name]
    assert len(prefill) == deployment.prefill_instances and len(decode) == deployment.decode_instances
    assert prefill[0].parallel.tensor_parallel_size == deployment.prefill.tp
    assert decode[0].parallel.pipeline_parallel_size == deployment.decode.pp
    assert prefill[0].model.load_format == "dummy"

    # The same problem rebuilt from the plan predicts the same attainment at the planned rate.
    code, out, err = run_cli(["simulate", "--plan", str(plan), "--rates", "5,50", "--json"], capsys)
    assert code == 0, err
    points = yaml.safe_load(out.strip().splitlines()[-1])
    assert points[0]["attainment"] == pytest.approx(notes["predicted"]["attainment_at_rate"], abs=1e-4)
    assert points[1]["attainment"] < points[0]["attainment"]
    assert build_problem(notes).objective == Objective(0.25, 0.1, 0.9)

    # The plotted curve spans the knee: from meeting the target down to under half of it.
    problem = build_problem(notes)
    curve = attainment_curve(deployment_attainment(problem, deployment), 0.9, notes["predicted"]["goodput"], [5])
    assert curve[0][1] >= 0.9 > 0.45 > curve[-1][1] and 5 in [rate for rate, _ in curve]


def test_cli_without_rate_fills_the_cluster(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    code, out, err = run_cli([*SEARCH, "--affinity", "high", "--out", str(plan)], capsys)
    assert code == 0, err
    deployment, notes, _ = read_plan(plan)
    assert deployment.affinity == "high" and notes["predicted"]["attainment_at_rate"] is None
    # Nothing more fits: one more instance of either phase would exceed the node.
    assert deployment.gpus + min(deployment.prefill.gpus, deployment.decode.gpus) > 4


def test_cli_takes_gpu_and_model_names_in_any_case(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    args = ["--model", "OPT-13B", "--gpu", "a100-80gb", *SEARCH[3:], "--affinity", "high", "--out", str(plan)]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "A100-80GB" in out and "a100-80gb" not in out
    _, notes, document = read_plan(plan)
    assert notes["hardware"]["gpu"]["name"] == "A100-80GB"
    assert document["model"]["load_format"] == "dummy"  # still known as a preset
    with pytest.raises(SystemExit):
        main([*SEARCH, "--gpu", "a100"])
    assert "invalid choice: 'a100' (choose from 'A100-40GB', 'A100-80GB'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope", "--slo-ttft", "1", "--slo-tpot", "1"], "unknown model 'nope'"),
        ([*SEARCH, "--target", "1.5"], "attainment target must be in (0, 1]"),
        ([*SEARCH, "--prompt-len", "128"], "give both --prompt-len and --output-len"),
        ([*SEARCH, "--prompt-len", "zipf:3", "--output-len", "8"], "kind must be one of"),
        ([*SEARCH, "--trace", "/nonexistent.jsonl"], "No such file"),
        (
            ["--model", "opt-175b", "--gpu", "A100-40GB", "--gpus-per-node", "2", "--slo-ttft", "1", "--slo-tpot", "1"],
            "no TP,PP of this model fits",
        ),
        (["simulate", "--plan", "/nonexistent.yaml"], "No such file"),
    ],
)
def test_cli_bad_input_exits_2_with_a_sentence(args, message, capsys):
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert message in err


def test_cli_rejects_a_file_that_is_not_a_plan(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text("cluster:\n  prefill: {instances: 1}\n  decode: {instances: 1}\n")
    code, _, err = run_cli(["simulate", "--plan", str(path)], capsys)
    assert code == 2 and "not a plan file" in err


def test_cli_exits_1_when_no_deployment_meets_the_slos(capsys):
    # Prefill of a chat prompt on OPT-13B takes tens of milliseconds: a 1 ms TTFT is never met.
    code, out, err = run_cli([*SEARCH[:-4], "--slo-ttft", "0.001", "--num-requests", "200", "--processes", "1"],
                             capsys)  # fmt: skip
    assert code == 1
    achieved = re.search(r"the TTFT SLO is 1 ms, and even unloaded 90% of requests take up to ([\d.]+) ms", err)
    assert err.startswith("no configuration meets the SLOs on this cluster: ") and achieved, err
    assert float(achieved.group(1)) > 10


def test_cli_says_what_the_cluster_tops_out_at_when_the_rate_is_too_high(capsys):
    code, out, err = run_cli([*SEARCH, "--affinity", "high"], capsys)
    assert code == 0, err
    most = float(re.search(r"goodput ([\d.]+) req/s", out).group(1))
    code, _, err = run_cli([*SEARCH, "--affinity", "high", "--rate", "1000"], capsys)
    assert code == 1
    assert f"at 1000 req/s: the most it serves within them is {most:.3g} req/s, with 1 prefill" in err


def test_cli_warns_when_a_profile_is_of_another_device_or_model(tmp_path, capsys):
    def profile(device, model):
        path = tmp_path / f"{Path(model).name}.json"
        FittedLatency((0.01, 1e-5, 0.0), (0.005, 1e-4, 1e-7), {"device": device, "model": model}).save(path)
        return str(path)

    base = ["--slo-ttft", "1", "--slo-tpot", "0.1", "--num-requests", "200", "--processes", "1", "--gpus-per-node", "2"]
    cpu_tiny = profile("cpu x86_64 (2 threads)", "tiny-llama")
    code, _, err = run_cli(["--model", "llama-3-8b", "--profile", cpu_tiny, *base], capsys)
    assert code == 0
    assert (f"distserve place: warning: {cpu_tiny} was measured on cpu x86_64 (2 threads), not A100-80GB and with "
            "tiny-llama, not llama-3-8b: its latencies will not be this cluster's") in err  # fmt: skip
    same = profile("NVIDIA A100-SXM4-80GB", "/models/Llama-3-8B")
    code, _, err = run_cli(["--model", "llama-3-8b", "--profile", same, *base], capsys)
    assert code == 0 and "warning" not in err


def test_cli_batch_flags_have_the_engines_names_and_keep_the_old_ones(tmp_path, capsys):
    documents = []
    for flags in (["--max-num-batched-tokens", "2048", "--max-num-seqs", "64"],
                  ["--max-batch-tokens", "2048", "--max-batch-size", "64"]):  # fmt: skip
        plan = tmp_path / "plan.yaml"
        code, _, err = run_cli([*SEARCH, "--affinity", "high", *flags, "--out", str(plan)], capsys)
        assert code == 0, err
        documents.append(read_plan(plan)[2]["cluster"])
    assert documents[0] == documents[1]
    assert documents[0]["prefill"]["max_num_batched_tokens"] == 2048 and documents[0]["decode"]["max_num_seqs"] == 64


def test_every_flag_of_every_place_command_has_help(capsys):
    from placement.cli import compare_parser, search_parser, simulate_parser

    for parser in (search_parser(), simulate_parser(), compare_parser()):
        bare = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
        assert not bare, f"{parser.prog}: {bare}"
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    assert "distserve place simulate --plan FILE" in usage and "distserve place compare --trace RUN" in usage


def test_cli_plans_for_a_built_in_tiny_model_with_its_real_weights(tmp_path, capsys):
    # Without the colocated comparison: test_placement_colocation plans and launches a colocated winner.
    plan = tmp_path / "plan.yaml"
    args = ["--model", "tiny-llama", "--gpus-per-node", "2", "--slo-ttft", "0.1", "--slo-tpot", "0.01",
            "--num-requests", "200", "--processes", "1", "--no-colocated", "--out", str(plan)]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    _, _, document = read_plan(plan)
    assert document["model"] == {"model": "tiny-llama"}  # no load_format: dummy, the engine makes its weights
    assert "dummy" not in plan.read_text()


def test_planner_needs_neither_torch_nor_ray():
    code = (
        "import sys, placement.cli, placement.search, placement.planner;"
        "assert not {'torch', 'ray', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    done = subprocess.run([sys.executable, "-m", "placement", "--help"], capture_output=True, text=True, check=True)
    assert "--slo-ttft" in done.stdout


@pytest.mark.parametrize("estimate", [0.5, 2.0, 7.3, 40.0])
def test_search_goodput_brackets_from_any_estimate(estimate):
    from placement.goodput import search_goodput

    goodput, probes = search_goodput(lambda rate: 1.0 if rate <= 7.3 else 0.5, 0.9, estimate, tolerance=0.01)
    assert 7.3 * 0.99 <= goodput <= 7.3
    assert len(probes) == len({rate for rate, _ in probes}) <= 20  # no rate probed twice


def test_search_goodput_cap_and_zero():
    from placement.goodput import search_goodput

    always = lambda rate: 1.0  # noqa: E731
    assert search_goodput(always, 0.9, 5.0, max_doublings=0)[0] == 5.0
    never = lambda rate: 0.0  # noqa: E731
    goodput, probes = search_goodput(never, 0.9, 64.0, max_halvings=6)
    assert goodput == 0.0 and min(rate for rate, _ in probes) == 1.0
