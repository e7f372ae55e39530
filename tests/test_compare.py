"""``distserve place compare``: a run's timelines against their simulation, stage by stage."""

import pytest

from distserve.core.timeline import RequestTimeline, read_jsonl, write_jsonl
from placement import compare
from placement.cli import main
from placement.fitted import FittedLatency

FITTED = FittedLatency(prefill=(0.01, 1e-4, 0.0), decode=(0.005, 1e-3, 1e-5))


def _run() -> list[RequestTimeline]:
    """A 'real' run: the simulation itself, so every stage agrees exactly."""
    requests = [RequestTimeline(str(i), 30 + 17 * i, 2 + i % 5, 0.02 * i) for i in range(12)]
    return compare.simulate_like(requests, compare.RunSetup(num_kv_blocks=64), FITTED.prefill_time, FITTED.decode_time)


def test_a_run_equal_to_its_simulation_differs_nowhere():
    run = _run()
    rows = compare.compare_stages(run, run)
    assert {r.stage for r in rows} >= {"queue", "prefill", "handover", "pull", "step", "ttft", "tpot"}
    assert all(r.median_difference == 0 and r.p50_error == r.p90_error == 0 for r in rows)
    steps = compare.compare_steps(run, FITTED.decode_time)
    assert steps.count > 0 and steps.median_ratio == pytest.approx(1.0)


def test_steps_are_rebuilt_from_the_requests_in_them():
    a = RequestTimeline("a", 10, 3, 0.0, steps=[(1.0, 1.5, 2), (1.5, 2.5, 1)])
    b = RequestTimeline("b", 20, 2, 0.0, steps=[(1.0, 1.5, 2)])
    c = RequestTimeline("c", 5, 2, 0.0, steps=[(3.0, 3.1, 2)])  # its step's other member is not in the run
    assert [(s.start, s.end, s.batch_size, s.context) for s in compare.real_steps([a, b, c])] == [
        (1.0, 1.5, 2, 11 + 21),
        (1.5, 2.5, 1, 12),
    ]
    # Twice as slow as a model of 0.25 s per sequence.
    assert compare.compare_steps([a, b], lambda batch, context: 0.25 * batch).by_batch == {1: (1, 4.0), 2: (1, 1.0)}


def test_steps_are_told_apart_by_what_ran_beside_them():
    """A step alone, one during another instance's prefill batch, one during a pull into its instance."""
    a = RequestTimeline("a", 10, 4, 0.0, prefill_start=0.0, prefill_end=0.1, prefill_instance="p",
                        migration_start=0.2, migration_end=0.3, decode_instance="d",
                        steps=[(0.3, 0.4, 1), (0.4, 0.6, 1), (0.6, 0.9, 1)])  # fmt: skip
    b = RequestTimeline("b", 10, 1, 0.0, prefill_start=0.4, prefill_end=0.6, prefill_instance="p",
                        migration_start=0.6, migration_end=0.9, decode_instance="d")  # fmt: skip
    slowdown = compare.step_slowdown([a, b], lambda batch, context: 0.1)
    expected = {"alone": (1, 1.0), "during another instance's batch": (1, 2.0), "during a KV pull": (1, 3.0)}
    assert {label: (n, round(ratio, 9)) for label, (n, ratio) in slowdown.items()} == expected


def test_compare_command_prints_each_stage_and_attainment(tmp_path, capsys):
    run = _run()
    slower = [RequestTimeline.from_json({**t.to_json(), "token_times": [x * 2 for x in t.token_times]}) for t in run]
    write_jsonl(tmp_path / "run.jsonl", slower)
    FITTED.save(tmp_path / "profile.json")
    args = [
        "compare",
        "--trace",
        str(tmp_path / "run.jsonl"),
        "--profile",
        str(tmp_path / "profile.json"),
        "--num-kv-blocks",
        "64",
        "--slo-ttft",
        "0.05",
        "--slo-tpot",
        "0.02",
        "--sim-out",
        str(tmp_path / "s.jsonl"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    for stage in ("queue", "prefill", "pull", "step", "ttft", "tpot"):
        assert f"\n{stage} " in out
    assert "attainment: real" in out
    assert [t.request_id for t in read_jsonl(tmp_path / "s.jsonl")] == [t.request_id for t in run]


def test_compare_refuses_a_run_whose_requests_the_simulation_lacks(tmp_path):
    run = _run()
    other = [RequestTimeline.from_json({**run[0].to_json(), "request_id": "elsewhere"})]
    with pytest.raises(ValueError, match="not in the simulation"):
        compare.compare_stages(other, run)
    (tmp_path / "empty.jsonl").write_text("")
    FITTED.save(tmp_path / "p.json")
    assert main(["compare", "--trace", str(tmp_path / "empty.jsonl"), "--profile", str(tmp_path / "p.json")]) == 2


def test_contention_and_transfer_are_fitted_back_from_a_run_that_has_them():
    """A run simulated with known contention and pulls of 5 ms + 20 us/token: the fit recovers them."""
    from placement.simulator import Contention

    requests = [RequestTimeline(str(i), 30 + 17 * (i % 9), 6, 0.05 * i) for i in range(60)]
    setup = compare.RunSetup(num_kv_blocks=256, transfer_fixed=0.005, transfer_per_token=2e-5)
    known = {"prefill": Contention(1.0, 1.5, 1.5), "step": Contention(1.25, 1.5, 2.0)}
    run = compare.simulate_like(requests, setup, FITTED.prefill_time, FITTED.decode_time, known)
    fixed, per_token = compare.fit_transfer(run)
    assert fixed == pytest.approx(0.005) and per_token == pytest.approx(2e-5)
    fitted = compare.fit_contention(run, FITTED.prefill_time, FITTED.decode_time)
    assert fitted["step"].alone == pytest.approx(1.25, rel=0.02)
    assert fitted["step"].beside_batch == pytest.approx(1.5, rel=0.02)
    assert fitted["prefill"].beside_batch == pytest.approx(1.5, rel=0.02)
    plain = compare.simulate_like(requests, setup, FITTED.prefill_time, FITTED.decode_time)
    assert vars(compare.fit_contention(plain, FITTED.prefill_time, FITTED.decode_time)["step"]) == pytest.approx(
        vars(Contention())
    )


def test_serving_delays_are_fitted_back_from_a_run_that_has_them():
    """A request reaches its instance 4 ms after arriving, each token the orchestrator 2 ms after it is
    sampled, and an instance starts its next batch 1 ms after one ends: the fit recovers all three."""
    from placement.sim_specs import ServingDelays

    requests = [RequestTimeline(str(i), 30 + 17 * (i % 9), 6, 0.05 * i) for i in range(40)]
    delays = ServingDelays(dispatch=0.004, delivery=0.002, step_gap=0.001)
    run = compare.simulate_like(requests, compare.RunSetup(num_kv_blocks=256), FITTED.prefill_time,
                                FITTED.decode_time, None, delays)  # fmt: skip
    assert vars(compare.fit_delays(run)) == pytest.approx(vars(delays))
    first = run[0]
    assert first.prefill_queued == pytest.approx(first.arrival + 0.004)
    assert first.token_times[0] == pytest.approx(first.prefill_end + 0.002)
