"""Every KV pull is checked: a byte changed on the way is caught by the digests of the two ends, the
pull fails, the request runs again from its prompt and ends equal to transformers, and the mismatch
is counted; the digest itself changes with any byte, slot, layer or K/V side."""

import asyncio

import pytest
import torch
from conftest import random_prompts, reference_greedy, wait_nothing_in_use_async

from distserve import AsyncCluster, SamplingParams
from distserve.kv_transfer.checksum import kv_digest, slot_runs

MAX_TOKENS = 24


def test_slot_runs_cut_where_slots_stop_being_consecutive():
    assert slot_runs([]) == []
    assert slot_runs([5, 6, 7, 20, 21, 3]) == [(5, 3), (20, 2), (3, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])  # int8: an 8-bit cache's codes
def test_the_digest_changes_with_any_byte_slot_layer_or_side(dtype):
    cache = torch.randn(3, 2, 64, 4, 8).to(dtype)
    slots = [*range(8, 24), 40, 41, 50]
    digest = kv_digest(cache, slots)
    assert digest == kv_digest(cache.clone(), slots)  # the same KV elsewhere: the same digest
    assert digest == kv_digest(cache, slots) and len(digest) == 32
    flipped = cache.clone()
    flipped[2, 1, 41, 3].view(torch.uint8)[-1:].bitwise_xor_(0x80)  # one bit of one value (its sign)
    assert kv_digest(flipped, slots) != digest
    swapped = cache.clone()
    swapped[:, :, [8, 9]] = cache[:, :, [9, 8]]  # two tokens' KV in each other's slots
    assert kv_digest(swapped, slots) != digest
    sides = cache.clone()
    sides[1, :, 50] = cache[1, [1, 0], 50]  # a token's K and V swapped in one layer
    assert kv_digest(sides, slots) != digest
    layers = cache.clone()
    layers[[0, 1], :, 40] = cache[[1, 0], :, 40]  # a token's KV of two layers swapped
    assert kv_digest(layers, slots) != digest
    outside = cache.clone()
    outside[:, :, 0] += 1  # a slot the transfer does not move
    assert kv_digest(outside, slots) == digest
    # A part of the heads, as a tensor-parallel transfer moves: only those heads count.
    heads = cache.clone()
    heads[:, :, slots, 3] += 1
    assert kv_digest(heads[:, :, :, :2], slots) == kv_digest(cache[:, :, :, :2], slots)


# In place (shared memory) a pull is checked when asked to; over gloo by default.
@pytest.mark.parametrize("transport,checksum", [("auto", "on"), ("group", "auto")])
def test_a_byte_flipped_in_transit_fails_the_pull_and_the_request_runs_again(
    ray_cluster, reference_model, transport, checksum
):
    # Defined here so that Ray pickles it by value: the instance's process cannot import this module.
    def _flip_a_byte_of_the_next_pull(instance) -> None:
        """Run in the decode instance's actor: the next KV its rank receives has one byte flipped after
        the transport wrote it and before the rank digests it, as a byte changed in transit would be."""
        transfer = instance.engine.executor.worker.kv_transfer
        moved = transfer._moved

        def flipped_once(slots, layers, heads, **how):
            transfer._moved = moved
            layer, head = layers.start - transfer.layout.layers.start, heads.start - transfer.layout.kv_heads.start
            value = transfer.kv_tensor[layer, 1, slots[-1], head]
            value.view(torch.uint8)[:1].bitwise_xor_(1)
            return moved(slots, layers, heads, **how)

        transfer._moved = flipped_once

    model = reference_model("tiny-llama")
    prompts = random_prompts([40, 23], model.config.vocab_size, seed=7)
    expected = [reference_greedy(model, p, MAX_TOKENS) for p in prompts]

    async def scenario():
        cluster = await AsyncCluster.start(
            model="tiny-llama",
            block_size=8,
            num_kv_blocks=200,
            dtype="float32",
            kv_transport=transport,
            kv_transfer_checksum=checksum,
        )
        try:
            decode = next(s for s in cluster.orchestrator.instances if s.role == "decode")
            await decode.handle.__ray_call__.remote(_flip_a_byte_of_the_next_pull)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
            outputs = []
            for prompt in prompts:  # one at a time: the first pull is the corrupted one
                tokens = [o.output_token_ids async for o in cluster.generate(prompt, params)]
                outputs.append(tokens[-1])
            assert outputs == expected
            infos = {i.name: i for i in await cluster.info()}
            decode_info = infos[decode.name]
            assert decode_info.num_kv_checksum_mismatches == 1
            assert decode_info.num_kv_pulls == 2  # the failed pull is not one
            state_transport = {t.transport for t in decode_info.kv_pulls_from.values()}
            assert state_transport == ({"shm"} if transport == "auto" else {"gloo"})
            # The first request was prefilled twice: its KV came over again, not from the bad copy.
            prefill_info = next(i for i in infos.values() if i.role == "prefill")
            assert prefill_info.prompt_tokens == 2 * len(prompts[0]) + len(prompts[1])
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())
