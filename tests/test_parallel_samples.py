"""A request of n samples: its prompt prefilled once and, disaggregated, its KV pulled once; the
samples share the prompt's blocks and copy the last one on their first write. Each sample equals
the same request run alone with its seed (seed + index), and every block comes back."""

import asyncio
import dataclasses

import pytest
from conftest import assert_engine_idle, random_prompts, reference_greedy, wait_nothing_in_use_async

from distserve import LLM, AsyncCluster, SamplingParams

BLOCK = 8
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=4)


@pytest.fixture(scope="module")
def llama(reference_model):
    return reference_model("tiny-llama")


@pytest.fixture(scope="module")
def llm():
    llm = LLM("tiny-llama", block_size=BLOCK, dtype="float32")
    yield llm
    llm.shutdown()


def alone(params: SamplingParams) -> list[SamplingParams]:
    """Each sample of ``params`` as a request of its own."""
    return [dataclasses.replace(params.sample_params(i), n=1) for i in range(params.n)]


@pytest.mark.parametrize("prompt_len, copies", [(21, 3), (24, 0)])
def test_samples_share_one_prefill_and_equal_the_same_requests_alone(llm, prompt_len, copies):
    # 21 tokens end mid-block: three samples copy that block on their first write, the fourth
    # writes into it. 24 fill three blocks: each sample's first token starts a block of its own.
    (prompt,) = random_prompts([prompt_len], 1000, seed=prompt_len)
    bm = llm.engine.block_manager
    queried, copied = bm.prefix_cache_queried_tokens, bm.num_copied_blocks
    outputs = llm.generate([prompt], SAMPLED)
    assert bm.prefix_cache_queried_tokens - queried == prompt_len  # one allocation, one prefill
    assert bm.num_copied_blocks - copied == copies
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert len({tuple(o.output_token_ids) for o in outputs}) == 4
    singles = [llm.generate([prompt], p)[0] for p in alone(SAMPLED)]
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in singles]
    assert [o.text for o in outputs] == [o.text for o in singles]
    assert_engine_idle(llm.engine)


def test_greedy_samples_equal_transformers(llm, llama):
    prompts = random_prompts([13, 30], llama.config.vocab_size, seed=5)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, n=3))
    assert [o.index for o in outputs] == [0, 1, 2] * 2
    for i, prompt in enumerate(prompts):
        want = reference_greedy(llama, prompt, 10)
        assert [o.output_token_ids for o in outputs[3 * i : 3 * i + 3]] == [want] * 3
    assert_engine_idle(llm.engine)


def test_a_sample_that_ends_at_its_first_token_leaves_the_others_going(llm):
    (prompt,) = random_prompts([21], 1000, seed=3)
    firsts = [o.output_token_ids[0] for o in llm.generate([prompt], SAMPLED)]
    params = dataclasses.replace(SAMPLED, stop_token_ids=[firsts[0]])  # sample 0 stops at once
    outputs = llm.generate([prompt], params)
    assert outputs[0].output_token_ids == [firsts[0]] and outputs[0].finish_reason == "stop"
    singles = [llm.generate([prompt], p)[0] for p in alone(params)]
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in singles]
    assert any(len(o.output_token_ids) > 1 for o in outputs)
    assert_engine_idle(llm.engine)


def test_samples_preempted_for_blocks_are_recomputed_to_the_same_tokens(llm):
    # Ten blocks of 8 tokens for four samples of up to 45 tokens: they cannot all stay.
    (prompt,) = random_prompts([21], 1000, seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=4, ignore_eos=True)
    small = LLM("tiny-llama", block_size=BLOCK, num_kv_blocks=10, dtype="float32")
    try:
        outputs = small.generate([prompt], params)
        assert small.engine.scheduler.num_preemptions > 0
        assert_engine_idle(small.engine)
    finally:
        small.shutdown()
    singles = [llm.generate([prompt], p)[0] for p in alone(params)]
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in singles]


def test_disaggregated_samples_cross_with_one_pull(ray_cluster):
    # Sample 0 stops at its first token on the prefill instance: sample 1 carries the prompt's
    # KV to the decode instance, which forks samples 2 and 3 from it once it has arrived.
    (prompt,) = random_prompts([21], 1000, seed=3)

    async def main():
        # No prefix cache: the probe's prompt is computed again, and counted.
        options = dict(block_size=BLOCK, enable_prefix_caching=False)
        async with AsyncCluster(model="tiny-llama", prefill={}, decode={}, **options, dtype="float32") as cluster:
            first = await _finals(cluster, prompt, SAMPLED, "probe")
            params = dataclasses.replace(SAMPLED, stop_token_ids=[first[0].output_token_ids[0]])
            prefill, decode = cluster.orchestrator.instances
            steps_before, _ = await prefill.handle.recent_steps.remote()
            before = await decode.handle.info.remote()
            outputs = await _finals(cluster, prompt, params, "shared")
            _, records = await prefill.handle.recent_steps.remote(steps_before)
            after = await decode.handle.info.remote()
            pulls = await decode.handle.migrations.remote()
            singles = [(await _finals(cluster, prompt, p, f"alone-{i}"))[0] for i, p in enumerate(alone(params))]
            await wait_nothing_in_use_async(cluster)
            return outputs, singles, records, pulls, before, after

    outputs, singles, records, pulls, before, after = asyncio.run(main())
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in singles]
    assert outputs[0].finish_reason == "stop" and len(outputs[0].output_token_ids) == 1
    assert sum(r.num_tokens for r in records if r.is_prefill) == len(prompt)  # one prefill
    [pull] = [record for request_id, record in pulls.items() if request_id.startswith("shared-")]
    assert after.num_kv_pulls - before.num_kv_pulls == 1 and pull.num_tokens == len(prompt)
    # Samples 1-3 share the prompt's last block there, 21 tokens into its third: two copy it.
    assert after.num_copied_blocks - before.num_copied_blocks == 2
    assert all(o.metrics.decode_instance for o in outputs[1:])


def test_cancelling_a_request_of_n_samples_frees_every_block(ray_cluster):
    (prompt,) = random_prompts([21], 1000, seed=4)
    params = SamplingParams(max_tokens=200, temperature=0.8, seed=1, n=3, ignore_eos=True)

    async def main():
        async with AsyncCluster(
            model="tiny-llama", block_size=BLOCK, prefill={}, decode={}, dtype="float32"
        ) as cluster:
            seen = set()
            async for output in cluster.generate(prompt, params):
                seen.add(output.index)
                if len(output.output_token_ids) >= 5:
                    break
            await wait_nothing_in_use_async(cluster)
            return seen

    assert asyncio.run(main())


async def _finals(cluster, prompt, params, request_id):
    last = {}
    async for output in cluster.generate(prompt, params, request_id):
        last[output.index] = output
    assert sorted(last) == list(range(params.n)) and all(o.finished for o in last.values())
    return [last[i] for i in sorted(last)]
