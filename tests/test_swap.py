"""Preemption by swap: a preempted sequence's KV copied out to the host pool and back, chosen per
preemption against recompute by cost; outputs equal to transformers' greedy decoding either way."""

import pytest
from conftest import assert_engine_idle, random_prompts, reference_greedy

from distserve import LLM, SamplingParams
from distserve.core.config import CacheConfig, SchedulerConfig
from distserve.core.sequence import Sequence, SequenceStatus
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.scheduler import Scheduler
from distserve.scheduling.step_time import StepTimeModel
from distserve.scheduling.swap import SwapSpace

LENGTHS = [40, 90, 17, 120, 64, 8, 100, 33]
MAX_TOKENS = 40


def _decoding(prompt_len: int, block_manager: BlockManager) -> Sequence:
    """A sequence whose prompt (tokens of its own, so no prefix is shared) is computed and whose
    newest token still needs a slot."""
    seq = Sequence([prompt_len] * prompt_len, SamplingParams(max_tokens=100))
    block_manager.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    seq.append_token(7)
    return seq


def test_a_preempted_sequence_is_swapped_out_and_back_in_its_blocks_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    swap = SwapSpace(num_blocks=8, block_manager=bm, step_time=None)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), bm, swap=swap)
    first, second = _decoding(8, bm), _decoding(12, bm)  # 2 + 3 blocks, full: each needs a new one
    for seq in (first, second):
        scheduler.running.add(seq)
    table = list(second.block_table)
    batch = scheduler.schedule()  # one block free: the first grows, the second is swapped out
    assert batch.seqs == [first] and second.status is SequenceStatus.SWAPPED
    assert [(c.out, c.pairs) for c in swap.take_pending()] == [(True, list(zip(table, [0, 1, 2])))]
    assert scheduler.waiting_seqs() == [second] and scheduler.has_unfinished()
    assert swap.num_swap_outs == 1 and swap.num_free_blocks == 5
    scheduler.finish(first)  # its 3 blocks free: the second comes back (4 blocks, 0 to spare)
    batch = scheduler.schedule()
    assert batch.seqs == [second] and not batch.is_prefill and second.num_computed_tokens == 12
    copies = swap.take_pending()
    assert [c.out for c in copies] == [False]
    assert [host for _, host in copies[0].pairs] == [0, 1, 2] and swap.num_free_blocks == 8
    assert [device for device, _ in copies[0].pairs] == second.block_table[:3]
    scheduler.finish(second)
    assert bm.num_free_blocks == bm.num_blocks


def test_swapped_sequences_come_back_before_any_prompt_is_admitted_and_go_when_aborted():
    bm = BlockManager(num_blocks=6, block_size=4)
    swap = SwapSpace(num_blocks=8, block_manager=bm, step_time=None)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), bm, swap=swap)
    first, second = _decoding(8, bm), _decoding(12, bm)
    for seq in (first, second):
        scheduler.running.add(seq)
    scheduler.schedule()
    prompt = Sequence([5] * 4, SamplingParams(max_tokens=4))
    scheduler.add(prompt)  # one block would fit it, but the swapped sequence waits first
    assert prompt not in scheduler.schedule().seqs
    scheduler.finish(second)  # aborted while swapped out: its host blocks are free again
    assert swap.num_free_blocks == 8 and not len(swap)
    assert prompt in scheduler.schedule().seqs


def test_recompute_is_chosen_where_it_costs_less_than_the_copies():
    bm = BlockManager(num_blocks=6, block_size=4)
    step_time = StepTimeModel()
    for tokens in (1, 100, 1000) * 4:
        step_time.observe(tokens, 0.001 * tokens)  # a millisecond a token
    assert step_time.line() is not None
    swap = SwapSpace(num_blocks=8, block_manager=bm, step_time=step_time)
    seq = _decoding(12, bm)
    assert swap.should_swap(seq)  # nothing copied yet: swap
    swap.observe(num_blocks=4, seconds=0.004)  # a millisecond a block: 3 blocks out and in, 6 ms
    assert swap.should_swap(seq)  # against 12 ms of prefill
    swap.observe(num_blocks=1, seconds=1.0)
    assert not swap.should_swap(seq)
    assert not SwapSpace(num_blocks=2, block_manager=bm, step_time=None).should_swap(seq)  # no room


def _llm(chunked: bool, **options) -> LLM:
    """tiny-llama in blocks of 8, prefill first or chunked."""
    chunking = {"enable_chunked_prefill": True, "max_num_batched_tokens": 64} if chunked else {}
    return LLM("tiny-llama", block_size=8, **chunking, **options)


def _check_swapped(llm: LLM) -> None:
    """Sequences were swapped out and all came back; nothing stays in use on the device or the host."""
    swap = llm.engine.scheduler.swap
    assert swap.num_swap_outs > 0 and swap.num_swap_ins == swap.num_swap_outs
    assert llm.engine.scheduler.num_preemptions == swap.num_swap_outs + swap.num_recomputes
    assert swap.num_free_blocks == swap.num_blocks and swap.blocks_copied > 0
    # What the choice learns the copies' time from is the steps' swap phase.
    assert swap.copy_seconds == pytest.approx(llm.engine.stats.totals["swap"]) and swap.copy_seconds > 0
    assert_engine_idle(llm.engine)


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill-first", "chunked"])
def test_swapped_kv_comes_back_exact(reference_model, chunked):
    """A KV pool too small for the load: preempted sequences are swapped out and back, and every
    output equals transformers' greedy output."""
    model = reference_model("tiny-llama")
    llm = _llm(chunked, dtype="float32", num_kv_blocks=30, swap_space=0.01)
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=3)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for prompt, out in zip(prompts, outputs):
        assert out.output_token_ids == reference_greedy(model, prompt, MAX_TOKENS)
    _check_swapped(llm)


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill-first", "chunked"])
def test_swapped_bfloat16_kv_comes_back_bit_for_bit(chunked):
    """In bfloat16, where no run is token-exact against transformers: the same load swapped out and
    back gives the tokens and the bit-equal logprobs of a pool with room for it all. The engine
    computes each sequence's rows alike whatever the batch, so only KV changed on its way through
    the host pool could tell them apart (one bfloat16 unit in the last place of one K value moves a
    logprob by about 0.02)."""
    prompts = random_prompts(LENGTHS, 1024, seed=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    swapping = _llm(chunked, dtype="bfloat16", num_kv_blocks=30, swap_space=0.01)
    roomy = _llm(chunked, dtype="bfloat16", num_kv_blocks=300)
    for out, expected in zip(swapping.generate(prompts, params), roomy.generate(prompts, params)):
        assert out.output_token_ids == expected.output_token_ids
        assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in expected.logprobs]
    assert roomy.engine.scheduler.num_preemptions == 0
    _check_swapped(swapping)


def test_swap_space_is_checked():
    with pytest.raises(ValueError, match="swap_space must be at least 0 GiB"):
        CacheConfig(swap_space=-1)
