"""The planner holds colocated instances (chunked prefill) against disaggregated pairs on the same
latency models, says which wins and by how much, and writes the winner's plan, which launch reads
and ``place simulate`` re-predicts."""

import json

import pytest

from distserve.entrypoints.launch import load_launch_config
from placement.cli import build_problem, main, search_notes, search_parser
from placement.colocation import ColocatedDeployment, colocated_attainment, search_colocated
from placement.latency import Parallelism
from placement.plan_file import read_plan

BASE = ["--model", "llama-2-7b", "--gpus-per-node", "4", "--num-requests", "200", "--processes", "1"]


def _place(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_colocation_wins_a_loose_tpot_and_its_plan_launches_and_re_predicts(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    code, out, err = _place([*BASE, "--slo-ttft", "0.25", "--slo-tpot", "0.2", "--rate", "20", "--out", str(plan)],
                            capsys)  # fmt: skip
    assert code == 0, err
    assert "colocated (both phases per instance, chunked prefill of 512 tokens a step):" in out
    assert "colocated wins: 7.11 against 6.65 req/s per GPU (1.07x)" in out
    deployment, notes, document = read_plan(plan)
    assert deployment == ColocatedDeployment(Parallelism(2, 1), 2, 512)
    comparison = notes["comparison"]
    assert comparison["winner"] == "colocated"
    assert comparison["colocated_per_gpu"] / comparison["disaggregated_per_gpu"] == pytest.approx(1.07, abs=0.005)
    assert notes["deployment"] == "colocated" and notes["predicted"]["attainment_at_rate"] >= 0.9
    pool = document["cluster"]["colocated"]
    assert pool == {"instances": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                    "enable_chunked_prefill": True, "max_num_batched_tokens": 512, "max_num_seqs": 256}  # fmt: skip

    cluster, _ = load_launch_config(plan=str(plan))
    engines = [config for _, config in cluster.instance_configs()]
    assert len(engines) == 2 and all(e.scheduler.role == "colocated" and e.scheduler.enable_chunked_prefill
                                     and e.parallel.tensor_parallel_size == 2 for e in engines)  # fmt: skip

    code, out, err = _place(["simulate", "--plan", str(plan), "--rates", "20,40", "--json"], capsys)
    assert code == 0, err
    points = json.loads(out.strip().splitlines()[-1])
    assert points[0]["attainment"] == pytest.approx(notes["predicted"]["attainment_at_rate"], abs=1e-4)
    assert points[1]["attainment"] < 0.5


def test_disaggregation_wins_long_prompts_under_a_tight_tpot(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    args = [*BASE, "--slo-ttft", "2", "--slo-tpot", "0.015", "--workload", "summarization", "--out", str(plan)]
    code, out, err = _place(args, capsys)
    assert code == 0, err
    assert "disaggregated wins: 5.12 against 4 req/s per GPU (1.28x)" in out
    deployment, notes, document = read_plan(plan)
    assert set(document["cluster"]) == {"prefill", "decode"} and notes["comparison"]["winner"] == "disaggregated"


@pytest.mark.slow  # simulates minutes of overload; the search below runs the same simulator
def test_a_colocated_instance_meets_the_slos_unloaded_and_misses_them_overloaded():
    args = search_parser().parse_args([*BASE, "--slo-ttft", "0.25", "--slo-tpot", "0.2"])
    problem = build_problem(search_notes(args))
    par = Parallelism(1, 1)
    assert colocated_attainment(problem, par, 512, rate=0.1) == 1.0
    assert colocated_attainment(problem, par, 512, rate=1000.0) < 0.1
    (best, *_) = search_colocated(problem, 512)
    assert best.goodput > 0 and best.per_gpu == best.goodput / best.parallelism.gpus
