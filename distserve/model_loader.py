"""Resolve ``--model`` to a Hugging Face config, weights and tokenizer, and load them.

A model name is, in order: a local model directory, a built-in tiny model (made on first use)
or a preset of a common model's shape (dummy weights only: nothing is downloaded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from distserve.attention import ATTN_IMPLEMENTATION
from distserve.config import ModelConfig
from distserve.tiny_models import TINY_MODELS, ensure_tiny_model
from placement.model_presets import MODEL_PRESETS

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class ResolvedModel:
    hf_config: PretrainedConfig
    model_dir: Path | None  # None for presets, which have no files
    tokenizer_dir: Path
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


def _known_names() -> str:
    return f"built-in tiny models: {', '.join(TINY_MODELS)}; presets (with --load-format dummy): " + ", ".join(
        MODEL_PRESETS
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is visible: use --device cpu")
    return torch.device(name)


def resolve_model(config: ModelConfig) -> ResolvedModel:
    """Check everything about the model that can be checked before loading weights."""
    device = resolve_device(config.device)
    path = Path(config.model).expanduser()
    model_dir: Path | None
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: it is not a Hugging Face model directory")
        model_dir = path
        hf_config = AutoConfig.from_pretrained(path)
    elif config.model in TINY_MODELS:
        model_dir = ensure_tiny_model(config.model)
        hf_config = AutoConfig.from_pretrained(model_dir)
    elif config.model.lower() in MODEL_PRESETS:
        if config.load_format != "dummy":
            raise ValueError(f"'{config.model}' is a preset (shapes only, no weights here): add --load-format dummy")
        model_dir = None
        facts = dict(MODEL_PRESETS[config.model.lower()])
        hf_config = AutoConfig.for_model(facts.pop("model_type"), **facts)
    else:
        raise ValueError(
            f"unknown model '{config.model}': pass a local model directory (config.json + safetensors), "
            f"or one of the {_known_names()}"
        )

    tokenizer_dir = _resolve_tokenizer_dir(config, model_dir)
    dtype = _resolve_dtype(config.dtype, hf_config, device)
    context = hf_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context of {context} positions")
    return ResolvedModel(hf_config, model_dir, tokenizer_dir, dtype, device, config.max_model_len or context)


def _resolve_tokenizer_dir(config: ModelConfig, model_dir: Path | None) -> Path:
    if config.tokenizer is not None:
        tokenizer_dir = Path(config.tokenizer).expanduser()
        if not tokenizer_dir.is_dir():
            raise ValueError(f"tokenizer directory '{config.tokenizer}' does not exist")
    elif model_dir is None:
        # Presets carry no tokenizer: use the built-in one, whose ids are valid in any larger vocab.
        tokenizer_dir = ensure_tiny_model(TINY_MODELS[0])
    else:
        tokenizer_dir = model_dir
    if not any((tokenizer_dir / f).exists() for f in _TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer found in {tokenizer_dir} (looked for {', '.join(_TOKENIZER_FILES)}): "
            "add the tokenizer files or pass --tokenizer DIR"
        )
    return tokenizer_dir


def _resolve_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def load_tokenizer(resolved: ResolvedModel):
    return AutoTokenizer.from_pretrained(resolved.tokenizer_dir)


def load_model(resolved: ResolvedModel, load_format: str, seed: int) -> torch.nn.Module:
    """The transformers model on its device, in eval mode, running distserve's paged attention."""
    if load_format == "dummy" or resolved.model_dir is None:
        # Random weights of the real shape; seeded so every rank and every run agree.
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            resolved.hf_config, dtype=resolved.dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(resolved.device)
    else:
        if not any(resolved.model_dir.glob("*.safetensors")) and not any(resolved.model_dir.glob("*.bin")):
            raise ValueError(f"no weights (*.safetensors) in {resolved.model_dir}: use --load-format dummy")
        model = AutoModelForCausalLM.from_pretrained(
            resolved.model_dir,
            dtype=resolved.dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
        ).to(resolved.device)
    return model.eval().requires_grad_(False)
