"""The planner's block-mode simulation and a real engine, each running the engine's scheduler on the
same requests under every scheduling policy, make the same choices: the same order of admission
and the same number of steps for every request.

The engine steps a tiny model on the CPU. Whatever its steps take, the step times its scheduler
learns from (``StepTimeModel``, read by the TPOT-aware cut of chunks and by ``deadline-feasible``)
are set to what the simulation's latency gives the same batch: ``SECONDS_PER_TOKEN`` a token, a
power of two, so sums of them are exact in both. All requests arrive at once, so nothing else of
the engine's timing reaches its choices. TTFT deadlines are far off, or past already (late from
the start), and the small KV pool makes the longest requests preempt others.
"""

import pytest
from conftest import random_prompts

from distserve.core.config import EngineConfig
from distserve.core.sampling_params import SamplingParams
from distserve.engine.llm_engine import LLMEngine
from placement import engine_sim
from placement.engine_sim import simulate_colocated
from placement.sim_specs import ColocatedInstanceSpec, SimRequest

SECONDS_PER_TOKEN = 2.0**-10
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS = 8, 24, 6
PROMPTS = [37, 5, 60, 12, 24, 90, 3, 45, 17, 30]
OUTPUTS = [20, 33, 8, 41, 15, 12, 26, 9, 30, 18]
PRIORITIES = [2, 0, 1, 2, 0, 1, 0, 2, 1, 0]
FAR = 1e12  # a TTFT deadline (wall-clock seconds) that is never near
DEADLINES = [FAR + 5, None, FAR + 1, -1.0, FAR + 3, FAR + 2, None, -2.0, FAR + 4, FAR + 6]
TPOT_SLOS = [0.02, None, 0.05, 0.02, None, 0.03, 0.02, None, 0.04, 0.02]

CASES = {
    "fcfs": dict(policy="fcfs"),
    "sjf": dict(policy="sjf"),
    "priority": dict(policy="priority"),
    "deadline": dict(policy="deadline"),
    "deadline-feasible": dict(policy="deadline-feasible"),
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=24),
    "chunked, TPOT-aware": dict(enable_chunked_prefill=True, max_num_batched_tokens=24, tpot_aware_chunking=True),
}


def _seconds(num_tokens: int) -> float:
    return SECONDS_PER_TOKEN * num_tokens


def _tally(admitted: list[str], steps: dict[str, int], request_ids: list[str], count: int = 1) -> None:
    for request_id in request_ids:
        if request_id not in steps:
            admitted.append(request_id)
        steps[request_id] = steps.get(request_id, 0) + count


def _engine_run(options: dict) -> tuple[list[str], dict[str, int]]:
    options = {"max_num_batched_tokens": 64, **options}
    config = EngineConfig.from_flat(model="tiny-llama", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
                                    max_num_seqs=MAX_SEQS, **options)  # fmt: skip
    engine = LLMEngine(config)
    observe = engine.step_time.observe
    engine.step_time.observe = lambda num_tokens, seconds: observe(num_tokens, _seconds(num_tokens))
    admitted: list[str] = []
    steps: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def recorded():
        batch = schedule()
        _tally(admitted, steps, [seq.request_id for seq in batch.seqs])
        return batch

    engine.scheduler.schedule = recorded
    prompts = random_prompts(PROMPTS, engine.vocab_size, seed=5)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=OUTPUTS[i], temperature=0.0, ignore_eos=True)
        engine.add_sequence(engine.make_sequence(prompt, params, str(i), PRIORITIES[i], ttft_deadline=DEADLINES[i],
                                                 tpot_slo=TPOT_SLOS[i]))  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()
    return admitted, steps


def _simulated_run(options: dict, monkeypatch) -> tuple[list[str], dict[str, int]]:
    admitted: list[str] = []
    steps: dict[str, int] = {}
    step_done = engine_sim._EngineSim.step_done

    def recorded(self, inst, step):
        _tally(admitted, steps, [seq.request_id for seq in step.batch.seqs], len(step.starts))
        step_done(self, inst, step)

    monkeypatch.setattr(engine_sim._EngineSim, "step_done", recorded)
    requests = [SimRequest(0.0, p, o, str(i), PRIORITIES[i], DEADLINES[i], TPOT_SLOS[i])
                for i, (p, o) in enumerate(zip(PROMPTS, OUTPUTS))]  # fmt: skip
    spec = ColocatedInstanceSpec(
        1,
        lambda lens: _seconds(sum(lens)),
        lambda batch, context: _seconds(batch),
        options.get("max_num_batched_tokens", 64),
        MAX_SEQS,
        BLOCK_SIZE,
        NUM_BLOCKS,
        chunked_prefill=options.get("enable_chunked_prefill", False),
        policy=options.get("policy", "fcfs"),
        tpot_aware_chunking=options.get("tpot_aware_chunking", False),
    )
    results = simulate_colocated(requests, spec)
    assert sum(r.timeline.num_preemptions for r in results) > 0  # the small pool preempts
    return admitted, steps


@pytest.mark.parametrize("case", CASES)
def test_the_simulation_schedules_as_the_engine_does(case, monkeypatch):
    engine_admitted, engine_steps = _engine_run(CASES[case])
    simulated_admitted, simulated_steps = _simulated_run(CASES[case], monkeypatch)
    assert simulated_admitted == engine_admitted
    assert simulated_steps == engine_steps
