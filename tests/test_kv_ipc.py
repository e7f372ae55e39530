"""KV read in place between two processes, as a decode instance pulls from a prefill instance on
the same machine: over CUDA IPC on one GPU (where NCCL refuses the pair; skipped without a GPU),
over shared memory between CPU processes. On CPU also: gloo wherever the source's cache cannot be
read in place, and a source killed while its cache is mapped."""

import dataclasses
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
from distserve.kv_transfer.shared_memory import shared_zeros
from distserve.parallel.ranks import ParallelRank

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)
CHANNEL = "prefill.0>decode.0"
HEAD_DIM, SLOTS, CHUNK = 16, 64, 5  # messages of at most 5 tokens: runs sent alone and runs packed
# 4 layers, 4 KV heads: the prefill rank is pipeline stage 1 of 2 (layers 2-3, every head), the
# decode rank tensor parallel rank 1 of 2 (every layer, heads 2-3): it pulls layers 2-3 x heads 2-3,
# and each side indexes its own cache from a different first layer and head.
SOURCE = rank_layout(4, 4, ParallelRank(tp_size=1, pp_size=2, rank=1))
DESTINATION = rank_layout(4, 4, ParallelRank(tp_size=2, pp_size=1, rank=1))
SRC_SLOTS = token_slots([5, 1, 6], 19, block_size=8)  # 19 tokens in prefill blocks of 8 ...
DST_SLOTS = token_slots([9, 2, 7, 3, 11], 19, block_size=4)  # ... and in decode blocks of 4
TIMEOUT = 150  # seconds for both processes to answer (spawning and CUDA start take a few), under pytest's 300
MEMORY_FILE = "memfd:distserve-kv"  # how a shared cache's mapping shows in /proc/<pid>/maps


