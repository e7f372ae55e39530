"""The forecast of how colocated and disaggregated layouts would serve a load, from a step-time line."""

import math

import pytest

from distserve.cluster.layout_forecast import ChunkedPrefill, Demand, Forecast, forecast
from distserve.scheduling.step_time import StepCost

# The 58M Llama's steps on one CPU thread, as its engine fitted them: 60 ms a step and 1.25 ms a token.
COST = StepCost(fixed=0.060, per_token=0.00125)
CUT = ChunkedPrefill(max_num_batched_tokens=256, block_size=16, tpot_aware=True)


def both(demand: Demand, chunking: ChunkedPrefill = CUT) -> tuple[Forecast, Forecast]:
    """The forecast on 2 instances, colocated and disaggregated."""
    return forecast(True, 2, demand, COST, chunking), forecast(False, 2, demand, COST, chunking)


def test_a_tight_ttft_slo_favours_colocation_and_a_tight_tpot_slo_disaggregation():
    # Prompts of 1024 tokens, 64 out, at 0.68 req/s. TTFT-tight: every colocated instance
    # prefills, where one prefill instance is busy 91% of the time (a prompt takes 1.34 s).
    colocated, disaggregated = both(Demand(0.68, 1024, 64, slo_ttft=3.34, slo_tpot=0.262))
    assert colocated.share == pytest.approx(1.04, abs=0.01) and disaggregated.share == pytest.approx(2.46, abs=0.01)
    assert disaggregated.utilization == pytest.approx(0.91, abs=0.01) and colocated < disaggregated
    # TPOT-tight: a step cut to 80% of 64.5 ms runs a block of prompt beside decoding and prefills
    # 1024 tokens in 64 steps of 82 ms: over capacity, where the prefill instance keeps up.
    colocated, disaggregated = both(Demand(0.68, 1024, 64, slo_ttft=12.5, slo_tpot=0.0645))
    assert math.isinf(colocated.share) and colocated.utilization == pytest.approx(1.79, abs=0.01)
    assert str(colocated) == "over capacity (179% busy)"
    assert disaggregated.share == pytest.approx(0.98, abs=0.01) and str(disaggregated) == "at 98% of their SLOs"


def test_a_light_load_is_forecast_within_its_slos_either_way():
    colocated, disaggregated = both(Demand(0.3, 1024, 64, slo_ttft=3.34, slo_tpot=0.262))
    assert colocated.share == pytest.approx(0.80, abs=0.01) and disaggregated.share == pytest.approx(0.54, abs=0.01)


def test_colocated_steps_that_are_not_cut_take_the_whole_budget_beside_decoding():
    uncut = ChunkedPrefill(max_num_batched_tokens=256, block_size=16, tpot_aware=False)
    colocated, disaggregated = both(Demand(0.3, 1024, 64, slo_ttft=12.5, slo_tpot=0.0645), uncut)
    assert colocated.share == pytest.approx(COST.seconds(256) / 0.0645)  # TPOT: a 256-token step, 5.9x the SLO
    assert disaggregated.share < 1


def test_a_decode_instance_that_cannot_keep_up_is_forecast_to_miss_without_bound():
    # One-token prompts; 200 tokens a second to decode at 1.25 ms each take a quarter of every
    # second: fine; 1000 do not fit.
    assert forecast(False, 2, Demand(3.125, 1, 64, 100.0, 1.0), COST, CUT).share < 1
    over = forecast(False, 2, Demand(15.625, 1, 64, 100.0, 1.0), COST, CUT)
    assert math.isinf(over.share) and over.utilization == pytest.approx(1.25)


def test_two_overloaded_layouts_rank_by_how_far_over_they_are():
    # TTFT-tight at 1.34 req/s: both over capacity, colocated less (two instances prefill, a chunk
    # of 111 tokens every 0.21 s each), though a lone prompt takes longer there than on a prefill instance.
    colocated, disaggregated = both(Demand(1.34, 1024, 64, slo_ttft=3.34, slo_tpot=0.262))
    assert math.isinf(colocated.share) and math.isinf(disaggregated.share)
    assert colocated.utilization == pytest.approx(1.30, abs=0.01)
    assert disaggregated.utilization == pytest.approx(1.80, abs=0.01)
    assert colocated < disaggregated
