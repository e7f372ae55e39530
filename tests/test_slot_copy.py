"""The slot copy of KV pulls in place, against indexing: the Triton kernel (in Triton's
interpreter without a GPU), torch's fallback and the CPU copy by runs, on part of the layers and
heads of caches that hold different layers and heads, scattered slots, chunks smaller than the pull.

Triton's interpreter is set up as in test_triton_attention.py; without Triton only the fallback runs."""

import os
import sys

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET and "triton.language" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from distserve.kv_transfer import slot_copy  # noqa: E402
from distserve.kv_transfer.plan import token_slots  # noqa: E402
from distserve.kv_transfer.slot_copy import copy_slot_runs, copy_slots  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel runs on a GPU, or on CPU where the interpreter could be set before Triton was imported.
RUNS_KERNEL = slot_copy.triton is not None and (not INTERPRET or os.environ.get("TRITON_INTERPRET") == "1")
KERNELS = [False, True] if RUNS_KERNEL else [False]


def _caches(dtype):
    gen = torch.Generator().manual_seed(0)
    # The source holds layers 0-5 and heads 0-3; the destination layers 2-7 and heads 1-4.
    src = torch.randn(6, 2, 96, 4, 8, generator=gen).to(dtype).to(DEVICE)
    dst = torch.randn(6, 2, 80, 4, 8, generator=gen).to(dtype).to(DEVICE)
    return src, dst


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_slots_moves_exactly_the_named_slots(kernel, dtype):
    src, dst = _caches(dtype)
    before = dst.clone()
    gen = torch.Generator().manual_seed(1)
    src_slots = torch.randperm(96, generator=gen)[:37].to(DEVICE)
    dst_slots = torch.randperm(80, generator=gen)[:37].to(DEVICE)
    # Model layers 2-5 and heads 1-3: source layers 2:6 heads 1:4, destination layers 0:4 heads 0:3.
    there, here = src[2:6, :, :, 1:4], dst[0:4, :, :, 0:3]
    copy_slots(here, dst_slots, there, src_slots, chunk_tokens=8, kernel=kernel)
    expected = before.clone()
    expected[0:4, :, dst_slots, 0:3] = src[2:6, :, src_slots, 1:4]
    assert torch.equal(dst, expected)  # the named slots copied, nothing else touched


@pytest.mark.parametrize("kernel", KERNELS)
def test_copy_slots_of_no_tokens_is_a_no_op(kernel):
    src, dst = _caches(torch.float32)
    before = dst.clone()
    empty = torch.empty(0, dtype=torch.long, device=DEVICE)
    copy_slots(dst, empty, src, empty, chunk_tokens=8, kernel=kernel)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("blocks", [False, True], ids=["scattered", "in-blocks"])
def test_copy_slot_runs_moves_exactly_the_named_slots(blocks):
    """The CPU copy by runs of consecutive slots: slots scattered token by token, or in blocks of
    4 on one side and 8 on the other (runs of 4, some longer where blocks are adjacent)."""
    src, dst = (cache.cpu() for cache in _caches(torch.float32))
    before = dst.clone()
    if blocks:
        src_slots, dst_slots = token_slots([3, 4, 10, 1], 30, 8), token_slots([7, 8, 2, 15, 16, 0, 11, 12], 30, 4)
    else:
        gen = torch.Generator().manual_seed(1)
        src_slots, dst_slots = (
            torch.randperm(96, generator=gen)[:37].tolist(),
            torch.randperm(80, generator=gen)[:37].tolist(),
        )
    there, here = src[2:6, :, :, 1:4], dst[0:4, :, :, 0:3]
    copy_slot_runs(here, dst_slots, there, src_slots)
    expected = before.clone()
    expected[0:4, :, dst_slots, 0:3] = src[2:6, :, src_slots, 1:4]
    assert torch.equal(dst, expected)
    copy_slot_runs(here, [], there, [])  # no tokens: nothing to do
    assert torch.equal(dst, expected)


def test_copy_slots_refuses_mismatched_caches():
    src, dst = _caches(torch.float32)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        copy_slots(dst[:, :, :, :2], slots, src, slots, chunk_tokens=8)
    with pytest.raises(ValueError, match="do not match"):
        copy_slot_runs(dst[:, :, :, :2].cpu(), [0], src.cpu(), [0])
