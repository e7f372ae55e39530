"""KV transfer peers: exact transfers through fixed staging buffers, and nothing kept of a peer
once it is gone, in process and across a cluster whose prefill instance is replaced again and again."""

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from conftest import random_prompts, reference_greedy

from distserve import AsyncCluster, SamplingParams
from distserve.core.config import CacheConfig
from distserve.kv_transfer.channel import KVTransfer
from distserve.kv_transfer.plan import KVCacheShape, KVLayout, plan_transfer, rank_layout, transfer_rounds
from distserve.kv_transfer.shared_memory import shared_zeros
from distserve.kv_transfer.transport import KVTransport, part
from distserve.kv_transfer.transports import TRANSPORTS
from distserve.kv_transfer.transports.group import message_spans, message_tokens, staging_bytes
from distserve.model_executor import kv_cache
from distserve.model_executor.kv_cache import determine_num_blocks
from distserve.parallel.ranks import ParallelRank

LAYERS, HEADS, DIM, SLOTS = 2, 2, 8, 64


def _both(*calls: tuple) -> list:
    """Run two calls ``(function, *args)`` that need each other (the two ends of a communicator)
    at the same time; their results."""
    results, errors = [None] * len(calls), []

    def run(i, function, *args):
        try:
            results[i] = function(*args)
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, *call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def _end(seed: int | None, chunk_tokens: int, shared: bool = False, dtype: torch.dtype = torch.float32) -> KVTransfer:
    """A rank's end: its cache zeros or drawn from ``seed``, in shared memory if ``shared``."""
    shape = (LAYERS, 2, SLOTS, HEADS, DIM)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    if seed is None:
        tensor = torch.zeros(shape, dtype=dtype)
    elif dtype == torch.int8:  # an 8-bit cache's codes and scale bytes: any byte
        tensor = torch.randint(-128, 128, shape, generator=generator, dtype=dtype)
    else:
        tensor = torch.randn(shape, generator=generator).to(dtype)
    file = None
    if shared:
        drawn, (tensor, file) = tensor, shared_zeros(shape, tensor.dtype)
        tensor.copy_(drawn)
    return KVTransfer(tensor, KVLayout(range(LAYERS), range(HEADS)), chunk_tokens, shared=file)


def test_a_peer_replaced_again_and_again_leaves_no_channel_or_buffer_behind():
    decode = _end(None, chunk_tokens=16)  # messages of at most 16 tokens: runs alone and a packed one
    src_slots, dst_slots = list(range(20, 33)), [3, 9, 10, 11, 40, 41, 42, 43, 50, 51, 52, 60, 61]
    staging = []
    for round in range(5):
        prefill, channel = _end(round, chunk_tokens=16), f"prefill-r{round}.0>decode.0"
        address = prefill.store_address()
        _both((prefill.connect, channel, True, address), (decode.connect, channel, False, address))
        sent, received = _both(
            (prefill.send, channel, src_slots, range(LAYERS), range(HEADS), dst_slots),
            (decode.recv, channel, dst_slots, range(LAYERS), range(HEADS), src_slots),
        )
        assert sent.num_bytes == received.num_bytes == LAYERS * 2 * len(src_slots) * HEADS * DIM * 4
        assert sent.digest == received.digest != ""  # checked: a group's pulls are by default
        assert torch.equal(decode.kv_tensor[:, :, dst_slots], prefill.kv_tensor[:, :, src_slots])
        assert decode.peers()["channels"] == [channel]
        assert decode.drop_peer(f"prefill-r{round}") == [channel]  # the prefill instance is gone
        assert prefill.drop_peer("decode") == [channel]  # (or the decode instance is)
        assert decode.peers()["channels"] == [] and prefill.peers()["channels"] == []
        staging.append(decode.peers()["staging_bytes"])
    assert staging == [staging_bytes(HEADS, DIM, torch.float32, chunk_tokens=16)] * 5  # fixed, not per peer


