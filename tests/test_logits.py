"""Prefill and decode logits of the paged engine against transformers' own forward pass."""

import pytest
import torch
from conftest import FAMILIES, random_prompts

from distserve import LLM, SamplingParams
from distserve.core.sequence import Sequence
from distserve.model_executor.model_runner import BatchInput
from distserve.model_executor.tiny_models import ensure_tiny_model

LENGTHS = [1, 20, 57, 130]


def _engine_logits(llm: LLM, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-position logits of one packed prefill, then of one decode step after appending token 5."""
    engine = llm.engine
    seqs = [Sequence(p, SamplingParams()) for p in prompts]
    for seq in seqs:
        engine.block_manager.allocate(seq)
    runner = engine.executor.worker.model_runner
    prefill = runner.forward(*runner.prepare(BatchInput.from_sequences(True, seqs))).float()
    for seq in seqs:
        seq.append_token(5)
        seq.num_computed_tokens = seq.num_tokens - 1
        engine.block_manager.append_slot(seq)
    decode = runner.forward(*runner.prepare(BatchInput.from_sequences(False, seqs))).float()
    for seq in seqs:
        engine.block_manager.free(seq)
    return prefill, decode


def _reference_logits(model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        prefill = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts]).float()
        decode = torch.stack([model(torch.tensor([p + [5]])).logits[0, -1] for p in prompts]).float()
    return prefill, decode


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 0.025)])
def test_logits_match_transformers(family, dtype, atol):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(family), dtype=getattr(torch, dtype)).eval()
    llm = LLM(family, dtype=dtype)
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=11)
    for got, want in zip(_engine_logits(llm, prompts), _reference_logits(model, prompts)):
        assert got.shape == want.shape
        # Logits spread over several units; bfloat16 keeps about 3 significant digits.
        assert (got - want).abs().max().item() < atol * max(1.0, want.abs().max().item())
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
