"""Prefill policies (FCFS order, SJF with aging, priority, TTFT deadline, feasible deadline) and the token budget;
the engine's one scheduler across step modes."""

import time

import pytest
from conftest import assert_engine_idle

from distserve.core.config import SchedulerConfig
from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence, SequenceStatus
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.scheduler import Scheduler, StepMode
from distserve.scheduling.step_time import StepTimeModel
from distserve.scheduling.waiting_queue import WaitingQueue


def _scheduler(**options) -> WaitingQueue:
    return WaitingQueue(SchedulerConfig(**options), BlockManager(4096, 16, enable_prefix_caching=False))


def _seq(n: int, priority: int = 0, ttft_deadline: float | None = None) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(), priority=priority, ttft_deadline=ttft_deadline)


def _run_step(sched: WaitingQueue) -> list[Sequence]:
    batch = sched.schedule(max_seqs=256)
    for seq in batch:  # the batch is done at once: give the blocks back
        sched.block_manager.free(seq)
    return batch


def test_fcfs_keeps_arrival_order():
    sched = _scheduler(policy="fcfs", max_num_batched_tokens=100)
    seqs = [_seq(n) for n in (90, 10, 50, 5, 70, 30)]
    for s in seqs:
        sched.add(s)
    order = []
    while len(sched):
        order += _run_step(sched)
    assert order == seqs


def test_budget_caps_a_batch_but_an_oversized_prompt_runs_alone():
    sched = _scheduler(max_num_batched_tokens=100)
    for n in (40, 40, 40, 300, 10):
        sched.add(_seq(n))
    assert [s.num_tokens for s in _run_step(sched)] == [40, 40]
    assert [s.num_tokens for s in _run_step(sched)] == [40]
    assert [s.num_tokens for s in _run_step(sched)] == [300]
    assert [s.num_tokens for s in _run_step(sched)] == [10]


def test_priority_policy_orders_by_priority_then_arrival():
    sched = _scheduler(policy="priority", max_num_batched_tokens=10)
    seqs = [_seq(5, priority=p) for p in (2, 0, 1, 0)]
    for s in seqs:
        sched.add(s)
    order = []
    while len(sched):
        order += _run_step(sched)
    assert order == [seqs[1], seqs[3], seqs[2], seqs[0]]


def test_deadline_policy_orders_by_deadline_then_those_without_in_arrival_order():
    sched = _scheduler(policy="deadline", max_num_batched_tokens=10)
    seqs = [_seq(5, ttft_deadline=d) for d in (None, 108.0, None, 102.0, 105.0)]
    for s in seqs:
        sched.add(s)
    order = []
    while len(sched):
        order += _run_step(sched)
    assert order == [seqs[3], seqs[4], seqs[1], seqs[0], seqs[2]]


def test_deadline_policy_admits_chunks_by_deadline():
    """Chunked prefill: of the prompts waiting, the one due first gets the step's budget first."""
    sched = _scheduler(policy="deadline", max_num_batched_tokens=64)
    loose, tight = _seq(40, ttft_deadline=20.0), _seq(40, ttft_deadline=12.0)
    sched.add(loose)
    sched.add(tight)
    assert [(s, n) for s, n in sched.admit(max_seqs=8, budget=48)] == [(tight, 40), (loose, 8)]


def _order(sched: WaitingQueue, seqs: list[Sequence]) -> list[int]:
    """The indices in ``seqs`` of the sequences in the order the queue prefills them."""
    for s in seqs:
        sched.add(s)
    order = []
    while len(sched):
        order += _run_step(sched)
    return [seqs.index(s) for s in order]


def test_deadline_feasible_policy_puts_prompts_past_their_deadline_last():
    """Due first but already late: plain earliest-deadline-first runs it first, and the prompt
    still on time waits behind it; the feasible order runs the one on time first, then those
    without a deadline, then the late ones by deadline."""
    now = time.time()
    deadlines = (now + 30.0, now - 1.0, None, now - 2.0, now + 60.0)
    for policy, order in (("deadline", [3, 1, 0, 4, 2]), ("deadline-feasible", [0, 4, 2, 3, 1])):
        sched = _scheduler(policy=policy, max_num_batched_tokens=5)
        assert _order(sched, [_seq(5, ttft_deadline=d) for d in deadlines]) == order


def test_deadline_feasible_policy_counts_a_prompt_late_whose_prefill_outlasts_its_deadline():
    """A 200-token prompt due in 1 s where the instance's steps take 10 ms a token (2 s alone) can
    no longer make it; a 20-token one due as soon can (0.2 s). Until the step times are known,
    both count as on time."""
    step_time = StepTimeModel()
    for tokens in (1, 200) * 8:
        step_time.observe(tokens, 0.01 * tokens)
    now = time.time()
    for known, order in ((step_time, [1, 0]), (None, [0, 1])):
        config = SchedulerConfig(policy="deadline-feasible", max_num_batched_tokens=256)
        sched = WaitingQueue(config, BlockManager(4096, 16, enable_prefix_caching=False), known)
        big, small = _seq(200, ttft_deadline=now + 1.0), _seq(20, ttft_deadline=now + 1.5)
        assert sched.is_late(big, time.time()) is (known is not None)
        assert not sched.is_late(small, time.time())
        sched.add(big)
        sched.add(small)
        assert [[big, small].index(s) for s in sched.schedule(max_seqs=1)] == order[:1]


