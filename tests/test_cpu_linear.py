"""Linear layers packed for oneDNN on CPU: the same values as torch's linear, in every layer of a
loaded model, and the same greedy tokens as transformers."""

import pytest
import torch
from conftest import random_prompts, reference_greedy
from torch import nn

from distserve import LLM, SamplingParams
from distserve.model_executor.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_packed_linear_equals_torch_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_only_plain_linears_of_real_weights_are_packed():
    class Sharded(nn.Linear):
        pass

    inner = nn.Sequential(nn.Linear(8, 4), Sharded(4, 4))
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(4, 4, device="meta"))
    assert pack_linears(model) == 2
    kinds = [type(m) for m in (model[0], inner[0], inner[1], model[2])]
    assert kinds == [PackedLinear, PackedLinear, Sharded, nn.Linear]


def test_a_model_with_packed_linears_generates_transformers_greedy_tokens(reference_model):
    llama = reference_model("tiny-llama")
    prompts = random_prompts([5, 40, 17], llama.config.vocab_size, seed=21)
    llm = LLM("tiny-llama", cpu_packed_linear=True)
    try:
        layers = llm.engine.executor.worker.model.model.layers
        assert isinstance(layers[0].mlp.down_proj, PackedLinear)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert output.output_token_ids == reference_greedy(llama, prompt, 12)