def test_messages_send_long_runs_alone_and_pack_short_ones():
    """Both ends cut the same messages: runs of slots consecutive on both sides of at least an
    eighth of a message go alone (cut at the message size), shorter ones are packed a message at
    a time."""
    src = [*range(100, 112), 7, 9, 11, *range(40, 44)]  # one run of 12, three of 1, one of 4 ...
    dst = [*range(0, 12), 20, 21, 22, *range(60, 64)]  # ... and 20-22 consecutive here only
    assert message_spans(src, dst, 5) == [(0, 5, True), (5, 10, True), (10, 12, True)] + [
        (12, 13, True),
        (13, 14, True),
        (14, 15, True),
        (15, 19, True),
    ]
    assert message_spans(src, dst, 16) == [(0, 12, True), (12, 15, False), (15, 19, True)]  # 1 < 16 / 8
    assert message_spans(src, dst, 40) == [(0, 12, True), (12, 19, False)]  # 4 < 40 / 8: packed too
    blocks = [b * 16 + i for b in (3, 1, 4, 1, 5, 9, 2, 6) for i in range(16)]  # blocks of 16, none adjacent
    assert message_spans(blocks, list(range(128)), 100) == [(b, b + 16, True) for b in range(0, 128, 16)]
    assert message_spans(blocks, list(range(128)), 256) == [(0, 128, False)]
    assert message_spans(blocks, list(range(128)), 64) == [(b, b + 16, True) for b in range(0, 128, 16)]
    assert message_spans(blocks, list(range(128)), 160) == [(0, 128, False)]  # 16 < 160 / 8
    assert message_spans([], [], 64) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_a_source_in_shared_memory_is_read_in_place_in_its_own_process(dtype):
    """Source and destination in one process (as the local path of CUDA IPC): the destination
    takes the source's tensor itself, with no staging buffers; a plain source is read over gloo.
    Every value arrives bit for bit, float32, bfloat16 or an 8-bit cache's bytes."""
    decode = _end(None, chunk_tokens=16, dtype=dtype)
    src_slots, dst_slots = [7, 8, 9, 30], [1, 2, 40, 41]  # a run of 2, then two runs of 1 packed
    for shared, transport in ((True, "shm"), (False, "gloo")):
        prefill, channel = _end(3, chunk_tokens=16, shared=shared, dtype=dtype), f"prefill-{transport}.0>decode.0"
        address = prefill.store_address()
        _both((prefill.connect, channel, True, address), (decode.connect, channel, False, address))
        assert prefill.transport(channel) == decode.transport(channel) == transport
        _both(
            (prefill.send, channel, src_slots, range(LAYERS), range(HEADS), dst_slots),
            (decode.recv, channel, dst_slots, range(LAYERS), range(HEADS), src_slots),
        )
        assert torch.equal(decode.kv_tensor[:, :, dst_slots], prefill.kv_tensor[:, :, src_slots])
        assert decode.peers()["staging_bytes"] == (0 if shared else staging_bytes(HEADS, DIM, dtype, 16))


@dataclass
class _StoreLink:
    store: object
    transfers: int = 0  # both ends count the transfers on the channel alike: the key of the next


class _StoreTransport(KVTransport[_StoreLink]):
    """A transport as a new one (NIXL, Mooncake) is written: a subclass and an entry in TRANSPORTS.
    Its KV goes as one value in the channel's store; it declines channels to "far" instances, which
    both ends see alike, so they agree without a word."""

    name = "store"
    closed: list[_StoreLink] = []

    def connect(self, channel, is_source, store):
        return None if "far" in channel else _StoreLink(store)

    def send(self, link, slots, layers, heads, dst_slots):
        data = part(self.kv.tensor, self.kv.layout, layers, heads)[:, :, slots].contiguous()
        link.store.set(f"kv/{link.transfers}", data.view(torch.uint8).numpy().tobytes())
        link.transfers += 1
        return data.numel() * data.element_size()

    def recv(self, link, slots, layers, heads, src_slots):
        raw = link.store.get(f"kv/{link.transfers}")
        link.transfers += 1
        view = part(self.kv.tensor, self.kv.layout, layers, heads)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(view.dtype)
        view[:, :, slots] = data.view(len(layers), 2, len(slots), len(heads), view.shape[4])
        return len(raw)

    def probe(self, link, buffer, send, message_bytes):
        raise NotImplementedError

    def close(self, link):
        self.closed.append(link)


def test_a_transport_registered_first_serves_the_channels_it_connects_and_the_next_one_the_rest(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "cpu", (_StoreTransport, *TRANSPORTS["cpu"]))
    monkeypatch.setattr(_StoreTransport, "closed", [])
    decode = _end(None, chunk_tokens=16)
    src_slots, dst_slots = [7, 8, 9, 30, 31], [1, 2, 40, 41, 50]
    for name, transport in (("near", "store"), ("far", "gloo")):
        prefill, channel = _end(5, chunk_tokens=16), f"prefill-{name}.0>decode.0"
        address = prefill.store_address()
        _both((prefill.connect, channel, True, address), (decode.connect, channel, False, address))
        assert prefill.transport(channel) == decode.transport(channel) == transport
        heads = range(1, HEADS)  # a part of the heads, as tensor-parallel degrees that differ move
        for _ in range(2):  # a second transfer on the channel too
            sent, received = _both(
                (prefill.send, channel, src_slots, range(LAYERS), heads, dst_slots),
                (decode.recv, channel, dst_slots, range(LAYERS), heads, src_slots),
            )
            assert sent.num_bytes == received.num_bytes == LAYERS * 2 * len(src_slots) * len(heads) * DIM * 4
            assert sent.digest == received.digest != ""  # not in place: checked by default
        assert torch.equal(decode.kv_tensor[:, :, dst_slots, 1:], prefill.kv_tensor[:, :, src_slots, 1:])
        assert not decode.kv_tensor[:, :, :, 0].any()  # the heads not moved stay as they were
        decode.kv_tensor.zero_()
        assert decode.drop_peer(f"prefill-{name}") == [channel]
    assert [link.transfers for link in _StoreTransport.closed] == [2]  # the store's link, closed when dropped


