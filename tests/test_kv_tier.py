"""The shared prefix tier: its LRU index, blocks looked up and saved by the block manager, a block
written by one engine and read by another (on one node and across nodes), and a conversation's
history on 2 prefill + 1 decode instances; outputs equal to transformers' greedy decoding."""

import asyncio

import torch
from conftest import (
    IndexTierClient,
    assert_engine_idle,
    random_prompts,
    reference_greedy,
    wait_nothing_in_use_async,
)

from distserve import AsyncCluster, SamplingParams
from distserve.core.config import EngineConfig
from distserve.core.sequence import Sequence
from distserve.kv_connector.tier import TierConnector
from distserve.kv_tier.index import TierIndex
from distserve.scheduling.block_manager import BlockManager


def _keys(*blocks: int) -> list:
    return [(h, (h, h)) for h in blocks]


def _write(index, holder, *blocks):
    """Lease a slot per block and commit the blocks to them; the slots."""
    slots = index.lease(holder, len(blocks))
    index.commit(holder, list(zip(slots, _keys(*blocks))))
    return slots


def test_the_index_finds_leading_runs_and_never_a_collision():
    index = TierIndex(capacity=4)
    slots = index.lease("a", 3)
    assert slots == [0, 1, 2]
    assert index.lookup("b", _keys(1, 2)) == []  # leased, not yet written
    index.commit("a", list(zip(slots, _keys(1, 2, 3))))
    assert index.lookup("b", _keys(1, 2, 9, 3)) == [0, 1]
    assert index.lookup("b", [(1, (0, 0))]) == []  # the hash of block 1 with other tokens
    assert _write(index, "c", 2) == [3] and len(index) == 3  # held already: its slot is free again
    assert index.stats.queried == 7 and index.stats.hits == 2 and index.stats.written == 3


def test_eviction_takes_the_least_recently_used_entry_nobody_pins():
    index = TierIndex(capacity=3)
    _write(index, "w", 1, 2, 3)
    assert index.lookup("r", _keys(1)) == [0]  # 1 pinned, and the most recently used
    index.lookup("r", _keys(2), pin=False)  # 2 used after 1: 3 is the least recently used
    assert index.lease("w", 1) == [2]  # 3 went
    assert index.lease("w", 1) == [1]  # then 2, not the pinned 1
    assert index.lease("w", 1) == []  # 1 pinned, the others leased: no room
    index.release("r", [1])
    assert index.lease("w", 1) == [0]
    assert index.stats.evicted == 3


def test_a_holder_that_is_forgotten_leaves_no_pin_or_lease():
    index = TierIndex(capacity=2)
    _write(index, "w", 1)
    index.lookup("gone", _keys(1))
    index.lookup("gone", _keys(1))
    index.lease("gone", 1)
    assert (index.num_pinned, index.num_leased) == (1, 1)
    index.forget("gone")
    assert (index.num_pinned, index.num_leased) == (0, 0)
    assert index.lease("w", 2) == [1, 0]  # the freed lease, then 1 evicted


def test_the_block_manager_loads_what_the_tier_holds_and_saves_what_it_computes():
    bm = BlockManager(num_blocks=16, block_size=4)
    client = IndexTierClient(capacity=8)
    bm.tier = tier = TierConnector(bm, client)
    first = Sequence(list(range(10, 27)), SamplingParams())  # 17 tokens: 4 full blocks
    bm.allocate(first)
    meta = tier.build_connector_meta()
    assert meta.loads == [] and meta.saves == list(zip(first.block_table[:4], [0, 1, 2, 3]))
    assert all(bm.blocks[b].ref_count == 2 for b, _ in meta.saves)  # kept until the step is done
    tier.update_connector_output(meta, 0.0)  # the store commits them, the references go
    assert len(client.index) == 4 and all(bm.blocks[b].ref_count == 1 for b in first.block_table)
    bm.free(first)
    bm.set_prefix_caching(False)  # forget this instance's own cache: only the tier holds the prefix
    bm.set_prefix_caching(True)
    second = Sequence(list(range(10, 23)) + [99, 98], SamplingParams())  # 3 blocks shared, a 4th not full
    bm.allocate(second)
    meta = tier.build_connector_meta()
    assert meta.loads == list(zip(second.block_table[:3], [0, 1, 2]))
    assert second.num_computed_tokens == second.num_cached_tokens == 12 and bm.tier_hit_tokens == 12
    assert meta.saves == []  # nothing full is computed here
    assert client.index.num_pinned == 3  # until the step that reads them is done
    tier.update_connector_output(meta, 0.0)
    assert client.index.num_pinned == 0 and tier.build_connector_meta() is None
    bm.free(second)
    assert bm.num_free_blocks == bm.num_blocks


