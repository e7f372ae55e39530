"""Block mode passes steady stretches of decode steps at once, with the very result of stepping
through them: every timeline the same to the last float, for the presets' workloads, colocated
(chunked prefill or prefill first, with and without the prefix cache, with KV to spare and short
of it) and disaggregated, on the roofline's step times (``decode_times`` for a stretch) and on
plain callables (one ``step_time`` call a step)."""

import dataclasses

import pytest

from placement import engine_sim
from placement.cli import build_problem, search_notes, search_parser
from placement.colocation import colocated_spec
from placement.decode_stretch import step_ends
from placement.engine_sim import simulate_blocks, simulate_colocated
from placement.latency import InstanceModels, Parallelism
from placement.search import PhaseProblem
from placement.sim_specs import SimRequest
from placement.workload import WORKLOAD_PRESETS

NUM_REQUESTS = 150


def _problem(workload: str) -> PhaseProblem:
    args = search_parser().parse_args(["--model", "llama-2-7b", "--gpus-per-node", "4", "--workload", workload,
                                       "--slo-ttft", "1", "--slo-tpot", "0.1"])  # fmt: skip
    return build_problem(search_notes(args))


def _requests(problem: PhaseProblem, rate: float) -> list[SimRequest]:
    arrivals = problem.unit_arrivals[:NUM_REQUESTS]
    return [SimRequest(t / rate, r.prompt_len, r.output_len) for t, r in zip(arrivals, problem.requests)]


def _timelines(results) -> list[dict]:
    return [r.timeline.to_json() for r in results]


def _stepping_and_stretched(simulate, monkeypatch) -> tuple[list[dict], list[dict], int]:
    """The timelines stepping one step at a time, then passing stretches, and the stretches passed."""
    stretch = engine_sim._EngineSim.stretch
    with monkeypatch.context() as patch:
        patch.setattr(engine_sim._EngineSim, "stretch", lambda self, inst, step: False)
        stepped = _timelines(simulate())
    passed = []

    def counted(self, inst, step):
        drawn = stretch(self, inst, step)
        passed.append(drawn)
        return drawn

    with monkeypatch.context() as patch:
        patch.setattr(engine_sim._EngineSim, "stretch", counted)
        stretched = _timelines(simulate())
    return stepped, stretched, sum(passed)


@pytest.mark.parametrize("workload", WORKLOAD_PRESETS)
@pytest.mark.parametrize(
    ("chunked", "prefix_caching", "tight"),
    [(True, True, False), (True, False, True), (False, True, True), (False, False, False)],
)
def test_colocated_stretches_are_what_stepping_gives(workload, chunked, prefix_caching, tight, monkeypatch):
    problem = _problem(workload)
    requests = _requests(problem, rate=4.0)
    spec = colocated_spec(problem, Parallelism(1), 512)
    # Tight: room for the longest request twice over, so that others are preempted.
    longest_blocks = max(-(-(r.prompt_len + r.output_len) // spec.block_size) for r in requests)
    spec = dataclasses.replace(spec, chunked_prefill=chunked, prefix_caching=prefix_caching,
                               num_blocks=2 * longest_blocks if tight else spec.num_blocks)  # fmt: skip
    stepped, stretched, passed = _stepping_and_stretched(lambda: simulate_colocated(requests, spec), monkeypatch)
    assert passed > 0
    assert stretched == stepped
    assert any(t["num_preemptions"] for t in stepped) == tight


@pytest.mark.parametrize("workload", WORKLOAD_PRESETS)
def test_disaggregated_stretches_are_what_stepping_gives(workload, monkeypatch):
    problem = _problem(workload)
    models: InstanceModels = problem.models
    prefill = dataclasses.replace(models.prefill_spec(Parallelism(1)), block_size=16)
    decode = dataclasses.replace(models.decode_spec(Parallelism(1)), block_size=16)
    requests = _requests(problem, rate=6.0)
    transfer = models.transfer_time(same_node=True)
    stepped, stretched, passed = _stepping_and_stretched(lambda: simulate_blocks(requests, prefill, decode, transfer),
                                                         monkeypatch)  # fmt: skip
    assert passed > 0
    assert stretched == stepped


def test_plain_step_time_callables_stretch_alike(monkeypatch):
    """Without ``step_times``, a stretch calls ``step_time`` step by step: the same floats again."""
    problem = _problem("chat")
    spec = dataclasses.replace(colocated_spec(problem, Parallelism(1), 512), step_times=None)
    requests = _requests(problem, rate=2.0)
    stepped, stretched, passed = _stepping_and_stretched(lambda: simulate_colocated(requests, spec), monkeypatch)
    assert passed > 0
    assert stretched == stepped


def test_a_stretch_ends_with_the_first_step_to_reach_the_next_event():
    step_time = lambda batch, context: 0.25  # noqa: E731
    assert step_ends(step_time, None, 4, 100, 1.0, 100, 2.0) == [1.0, 1.25, 1.5, 1.75, 2.0]
    assert step_ends(step_time, None, 4, 100, 1.0, 100, 1.9) == [1.0, 1.25, 1.5, 1.75, 2.0]
    assert step_ends(step_time, None, 4, 100, 1.0, 3, 9.0) == [1.0, 1.25, 1.5]
    assert step_ends(step_time, None, 4, 100, 1.0, 100, 1.0) == [1.0]