def test_transfer_rounds_never_ask_a_rank_for_two_parts_at_once():
    """PP=2 prefill to TP=2 decode: every prefill rank sends to both decode ranks. Asked all at once,
    each rank serving one transfer at a time can wait in a cycle (source 0 sends to decode 1, which
    receives from source 1, which sends to decode 0, which waits for source 0); in rounds it cannot."""

    def layouts(tp: int, pp: int) -> list[KVLayout]:
        return [rank_layout(4, 4, ParallelRank(tp_size=tp, pp_size=pp, rank=r)) for r in range(tp * pp)]

    plan = plan_transfer(layouts(1, 2), layouts(2, 1))
    rounds = transfer_rounds(plan)
    assert sorted((p.src, p.dst) for r in rounds for p in r) == sorted((p.src, p.dst) for p in plan)
    assert len(plan) == 4 and len(rounds) == 2
    for round_ in rounds:
        assert len({p.src for p in round_}) == len({p.dst for p in round_}) == len(round_)
    same = plan_transfer(layouts(2, 1), layouts(2, 1))  # matching layouts: one round, both pairs together
    assert transfer_rounds(same) == [same]


def test_the_kv_cache_budget_sets_the_staging_buffers_aside(monkeypatch):
    shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    staging = staging_bytes(2, 16, torch.float32, message_tokens(2, 16, torch.float32, "cuda"))
    assert staging == 2 * 4096 * 2 * 16 * 4  # two messages of 4,096 tokens of one layer's K or V
    config, gpu = CacheConfig(kv_cache_memory_fraction=1.0), torch.device("cuda")
    # Free memory for exactly 100 blocks and the staging buffers: 100 blocks; a byte less: 99.
    free = 100 * shape.bytes_per_block + staging
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda device: free)
    assert determine_num_blocks(config, shape, gpu, 10**9) == 100
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda device: free - 1)
    assert determine_num_blocks(config, shape, gpu, 10**9) == 99


@pytest.mark.slow  # test_faults replaces a prefill instance once; this repeats it, checking the peers each time
def test_live_instances_keep_only_live_peers_when_prefill_is_replaced_repeatedly(ray_cluster, reference_model):
    """The prefill instance is killed three times, each after serving through its replacement: the
    decode instance's ranks and migrator then know only the live prefill instance, and the prefill
    side keeps no channel of a dead decode instance."""
    llama = reference_model("tiny-llama")
    prompt = random_prompts([40], llama.config.vocab_size, seed=31)[0]
    expected = reference_greedy(llama, prompt, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def generate(cluster) -> list[int]:
        async for output in cluster.generate(prompt, params):
            last = output
        return last.output_token_ids

    async def until(condition, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not await condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=64, dtype="float32")
        orchestrator = cluster.orchestrator
        try:
            for kill in range(1, 4):
                assert await generate(cluster) == expected
                prefill = next(s for s in orchestrator.pool("prefill"))
                ray_cluster.kill(prefill.handle)

                async def replaced(kill=kill):
                    return any(s.name.endswith(f"prefill-r{kill}") for s in orchestrator.pool("prefill"))

                await until(replaced)
                decode = orchestrator.pool("decode")[0]

                async def forgotten(dead=prefill.name, decode=decode):
                    peers = await decode.handle.kv_peers.remote()
                    return dead not in peers["sources"] and not any(
                        dead in channel for rank in peers["ranks"] for channel in rank["channels"]
                    )

                await until(forgotten, timeout=10)
            assert await generate(cluster) == expected
            live = orchestrator.pool("prefill")[0]
            decode_peers = await orchestrator.pool("decode")[0].handle.kv_peers.remote()
            assert list(decode_peers["sources"]) == [live.name]
            assert all(channel.startswith(f"{live.name}.") for r in decode_peers["ranks"] for channel in r["channels"])

            # And the other way: the decode instance dies; the live prefill instance drops its channels.
            dead_decode = orchestrator.pool("decode")[0]
            ray_cluster.kill(dead_decode.handle)

            async def prefill_forgot():
                peers = await live.handle.kv_peers.remote()
                return not any(dead_decode.name in c for rank in peers["ranks"] for c in rank["channels"])

            await until(prefill_forgot, timeout=10)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())