def _engines(names, block_size=8, dtype="float32"):
    """Engines of tiny-llama in this process, each with a tier client of the store it is given."""
    from distserve.engine.llm_engine import LLMEngine

    config = EngineConfig.from_flat(model="tiny-llama", block_size=block_size, num_kv_blocks=64, dtype=dtype)
    return {name: LLMEngine(config, name=name) for name in names}


def _geometry(block_size=8, dtype=torch.float32):
    from distserve.kv_transfer.plan import KVCacheShape
    from distserve.model_executor.model_loader import resolve_model

    shape = resolve_model(EngineConfig.from_flat(model="tiny-llama").model).shape
    return KVCacheShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, block_size, dtype)


def _greedy_with_logprobs(engine, prompt, max_tokens) -> tuple[list[int], list[float]]:
    """One request's greedy tokens on ``engine``, and the logprob of each."""
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0), request_id="r")
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
            logprobs += [lp.logprob for lp in delta.logprobs]
    return tokens, logprobs


def _greedy(engine, prompt, max_tokens):
    return _greedy_with_logprobs(engine, prompt, max_tokens)[0]


def _stores_idle(ray, stores):
    infos = ray.get([store.info.remote() for store in stores])
    return all(i.num_pinned == 0 for i in infos)


def test_blocks_one_engine_saves_another_reads_greedy_equal(ray_cluster, reference_model):
    """Engine a computes a prompt and saves its blocks (and the one its decoding fills) to the
    store; engine b, whose own cache is empty, prefills a longer prompt from them; both outputs are
    transformers' greedy tokens, and neither engine nor the store holds anything afterwards. When
    the store dies, b serves on without it."""
    from distserve.kv_tier.client import TierClient
    from distserve.kv_tier.store import start_tier_stores

    llama = reference_model("tiny-llama")
    stores = start_tier_stores("tier-test", _geometry(), num_blocks=32)
    try:
        store = next(iter(stores.values()))
        engines = _engines(["a", "b"])
        for name, engine in engines.items():
            engine.attach_tier(TierClient(store, name))
        prompt = random_prompts([50], 1024, seed=1)[0]
        first = _greedy(engines["a"], prompt, 10)
        assert first == reference_greedy(llama, prompt, 10)
        assert engines["a"].tier.saved_blocks == 7  # 6 of the prompt, 1 filled while decoding
        second = prompt + first + random_prompts([5], 1024, seed=2)[0]
        assert _greedy(engines["b"], second, 10) == reference_greedy(llama, second, 10)
        assert engines["b"].block_manager.tier_hit_tokens == 56 and engines["b"].tier.loaded_blocks == 7
        for engine in engines.values():
            assert_engine_idle(engine)
            assert engine.stats.totals["tier"] > 0  # the copies' phase of the steps
        assert _stores_idle(ray_cluster, stores.values())
        ray_cluster.kill(store)  # a cache: the engines go on without it
        third = random_prompts([30], 1024, seed=3)[0]
        assert _greedy(engines["b"], third, 5) == reference_greedy(llama, third, 5)
        assert engines["b"].tier.broken
        assert_engine_idle(engines["b"])
    finally:
        for store in stores.values():
            ray_cluster.kill(store)


