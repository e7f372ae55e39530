"""KV pulled over CUDA IPC between two processes on one GPU, as a decode instance pulls from a
prefill instance sharing its GPU (where NCCL refuses the pair). Skipped without a GPU."""

import queue
import time
import traceback
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import pytest
import torch
import torch.multiprocessing as mp

from distserve.kv_transfer.channel import KVTransfer
from distserve.kv_transfer.plan import KVLayout, plan_transfer, rank_layout, token_slots
from distserve.parallel.ranks import ParallelRank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHANNEL = "prefill.0>decode.0"
HEAD_DIM, SLOTS, CHUNK = 16, 64, 5  # chunks of 5 tokens: 19 tokens go in 4 chunks a layer
# 4 layers, 4 KV heads: the prefill rank is pipeline stage 1 of 2 (layers 2-3, every head), the
# decode rank tensor parallel rank 1 of 2 (every layer, heads 2-3): it pulls layers 2-3 x heads 2-3,
# and each side indexes its own cache from a different first layer and head.
SOURCE = rank_layout(4, 4, ParallelRank(tp_size=1, pp_size=2, rank=1))
DESTINATION = rank_layout(4, 4, ParallelRank(tp_size=2, pp_size=1, rank=1))
SRC_SLOTS = token_slots([5, 1, 6], 19, block_size=8)  # 19 tokens in prefill blocks of 8 ...
DST_SLOTS = token_slots([9, 2, 7, 3, 11], 19, block_size=4)  # ... and in decode blocks of 4
TIMEOUT = 150  # seconds for both processes to answer (spawning and CUDA start take a few), under pytest's 300


def _cache(layout: KVLayout, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A rank's cache ``[layers, 2, SLOTS, heads, HEAD_DIM]``, drawn on CPU so that every process
    draws the same one."""
    shape = (len(layout.layers), 2, SLOTS, len(layout.kv_heads), HEAD_DIM)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _part():
    (part,) = plan_transfer([SOURCE], [DESTINATION])
    return part


def _source(dtype: torch.dtype, addresses: Queue, results: Queue, done: Event) -> None:
    """The prefill rank: hosts the store, connects, sends, and keeps its cache until the test is done
    (the destination reads it in place)."""
    try:
        transfer = KVTransfer(_cache(SOURCE, dtype, seed=1).to("cuda:0"), SOURCE, chunk_tokens=CHUNK)
        address = transfer.store_address()
        addresses.put(address)
        transfer.connect(CHANNEL, True, address)
        part = _part()
        sent = transfer.send(CHANNEL, SRC_SLOTS, part.layers, part.kv_heads)
        results.put({"role": "source", "transport": transfer.transport(CHANNEL), "bytes": sent})
        done.wait(TIMEOUT)
    except BaseException:
        results.put({"role": "source", "error": traceback.format_exc()})


def _destination(dtype: torch.dtype, addresses: Queue, results: Queue) -> None:
    """The decode rank: connects, pulls, and reports its whole cache and what it held after
    dropping the prefill instance."""
    try:
        transfer = KVTransfer(_cache(DESTINATION, dtype, seed=2).to("cuda:0"), DESTINATION, chunk_tokens=CHUNK)
        transfer.connect(CHANNEL, False, addresses.get(timeout=TIMEOUT))
        part = _part()
        received = transfer.recv(CHANNEL, DST_SLOTS, part.layers, part.kv_heads, SRC_SLOTS)
        result = {
            "role": "destination",
            "transport": transfer.transport(CHANNEL),
            "bytes": received,
            "cache": transfer.kv_tensor.cpu().float().numpy(),  # exact for bfloat16; a plain array crosses safely
            "staging_bytes": transfer.peers()["staging_bytes"],
        }
        result["dropped"] = transfer.drop_peer("prefill")
        result["channels"] = transfer.peers()["channels"]
        results.put(result)
    except BaseException:
        results.put({"role": "destination", "error": traceback.format_exc()})


def _expected(dtype: torch.dtype) -> torch.Tensor:
    """The destination's cache after the pull, slot by slot: the source's K and V of the part's
    layers and heads in the destination's slots, everything else as it was."""
    part, source, expected = _part(), _cache(SOURCE, dtype, seed=1), _cache(DESTINATION, dtype, seed=2)
    src_heads = slice(part.kv_heads.start - SOURCE.kv_heads.start, part.kv_heads.stop - SOURCE.kv_heads.start)
    dst_heads = slice(part.kv_heads.start - DESTINATION.kv_heads.start, part.kv_heads.stop - DESTINATION.kv_heads.start)
    for layer in part.layers:
        for src_slot, dst_slot in zip(SRC_SLOTS, DST_SLOTS):
            src = source[layer - SOURCE.layers.start, :, src_slot, src_heads]
            expected[layer - DESTINATION.layers.start, :, dst_slot, dst_heads] = src
    return expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_processes_on_one_gpu_move_kv_over_cuda_ipc(dtype):
    part = _part()
    assert (part.layers, part.kv_heads) == (range(2, 4), range(2, 4))  # offsets on both sides
    ctx = mp.get_context("spawn")
    addresses, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    processes = [
        ctx.Process(target=_source, args=(dtype, addresses, results, done), daemon=True),
        ctx.Process(target=_destination, args=(dtype, addresses, results), daemon=True),
    ]
    for p in processes:
        p.start()
    answers, deadline = {}, time.monotonic() + TIMEOUT
    try:
        for _ in processes:
            try:
                answer = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no answer within {TIMEOUT} s from {sorted({'source', 'destination'} - set(answers))}")
            assert "error" not in answer, f"{answer['role']} failed:\n{answer.get('error')}"
            answers[answer["role"]] = answer
    finally:
        done.set()
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    source, destination = answers["source"], answers["destination"]
    assert source["transport"] == destination["transport"] == "ipc"
    element = torch.empty((), dtype=dtype).element_size()
    num_bytes = len(part.layers) * 2 * len(SRC_SLOTS) * len(part.kv_heads) * HEAD_DIM * element
    assert source["bytes"] == destination["bytes"] == num_bytes
    cache = torch.from_numpy(destination["cache"]).to(dtype)
    assert torch.equal(cache, _expected(dtype))  # the pulled slots, and every other slot unchanged
    assert not torch.equal(cache, _cache(DESTINATION, dtype, seed=2))  # (it did pull something)
    assert destination["staging_bytes"] == 0  # IPC needs no staging buffers
    assert destination["dropped"] == [CHANNEL] and destination["channels"] == []