def _steps_until_long_prompt_runs(aging: float, limit: int = 60) -> int | None:
    """A 400-token prompt waits while every step brings four 20-token prompts."""
    sched = _scheduler(policy="sjf", max_num_batched_tokens=100, sjf_aging_tokens=aging)
    long = _seq(400)
    sched.add(long)
    for step in range(1, limit + 1):
        for _ in range(4):
            sched.add(_seq(20))
        if long in _run_step(sched):
            return step
    return None


def test_sjf_runs_short_prompts_first():
    sched = _scheduler(policy="sjf", max_num_batched_tokens=1000)
    for n in (300, 20, 100):
        sched.add(_seq(n))
    assert [s.num_tokens for s in _run_step(sched)] == [20, 100, 300]


@pytest.mark.parametrize("aging", [16.0, 64.0])
def test_sjf_aging_bounds_the_wait_of_a_long_prompt(aging):
    # It overtakes the new 20-token arrivals once 400 - aging * steps < 20.
    bound = int((400 - 20) // aging) + 2
    steps = _steps_until_long_prompt_runs(aging)
    assert steps is not None and steps <= bound


def test_sjf_without_aging_starves_the_long_prompt():
    assert _steps_until_long_prompt_runs(0.0) is None


def test_resumed_sequences_go_first():
    sched = _scheduler(policy="sjf")
    waiting, preempted = _seq(5), _seq(50)
    sched.add(waiting)
    sched.resume(preempted)
    assert _run_step(sched)[0] is preempted


@pytest.mark.parametrize("aging, finishes", [(32.0, True), (0.0, False)])
def test_long_request_finishes_under_a_stream_of_short_ones(aging, finishes):
    """Through the engine: two 8-token prompts arrive every step; a 200-token prompt waits."""
    from distserve.core.config import EngineConfig
    from distserve.engine.llm_engine import LLMEngine

    config = EngineConfig.from_flat(model="tiny-llama", policy="sjf", sjf_aging_tokens=aging, max_num_batched_tokens=64)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request(list(range(3, 203)), params, request_id="long")
    finished_at = None
    for step in range(1, 31):
        for i in range(2):
            engine.add_request(list(range(10, 18)), params, request_id=f"short-{step}-{i}")
        if any(out.request_id == "long" and out.finished for out in engine.step()):
            finished_at = step
            break
    if finishes:  # it overtakes the new arrivals once 200 - 32 * steps < 8
        assert finished_at is not None and finished_at <= (200 - 8) // 32 + 2
    else:
        assert finished_at is None


def test_a_prompt_due_first_gets_its_first_token_first_through_the_engine():
    """Prompts of loose and tight TTFT SLOs queued together (one prompt a prefill step): the engine
    prefills in deadline order, whatever the arrival order; fcfs in arrival order."""
    from distserve.core.config import EngineConfig
    from distserve.engine.llm_engine import LLMEngine

    def first_tokens(policy: str) -> list[str]:
        engine = LLMEngine(EngineConfig.from_flat(model="tiny-llama", policy=policy, max_num_batched_tokens=16))
        params = SamplingParams(max_tokens=4, temperature=0.0)
        arrivals = (("loose", 50.0), ("none", None), ("tight", 10.0), ("middle", 30.0))
        for i, (name, deadline) in enumerate(arrivals):  # other prompts: no prefix-cache hits
            prompt = list(range(3 + 20 * i, 19 + 20 * i))
            engine.add_sequence(engine.make_sequence(prompt, params, name, ttft_deadline=deadline))
        order: list[str] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id not in order:
                    order.append(out.request_id)
        assert_engine_idle(engine)
        return order

    assert first_tokens("deadline") == ["tight", "middle", "loose", "none"]
    assert first_tokens("fcfs") == ["loose", "none", "tight", "middle"]


# The engine's one scheduler and its step modes ------------------------------------------------------


def test_a_mode_change_keeps_the_queues_and_prefill_only_keeps_no_running_batch():
    """Prefill-first admits a prompt into the running batch and decodes it; a prefill-only mode is
    refused while it runs, and once it is gone forms batches of at most max_num_seqs prompts, every
    queued prompt still there, with no running batch between steps."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), bm, mode=StepMode.PREFILL_FIRST)
    first = _seq(6)
    sched.add(first)
    assert first.status is SequenceStatus.WAITING
    assert sched.schedule().seqs == [first] and first.status is SequenceStatus.RUNNING
    queued = [_seq(5) for _ in range(3)]
    for seq in queued:
        sched.add(seq)
    with pytest.raises(RuntimeError, match="prefill-only"):
        sched.set_mode(StepMode.PREFILL_ONLY)
    sched.finish_running(first)
    bm.free(first)
    sched.set_mode(StepMode.PREFILL_ONLY)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == queued[:2] and sched.num_running == 0
    assert all(seq.status is SequenceStatus.RUNNING for seq in batch.seqs)
    assert sched.num_waiting == 1 and sched.waiting_seqs() == queued[2:]