def test_a_bfloat16_prefix_from_the_tier_continues_as_from_an_engine_s_own_cache(ray_cluster):
    """bfloat16 blocks through a bfloat16 store: engine a computes a prompt and saves its blocks,
    engine b prefills a longer prompt from them; engine c, with no tier, computes the same prompt
    as a did and prefills the longer one from its own prefix cache. b and c run the same
    computation over what should be the same KV: equal tokens and bit-equal logprobs, which a block
    that lost or changed a bit on its way through the store would not give."""
    from distserve.kv_tier.client import TierClient
    from distserve.kv_tier.store import start_tier_stores

    stores = start_tier_stores("tier-bf16", _geometry(dtype=torch.bfloat16), num_blocks=32)
    try:
        store = next(iter(stores.values()))
        engines = _engines(["a", "b", "c"], dtype="bfloat16")
        for name in ("a", "b"):
            engines[name].attach_tier(TierClient(store, name))
        prompt = random_prompts([50], 1024, seed=1)[0]
        first = _greedy(engines["a"], prompt, 10)
        assert _greedy(engines["c"], prompt, 10) == first
        second = prompt + first + random_prompts([5], 1024, seed=2)[0]
        assert _greedy_with_logprobs(engines["b"], second, 10) == _greedy_with_logprobs(engines["c"], second, 10)
        assert engines["b"].block_manager.tier_hit_tokens == 56 and engines["b"].tier.loaded_blocks == 7
        assert engines["c"].block_manager.prefix_cache_hit_tokens == 56
        for engine in engines.values():
            assert_engine_idle(engine)
        assert _stores_idle(ray_cluster, stores.values())
    finally:
        for store in stores.values():
            ray_cluster.kill(store)


async def _final(cluster, prompt, max_tokens):
    async for output in cluster.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        last = output
    return last


def _check_reported(infos, stores) -> None:
    """What the instances and the stores count reaches /metrics and ``distserve status``."""
    from distserve.entrypoints.grpc_server import instance_to_proto, tier_to_proto
    from distserve.entrypoints.prometheus import ServingMetrics

    metrics = ServingMetrics()
    metrics.update_instances(infos, 0, [], {}, stores)
    text = metrics.render().decode()
    for info in infos:
        assert f'distserve_instance_tier_hit_tokens{{instance="{info.name}",role="{info.role}"}} ' \
               f"{float(info.tier_hit_tokens)}" in text  # fmt: skip
        assert instance_to_proto(info).cached_prompt_tokens == info.cached_prompt_tokens
    for store in stores:
        assert f'distserve_kv_tier_hit_blocks{{node="{store.node_id}"}} {float(store.hit_blocks)}' in text
        assert tier_to_proto(store).entries == store.num_entries > 0


