"""The compiled paged decode kernel against SDPA over each sequence's K/V copied out of its blocks:
grouped query heads, sliding windows, contexts from one token to many blocks (a window leaving whole blocks out), blocks anywhere."""

import pytest
import torch
import torch.nn.functional as F

from distserve.model_executor.attention import NO_WINDOW, DecodePlan, _compiled_paged_decode

BLOCK_SIZE, NUM_BLOCKS, DIM = 16, 64, 32
LENGTHS = [1, 16, 17, 100, 250]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 40])
def test_compiled_paged_decode_equals_sdpa_over_gathered_blocks(heads, kv_heads, window):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, DIM, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, DIM, generator=gen)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in LENGTHS]
    plan = DecodePlan.build(tables, [n - 1 for n in LENGTHS], BLOCK_SIZE, "cpu")
    positions = torch.tensor(LENGTHS) - 1
    oldest = positions - (NO_WINDOW if window is None else window - 1)
    q = torch.randn(len(LENGTHS), heads, DIM, generator=gen)
    scale = DIM**-0.5
    out = _compiled_paged_decode(q, k_cache, v_cache, plan, positions, oldest, BLOCK_SIZE, scale)
    for i, (n, table) in enumerate(zip(LENGTHS, tables)):
        k = k_cache.view(-1, BLOCK_SIZE, kv_heads, DIM)[table].flatten(0, 1)[:n]
        v = v_cache.view(-1, BLOCK_SIZE, kv_heads, DIM)[table].flatten(0, 1)[:n]
        first = 0 if window is None else max(0, n - window)
        expected = F.scaled_dot_product_attention(
            q[i][:, None], k[first:].transpose(0, 1), v[first:].transpose(0, 1), scale=scale, enable_gqa=True
        )
        torch.testing.assert_close(out[i], expected[:, 0], atol=1e-5, rtol=1e-5)
