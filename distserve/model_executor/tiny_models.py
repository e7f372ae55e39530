"""Built-in tiny models for the demo and the tests, made locally and deterministically.

Weights are random from a fixed seed; the tokenizer is a byte-level BPE trained with
``tokenizers`` on a generated corpus. Each model is written as an ordinary Hugging Face
directory (config.json, model.safetensors, tokenizer files), so it loads like any other.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Bump when the recipe changes, so cached copies made by an older recipe are not reused.
RECIPE_VERSION = 1
SEED = 1234
VOCAB_SIZE = 1024
MAX_POSITIONS = 1024
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this are which or his her their "
    "one all were they but not we has have had been would there can more when who will no about its "
    "time first new two may people world city year state water work life day light house power "
    "river music model cache block token prompt decode prefill server cluster request batch layer "
    "head memory network engine speed queue order number small large fast slow early late north "
    "south east west red blue green black white old young long short high low open close read write "
    "run walk play build make take give find think know see come go say tell ask use try call"
).split()
_PUNCT = [".", ",", "!", "?", ";", ":"]


def _corpus(num_lines: int = 4000) -> Iterator[str]:
    rng = random.Random(SEED)
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        words[0] = words[0].capitalize()
        yield " ".join(words) + rng.choice(_PUNCT)


@functools.cache
def train_tokenizer():
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) with bos/eos/pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _family_configs(tokenizer) -> dict[str, dict]:
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    # A wide init makes the logits peaked, so greedy choices are not decided by rounding noise.
    common = {**ids, "initializer_range": 0.15, "tie_word_embeddings": False}
    return {
        "tiny-llama": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": MAX_POSITIONS,
            **common,
        },
        "tiny-qwen2": {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "max_position_embeddings": MAX_POSITIONS,
            **common,
        },
        "tiny-opt": {
            "model_type": "opt",
            "hidden_size": 64,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": MAX_POSITIONS,
            **common,
            "init_std": 0.15,
        },
        "tiny-gpt2": {
            "model_type": "gpt2",
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": MAX_POSITIONS,
            **common,
        },
    }


TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-opt", "tiny-gpt2")


def make_tiny_model(name: str, out_dir: str | Path, **overrides) -> Path:
    """Write tiny model ``name`` as a Hugging Face directory at ``out_dir``; ``overrides`` change its
    config fields (``num_attention_heads=6``, ...) for a variant of another shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model '{name}'; choose one of {', '.join(TINY_MODELS)}")
    tokenizer = train_tokenizer()
    facts = {**_family_configs(tokenizer)[name], **overrides}
    config = AutoConfig.for_model(facts.pop("model_type"), **facts)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# A Llama shape for dummy-weight benchmarks on CPU, big enough that a forward pass costs far more
# than the serving path spends per token: 8 layers of 3.1M parameters. With write_llama_shape's
# vocabulary of 32000 it has 58M parameters (the offline benchmark's model); with the built-in
# tokenizer's VOCAB_SIZE, 26M.
BENCH_LLAMA_SHAPE = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
                     "num_key_value_heads": 8}  # fmt: skip


def write_llama_shape(out_dir: str | Path, **shape) -> Path:
    """A Llama-shaped model directory with config.json and the built-in tokenizer but no weights,
    to serve with ``--load-format dummy``. ``shape`` sets LlamaConfig fields (hidden_size, ...)."""
    from transformers import LlamaConfig

    tokenizer = train_tokenizer()
    config = LlamaConfig(
        **{"vocab_size": 32000, "tie_word_embeddings": False, **shape},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = Path(out_dir)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def cache_dir() -> Path:
    root = os.environ.get("DISTSERVE_CACHE_DIR") or Path.home() / ".cache" / "distserve"
    return Path(root) / "models"


def ensure_tiny_model(name: str) -> Path:
    """Path of tiny model ``name`` in the cache directory, made on first use.

    The model is written to a temporary directory and renamed into place, so concurrent first
    uses (several processes or actors) never see a half-written directory.
    """
    target = cache_dir() / f"{name}-v{RECIPE_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        make_tiny_model(name, tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