def test_a_conversation_turn_reads_its_history_from_the_tier(ray_cluster, reference_model):
    """2 prefill + 1 decode with the tier. A second turn re-sends the first's prompt and answer: the
    answer's KV was computed on the decode instance, and the prefill instance reads it (and the
    prompt, wherever it was prefilled) from the tier. Greedy-equal; nothing in use afterwards."""
    llama = reference_model("tiny-llama")
    first = random_prompts([40], 1024, seed=4)[0]
    max_tokens = 25

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=128, kv_tier_space=0.01,
                                           prefill={"instances": 2}, dtype="float32")  # fmt: skip
        try:
            turn1 = await _final(cluster, first, max_tokens)
            assert turn1.output_token_ids == reference_greedy(llama, first, max_tokens)
            second = first + turn1.output_token_ids + random_prompts([7], 1024, seed=5)[0]  # 72 tokens
            turn2 = await _final(cluster, second, max_tokens)
            assert turn2.output_token_ids == reference_greedy(llama, second, max_tokens)
            infos = await cluster.info()
            tier_hits = sum(i.tier_hit_tokens for i in infos)
            # The tier holds all 64 tokens for either instance, so routing ties: the answer's first 24
            # tokens come from the tier, and the prompt's too where turn 2 went elsewhere.
            assert turn2.num_cached_tokens == 64 and tier_hits in (24, 64)
            assert sum(i.tier_saved_blocks for i in infos) >= 8
            stores = await cluster.tier_info()
            assert sum(store.hit_blocks for store in stores) == tier_hits // 8
            _check_reported(infos, stores)
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_a_conversation_turn_goes_where_its_history_is(ray_cluster, reference_model):
    """2 prefill + 1 decode, no tier: routing alone finds a prompt's cached prefix. Two conversations'
    first turns, sent together, are prefilled on different instances (the second goes where fewer
    prompt tokens wait). Each second turn (its first turn's prompt, answer and more), sent when both
    instances are idle, goes to the instance that prefilled its first turn and reads the 40 prompt
    tokens from its prefix cache. A router that ignored the prefix would send both second turns to
    the same idle instance, and the other conversation's would read nothing."""
    llama = reference_model("tiny-llama")
    firsts = random_prompts([40, 40], 1024, seed=8)
    max_tokens = 8

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=128,
                                           prefill={"instances": 2}, dtype="float32")  # fmt: skip
        try:
            turns1 = await asyncio.gather(*(_final(cluster, prompt, max_tokens) for prompt in firsts))
            where = [turn1.metrics.prefill_instance for turn1 in turns1]
            assert len(set(where)) == 2, f"both first turns were prefilled on {where[0]}"
            for first, turn1, instance, seed in zip(firsts, turns1, where, (9, 10)):
                assert turn1.num_cached_tokens == 0
                second = first + turn1.output_token_ids + random_prompts([7], 1024, seed=seed)[0]  # 55 tokens
                turn2 = await _final(cluster, second, max_tokens)
                assert turn2.output_token_ids == reference_greedy(llama, second, max_tokens)
                assert (turn2.metrics.prefill_instance, turn2.num_cached_tokens) == (instance, 40)
            infos = await cluster.info()
            assert sum(i.tier_hit_tokens for i in infos) == 0 and not await cluster.tier_info()
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_a_replaced_prefill_instance_starts_warm_from_the_tier(ray_cluster, reference_model):
    """1P+1D with a tier: the prefill instance is killed after a conversation's first turn; its
    replacement, whose own cache is empty, prefills the second turn from the blocks the dead
    instance and the decode instance saved. Greedy-equal; no pin is left in the store."""
    import ray

    llama = reference_model("tiny-llama")
    first = random_prompts([48], 1024, seed=6)[0]

    async def scenario():
        cluster = await AsyncCluster.start(
            model="tiny-llama", block_size=8, num_kv_blocks=128, kv_tier_space=0.01, dtype="float32"
        )
        try:
            turn1 = await _final(cluster, first, 20)
            prefill = next(s for s in cluster.orchestrator.instances if s.role == "prefill")
            ray.kill(prefill.handle)
            deadline = asyncio.get_running_loop().time() + 60
            while not any(s.name.endswith("prefill-r1") for s in cluster.orchestrator.instances):
                assert asyncio.get_running_loop().time() < deadline, "no replacement"
                await asyncio.sleep(0.05)
            second = first + turn1.output_token_ids + random_prompts([5], 1024, seed=7)[0]
            turn2 = await _final(cluster, second, 20)
            assert turn2.output_token_ids == reference_greedy(llama, second, 20)
            replacement = next(i for i in await cluster.info() if i.name.endswith("prefill-r1"))
            # The prompt's blocks and the answer's full ones: all of it but its last token has KV.
            computed = len(first) + len(turn1.output_token_ids) - 1
            assert turn2.num_cached_tokens == replacement.tier_hit_tokens == computed // 8 * 8 > len(first)
            await wait_nothing_in_use_async(cluster)
            assert all(store.num_pinned == 0 for store in await cluster.tier_info())
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_a_block_saved_on_one_node_is_read_on_another(ray_nodes, reference_model):
    """Two engines attached to the stores of two different nodes: b's store misses, copies the run
    from a's store through Ray's object store, and b's output is greedy-equal. (Last in this
    module: its cluster of three nodes stays up to the module's end.)"""
    import ray

    from distserve.kv_tier.client import TierClient
    from distserve.kv_tier.store import start_tier_stores

    llama = reference_model("tiny-llama")
    stores = start_tier_stores("tier-nodes", _geometry(), num_blocks=32)
    try:
        assert len(stores) == 3
        store_a, store_b, _ = stores.values()
        engines = _engines(["a", "b"])
        engines["a"].attach_tier(TierClient(store_a, "a"))
        engines["b"].attach_tier(TierClient(store_b, "b"))
        prompt = random_prompts([41], 1024, seed=3)[0]
        assert _greedy(engines["a"], prompt, 4) == reference_greedy(llama, prompt, 4)
        assert _greedy(engines["b"], prompt, 4) == reference_greedy(llama, prompt, 4)
        assert engines["b"].block_manager.tier_hit_tokens == 40
        info_b = ray.get(store_b.info.remote())
        assert info_b.remote_hit_blocks == 5 and info_b.num_entries == 5
        assert _stores_idle(ray, stores.values())
    finally:
        for store in stores.values():
            ray.kill(store)