def _cache(layout: KVLayout, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A rank's cache ``[layers, 2, SLOTS, heads, HEAD_DIM]``, drawn on CPU so that every process
    draws the same one."""
    shape = (len(layout.layers), 2, SLOTS, len(layout.kv_heads), HEAD_DIM)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _part():
    (part,) = plan_transfer([SOURCE], [DESTINATION])
    return part


def _mapped_caches() -> int:
    """The shared memory caches of other processes this one maps."""
    with open("/proc/self/maps") as maps:
        return sum(MEMORY_FILE in line for line in maps)


def _source(device: str, dtype: torch.dtype, publish: str, addresses: Queue, results: Queue, done: Event) -> None:
    """The prefill rank: hosts the store, connects, sends, and keeps its cache until the test is done
    (the destination may read it in place). ``publish`` (CPU): "shared" memory, a "plain" tensor
    (read over gloo only), or shared memory described by a "stale" file (one that is not its own)."""
    try:
        cache, shared = _cache(SOURCE, dtype, seed=1).to(device), None
        if device == "cpu" and publish != "plain":
            tensor, shared = shared_zeros(tuple(cache.shape), dtype)
            cache = tensor.copy_(cache)
            if publish == "stale":
                shared = dataclasses.replace(shared, inode=shared.inode + 1)
        transfer = KVTransfer(cache, SOURCE, chunk_tokens=CHUNK, shared=shared, checksum="on")
        address = transfer.store_address()
        addresses.put(address)
        transfer.connect(CHANNEL, True, address)
        part = _part()
        sent = transfer.send(CHANNEL, SRC_SLOTS, part.layers, part.kv_heads, DST_SLOTS)
        results.put({"transport": transfer.transport(CHANNEL), "bytes": sent.num_bytes, "digest": sent.digest})
        done.wait(TIMEOUT)
    except BaseException:
        results.put({"error": traceback.format_exc()})


def _destination(device: str, dtype: torch.dtype, in_place: bool, addresses: Queue, results: Queue, pull: Event):
    """The decode rank: connects, pulls once ``pull`` is set, and reports its whole cache and what
    it held (and mapped) before and after dropping the prefill instance."""
    try:
        cache = _cache(DESTINATION, dtype, seed=2).to(device)
        transfer = KVTransfer(cache, DESTINATION, chunk_tokens=CHUNK, in_place=in_place, checksum="on")
        transfer.connect(CHANNEL, False, addresses.get(timeout=TIMEOUT))
        part = _part()
        pull.wait(TIMEOUT)
        received = transfer.recv(CHANNEL, DST_SLOTS, part.layers, part.kv_heads, SRC_SLOTS)
        result = {
            "transport": transfer.transport(CHANNEL),
            "bytes": received.num_bytes,
            "digest": received.digest,
            "cache": transfer.kv_tensor.cpu().float().numpy(),  # exact for bfloat16; a plain array crosses safely
            "staging_bytes": transfer.peers()["staging_bytes"],
            "mapped": _mapped_caches(),
        }
        result["dropped"] = transfer.drop_peer("prefill")
        result["channels"] = transfer.peers()["channels"]
        result["mapped_after_drop"] = _mapped_caches()
        results.put(result)
    except BaseException:
        results.put({"error": traceback.format_exc()})


def _pull(device: str, dtype: torch.dtype, publish: str = "shared", in_place: bool = True, kill_source=False):
    """Run a source and a destination process through one pull; their answers. ``kill_source``:
    SIGKILL the source once it has sent (a pull in place needs nothing more of it), then pull."""
    ctx = mp.get_context("spawn")
    addresses, done, pull = ctx.Queue(), ctx.Event(), ctx.Event()
    # A queue of each: a process killed as it has just put may still hold its queue's lock.
    results = {"source": ctx.Queue(), "destination": ctx.Queue()}
    source_args = (device, dtype, publish, addresses, results["source"], done)
    destination_args = (device, dtype, in_place, addresses, results["destination"], pull)
    processes = {
        "source": ctx.Process(target=_source, args=source_args, daemon=True),
        "destination": ctx.Process(target=_destination, args=destination_args, daemon=True),
    }
    if not kill_source:
        pull.set()
    for p in processes.values():
        p.start()
    answers, deadline = {}, time.monotonic() + TIMEOUT
    try:
        for role, p in processes.items():
            try:
                answer = results[role].get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no answer within {TIMEOUT} s from the {role}")
            assert "error" not in answer, f"{role} failed:\n{answer.get('error')}"
            answers[role] = answer
            if kill_source and role == "source":
                p.kill()
                p.join(timeout=30)
                pull.set()
    finally:
        if processes["source"].is_alive():  # (set with a sleeper killed, an Event waits for it to wake)
            done.set()
        for p in processes.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return answers["source"], answers["destination"]


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


def _check_pulled(source: dict, destination: dict, dtype: torch.dtype, transport: str) -> None:
    """Both ends moved the part's bytes over ``transport`` and the destination holds exactly them."""
    part = _part()
    assert source["transport"] == destination["transport"] == transport
    element = torch.empty((), dtype=dtype).element_size()
    num_bytes = len(part.layers) * 2 * len(SRC_SLOTS) * len(part.kv_heads) * HEAD_DIM * element
    assert source["bytes"] == destination["bytes"] == num_bytes
    assert source["digest"] == destination["digest"] != ""  # the check a pull makes passes
    cache = torch.from_numpy(destination["cache"]).to(dtype)
    assert torch.equal(cache, _expected(dtype))  # the pulled slots, and every other slot unchanged
    assert not torch.equal(cache, _cache(DESTINATION, dtype, seed=2))  # (it did pull something)
    assert destination["dropped"] == [CHANNEL] and destination["channels"] == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", [CUDA, "cpu"])
def test_two_processes_on_one_machine_pull_kv_in_place(device, dtype):
    part = _part()
    assert (part.layers, part.kv_heads) == (range(2, 4), range(2, 4))  # offsets on both sides
    source, destination = _pull(device, dtype)
    _check_pulled(source, destination, dtype, "ipc" if device == "cuda" else "shm")
    assert destination["staging_bytes"] == 0  # in place needs no staging buffers
    if device == "cpu":  # the source's cache was mapped here until the prefill instance was dropped
        assert (destination["mapped"], destination["mapped_after_drop"]) == (1, 0)


@pytest.mark.parametrize(
    "publish, in_place",
    [("shared", False), ("plain", True), ("stale", True)],
    ids=["destination-reads-over-a-group-only", "source-not-in-shared-memory", "source-file-does-not-open"],
)
def test_kv_goes_over_gloo_where_the_source_cannot_be_read_in_place(publish, in_place):
    source, destination = _pull("cpu", torch.float32, publish, in_place)
    _check_pulled(source, destination, torch.float32, "gloo")
    # The slots come in runs of 3-4 tokens consecutive on both sides: all of the destination's heads
    # go straight into its cache (the source, sending half its heads, stages them).
    assert destination["staging_bytes"] == 0 and destination["mapped"] == 0


def test_a_killed_source_s_cache_stays_readable_until_its_channel_is_dropped():
    """The source is SIGKILLed after the hand-shake: the destination's mapping keeps the memory, so
    the pull still reads it whole; dropping the dead instance unmaps it (and with it the last of
    the source's memory: the file has no name to leave behind)."""
    source, destination = _pull("cpu", torch.float32, kill_source=True)
    _check_pulled(source, destination, torch.float32, "shm")
    assert (destination["mapped"], destination["mapped_after_drop"]) == (1, 0)
