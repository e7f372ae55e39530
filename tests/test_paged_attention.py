"""The compiled paged decode kernel against SDPA over each sequence's K/V copied out of its blocks:
grouped query heads, sliding windows (leaving whole blocks out), contexts from one token to many
blocks, blocks anywhere; and the one kernel an engine builds at start-up."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from distserve import LLM, SamplingParams
from distserve.model_executor.attention import (
    NO_WINDOW,
    DecodePlan,
    _compiled_paged_decode,
    resolve_attention_backend,
)

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


def test_auto_backend_is_compiled_on_cpu_and_sdpa_on_cuda():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "compiled"
    assert resolve_attention_backend("auto", torch.device("cuda")) == "sdpa"
    assert resolve_attention_backend("sdpa", torch.device("cpu")) == "sdpa"


def test_one_kernel_built_at_start_up_serves_every_batch_shape():
    """Built by the engine's warm-up step; one sequence or many, one block or many, no rebuild."""
    llm = LLM("tiny-llama", attention_backend="compiled", enable_prefix_caching=False)
    graphs = counters["stats"]["unique_graphs"]
    for batch, prompt_len in [(1, 3), (1, 40), (5, 20), (2, 70), (1, 1)]:
        prompts = [[5 + i] * (prompt_len + i) for i in range(batch)]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
        assert all(len(out.output_token_ids) == 20 for out in outputs)
    assert counters["stats"]["unique_graphs"] == graphs
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
