"""Config facts of common models, so shapes are known offline (no hub).

Each preset is the subset of the model's Hugging Face ``config.json`` that fixes its shape;
``transformers.AutoConfig.for_model(**preset)`` turns it back into a config for dummy weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distserve.core.kv_cache_dtype import kv_value_bytes

_LLAMA2 = {
    "model_type": "llama",
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
_OPT = {
    "model_type": "opt",
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "tie_word_embeddings": True,
}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        **_LLAMA2,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "llama-2-13b": {
        **_LLAMA2,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
    },
    "llama-2-70b": {
        **_LLAMA2,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "llama-3-8b": {
        **_LLAMA2,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    "opt-13b": {
        **_OPT,
        "hidden_size": 5120,
        "ffn_dim": 20480,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "word_embed_proj_dim": 5120,
    },
    "opt-66b": {
        **_OPT,
        "hidden_size": 9216,
        "ffn_dim": 36864,
        "num_hidden_layers": 64,
        "num_attention_heads": 72,
        "word_embed_proj_dim": 9216,
    },
    "opt-175b": {
        **_OPT,
        "hidden_size": 12288,
        "ffn_dim": 49152,
        "num_hidden_layers": 96,
        "num_attention_heads": 96,
        "word_embed_proj_dim": 12288,
    },
}


# The shapes of distserve's built-in tiny models (distserve/model_executor/tiny_models.py; a test checks
# they agree). Their weights are made locally, so a plan for one serves real weights, not dummy ones.
_TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
}
TINY_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {**_TINY, "model_type": "llama", "intermediate_size": 128, "num_key_value_heads": 2},
    "tiny-qwen2": {**_TINY, "model_type": "qwen2", "intermediate_size": 128, "num_key_value_heads": 1},
    "tiny-opt": {**_TINY, "model_type": "opt", "ffn_dim": 128, "word_embed_proj_dim": 64},
    "tiny-gpt2": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 1024,
        "n_positions": 1024,
    },
}

# Families the planner may split over tensor parallel ranks: each has a plan in transformers
# (``base_model_tp_plan``) or in distserve; the engine also splits other families that have one.
TENSOR_PARALLEL_FAMILIES = ("llama", "mistral", "opt", "qwen2")


def find_model_preset(name: str) -> dict[str, Any] | None:
    """The preset of a model name, matched case-insensitively (``Llama-2-7B`` is ``llama-2-7b``)."""
    return MODEL_PRESETS.get(name.lower())


@dataclass(frozen=True)
class ModelShape:
    """What placement needs to know of a model: sizes that set FLOPs, weight bytes and KV bytes."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    gated_mlp: bool
    model_type: str  # the Hugging Face family: "llama", "opt", ...

    def tensor_parallel_problem(self, tp: int, has_plan: bool | None = None) -> str | None:
        """Why ``tp`` tensor parallel ranks cannot shard this model, or None when they can.

        The one rule that the engine (distserve/parallel/tensor_parallel.py) and the planner's
        candidates follow: the family has a plan to shard it by, attention heads and MLP features
        split evenly, KV heads split evenly or are replicated (each rank keeps the one its query
        heads read), and the vocabulary is split when it divides and otherwise kept whole on every
        rank (``splits_vocab``). The engine knows ``has_plan`` from the model's transformers config;
        without it, the families of ``TENSOR_PARALLEL_FAMILIES`` have one.
        """
        if tp == 1:
            return None
        if not (self.model_type in TENSOR_PARALLEL_FAMILIES if has_plan is None else has_plan):
            return (
                f"tensor parallelism is not available for model family '{self.model_type}': it has no tensor "
                "parallel plan; use tensor_parallel_size 1 (pipeline parallelism works for any family)"
            )
        if self.num_heads % tp:
            return (
                f"{self.model_type} has {self.num_heads} attention heads, which {tp} tensor parallel ranks cannot share"
            )
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return (
                f"{self.model_type} has {self.num_kv_heads} KV heads: {tp} tensor parallel ranks need a divisor "
                "or a multiple of it"
            )
        if self.intermediate_size % tp:
            return (
                f"{self.model_type} has an MLP of {self.intermediate_size} features, which {tp} tensor parallel "
                "ranks cannot share"
            )
        return None

    def splits_vocab(self, tp: int) -> bool:
        """Whether the embedding and LM head are split over ``tp`` ranks (else each rank keeps them whole)."""
        return self.vocab_size % tp == 0

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * self.hidden_size

    def kv_head_bytes(self, dtype_bytes: int = 2, cache_dtype: str = "auto") -> int:
        """Bytes one token's K (or V) of one KV head takes in the cache: ``head_dim`` values of the
        model's ``dtype_bytes``, or in an 8-bit cache their codes and scale (``core/kv_cache_dtype.py``)."""
        return round(self.head_dim * kv_value_bytes(self.head_dim, cache_dtype, dtype_bytes))

    def kv_bytes_per_token(self, dtype_bytes: int = 2, cache_dtype: str = "auto") -> int:
        """KV bytes of one token, every layer's K and V: what a hand-over moves per prompt token."""
        return self.num_layers * 2 * self.num_kv_heads * self.kv_head_bytes(dtype_bytes, cache_dtype)


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Shape of a model from its config facts (a preset, or a parsed ``config.json``)."""
    get = config.get
    hidden = get("hidden_size") or get("n_embd")
    heads = get("num_attention_heads") or get("n_head")
    return ModelShape(
        num_layers=get("num_hidden_layers") or get("n_layer"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or hidden // heads,
        intermediate_size=get("intermediate_size") or get("ffn_dim") or get("n_inner") or 4 * hidden,
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings") or get("n_positions"),
        gated_mlp=get("model_type") in ("llama", "mistral", "qwen2"),
        model_type=get("model_type") or "",
    )
