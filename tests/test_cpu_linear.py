"""Linear layers packed for oneDNN on CPU: the same values as torch's linear, in every layer of a
loaded model, and the same greedy tokens as transformers."""

import pytest
import torch
from conftest import random_prompts, reference_greedy
from torch import nn

from distserve import LLM, SamplingParams
from distserve.model_executor.cpu_linear import MergedSlice, PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch without oneDNN")


BFLOAT16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="no AVX-512 BF16 or AMX"),
)


@pytest.mark.parametrize("dtype", [torch.float32, BFLOAT16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_packed_linear_equals_torch_linear(dtype, bias, rows):
    """In bfloat16 against float32 products of the same bfloat16 values: sums in float32, so only
    the output's rounding to bfloat16 (2^-8 of a value at most) parts them."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(2, rows, 96).to(dtype)
    with torch.inference_mode():
        out = PackedLinear(linear)(x)
        expected = nn.functional.linear(
            x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
        )
    assert out.dtype == dtype
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=1e-5)


def test_only_plain_linears_of_real_weights_are_packed():
    class Sharded(nn.Linear):
        pass

    inner = nn.Sequential(nn.Linear(8, 4), Sharded(4, 4))
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(4, 4, device="meta"))
    assert pack_linears(model) == 2
    kinds = [type(m) for m in (model[0], inner[0], inner[1], model[2])]
    assert kinds == [PackedLinear, PackedLinear, Sharded, nn.Linear]


@pytest.mark.parametrize("bias", [True, False])
def test_merged_projections_give_each_linear_its_own_output(bias):
    """q, k and v of one module as one GEMM: the same values as each linear alone, whether they read
    one input (the GEMM runs once) or, as no decoder layer does, each its own (it runs again)."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(64, n, bias=bias) for n in (64, 16, 16))

    torch.manual_seed(5)
    module = Attention()
    alone = [nn.Linear(64, n, bias=bias) for n in (64, 16, 16)]
    for copy, linear in zip(alone, (module.q_proj, module.k_proj, module.v_proj)):
        copy.load_state_dict(linear.state_dict())
    assert pack_linears(module) == 3 and isinstance(module.k_proj, MergedSlice)
    projections = (module.q_proj, module.k_proj, module.v_proj)
    x, others = torch.randn(2, 5, 64), [torch.randn(3, 64) for _ in range(3)]
    with torch.inference_mode():
        for inputs in (others, [x, x, x]):
            for projection, linear, given in zip(projections, alone, inputs):
                torch.testing.assert_close(projection(given), linear(given), rtol=1e-5, atol=1e-5)
    assert module.q_proj.merged._output is None  # nothing held once every member took its slice


def test_a_model_with_packed_linears_generates_transformers_greedy_tokens(reference_model):
    llama = reference_model("tiny-llama")
    prompts = random_prompts([5, 40, 17], llama.config.vocab_size, seed=21)
    llm = LLM("tiny-llama", dtype="float32", cpu_packed_linear=True)
    try:
        layers = llm.engine.executor.worker.model.model.layers
        assert isinstance(layers[0].mlp.down_proj, PackedLinear) and isinstance(layers[0].mlp.up_proj, MergedSlice)
        assert isinstance(layers[0].self_attn.v_proj, MergedSlice)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert output.output_token_ids == reference_greedy(llama, prompt, 12)
