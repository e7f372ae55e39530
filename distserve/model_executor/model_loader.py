"""Resolve ``--model`` to a Hugging Face config, weights and tokenizer, and load them.

A model name is, in order: a local model directory, a built-in tiny model (made on first use)
or a preset of a common model's shape (dummy weights only: nothing is downloaded).
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from distserve.core.config import ModelConfig
from distserve.core.cpu_features import has_bf16_instructions
from distserve.core.errors import RequestError
from distserve.core.model_presets import MODEL_PRESETS, ModelShape, find_model_preset, model_shape
from distserve.core.sampling_params import SamplingParams
from distserve.model_executor.attention import ATTN_IMPLEMENTATION
from distserve.model_executor.tiny_models import TINY_MODELS, ensure_tiny_model
from distserve.parallel.pipeline_parallel import PipelineStage
from distserve.parallel.ranks import ParallelRank, stage_layers
from distserve.parallel.tensor_parallel import Shard, shard_model

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class ResolvedModel:
    hf_config: PretrainedConfig
    model_dir: Path | None  # None for presets, which have no files
    tokenizer_dir: Path
    max_model_len: int
    shape: ModelShape  # the sizes every part of the runtime reads: layers, heads, head size, vocabulary


def _known_names() -> str:
    return f"built-in tiny models: {', '.join(TINY_MODELS)}; presets (with --load-format dummy): " + ", ".join(
        MODEL_PRESETS
    )


def names_a_model(name: str) -> bool:
    """Whether ``name`` is something ``resolve_model`` would take as a model: a model directory,
    a built-in tiny model or a preset."""
    path = Path(name).expanduser()
    if path.is_dir():
        return (path / "config.json").exists()
    return name.lower() in TINY_MODELS or find_model_preset(name) is not None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is visible: use --device cpu")
    return torch.device(name)


def resolve_model(config: ModelConfig) -> ResolvedModel:
    """Check everything about the model that can be checked before loading weights.

    Device and dtype are left to the workers: an instance may drive GPU workers from a CPU node.
    """
    path = Path(config.model).expanduser()
    model_dir: Path | None
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: it is not a Hugging Face model directory")
        model_dir = path
        hf_config = AutoConfig.from_pretrained(path)
    elif config.model.lower() in TINY_MODELS:
        model_dir = ensure_tiny_model(config.model.lower())
        hf_config = AutoConfig.from_pretrained(model_dir)
    elif (preset := find_model_preset(config.model)) is not None:
        if config.load_format != "dummy":
            raise ValueError(f"'{config.model}' is a preset (shapes only, no weights here): add --load-format dummy")
        model_dir = None
        facts = dict(preset)
        hf_config = AutoConfig.for_model(facts.pop("model_type"), **facts)
    else:
        raise ValueError(
            f"unknown model '{config.model}': pass a local model directory (config.json + safetensors), "
            f"or one of the {_known_names()}"
        )

    tokenizer_dir = _resolve_tokenizer_dir(config, model_dir)
    shape = model_shape(hf_config.get_text_config().to_dict())
    context = shape.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context of {context} positions")
    return ResolvedModel(hf_config, model_dir, tokenizer_dir, config.max_model_len or context, shape)


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


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model serves in, and why."""

    dtype: torch.dtype
    reason: str
    slow: bool = False  # bfloat16 asked for on a CPU that does not multiply it in hardware

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        slow = "; slower than float32 on this CPU, which has no AVX-512 BF16 or AMX" if self.slow else ""
        return f"{name} ({self.reason}{slow})"


def choose_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> DtypeChoice:
    """``name`` unless it is ``auto``. ``auto`` serves a float32 checkpoint in bfloat16 too, as vLLM
    does (half the bytes per weight and KV value, and decode reads every one of them each step): on
    CUDA the checkpoint's float16 or bfloat16, else bfloat16; on CPU bfloat16 where the CPU
    multiplies it in hardware (``cpu_features``), float32 elsewhere."""
    if name != "auto":
        dtype = getattr(torch, name)
        slow = device.type == "cpu" and dtype == torch.bfloat16 and not has_bf16_instructions()
        return DtypeChoice(dtype, "asked for", slow)
    if device.type == "cpu":
        if has_bf16_instructions():
            return DtypeChoice(torch.bfloat16, "auto: the CPU has AVX-512 BF16 or AMX")
        return DtypeChoice(torch.float32, "auto: the CPU has no AVX-512 BF16 or AMX")
    config_dtype = getattr(hf_config, "dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    if config_dtype in (torch.float16, torch.bfloat16):
        return DtypeChoice(config_dtype, "auto: the checkpoint's")
    return DtypeChoice(torch.bfloat16, "auto: a float32 checkpoint, served in bfloat16 on CUDA")


def resolve_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``choose_dtype``'s dtype."""
    return choose_dtype(name, hf_config, device).dtype


def load_tokenizer(resolved: ResolvedModel):
    return AutoTokenizer.from_pretrained(resolved.tokenizer_dir)


def _generation_config(resolved: ResolvedModel) -> GenerationConfig:
    """The model's generation_config.json, or else what its config.json says of generation (as
    transformers and vLLM fall back)."""
    try:
        return GenerationConfig.from_pretrained(resolved.model_dir)
    except (OSError, TypeError):  # no generation_config.json (or no directory: a preset)
        return GenerationConfig.from_model_config(resolved.hf_config)


def eos_token_ids(resolved: ResolvedModel, tokenizer) -> frozenset[int]:
    """The tokens that end a generation: the generation config's and the tokenizer's."""
    ids = set()
    for value in (_generation_config(resolved).eos_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


# The generation config's keys that default a request's sampling fields, as vLLM reads them
# (``ModelConfig.get_diff_sampling_param``); max_new_tokens is its max_tokens.
GENERATION_DEFAULT_KEYS = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p",
    "max_new_tokens",
)  # fmt: skip


def default_sampling_params(resolved: ResolvedModel, generation_config: str) -> dict[str, Any]:
    """What a request's sampling fields default to when it leaves them out, as vLLM computes them:
    with ``generation_config`` "auto", the values the model's generation config sets (those that
    differ from transformers' defaults, none otherwise), its ``max_new_tokens`` as ``max_tokens``;
    with "vllm", none (the server's own defaults hold). ``do_sample`` is not read, as vLLM does
    not: a temperature it sets applies. A value no request could carry is refused here, at start-up,
    naming the file, rather than refusing every request that leaves the field out."""
    if generation_config == "vllm":
        return {}
    config = _generation_config(resolved).to_diff_dict()
    defaults = {key: config[key] for key in GENERATION_DEFAULT_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults.get("top_k") == -1:  # vLLM's "off", which is 0 here
        defaults["top_k"] = 0
    try:
        SamplingParams(**defaults)
    except RequestError as e:
        where = resolved.model_dir / "generation_config.json" if resolved.model_dir else "the model's config"
        raise ValueError(f"{where}: {e} (serve with --generation-config vllm to leave it unread)") from None
    return defaults


def load_model(
    resolved: ResolvedModel,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
    seed: int,
    rank: ParallelRank | None = None,
    tp_group=None,
) -> tuple[torch.nn.Module, PipelineStage | None]:
    """This rank's part of the transformers model, on its device, running distserve's paged attention.

    The model is built with its parameters on the meta device, sharded (tensor parallel) and cut to
    the rank's layers (pipeline parallel) there, and only then are the parameters that remain made
    real and filled, so no rank ever holds more than its share. Buffers (rotary frequencies) are
    built for real by the model's own constructors.
    """
    rank = rank or ParallelRank()
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            resolved.hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
    shards = shard_model(model, resolved.shape, rank.tp_size, rank.tp_rank, tp_group) if rank.tp_size > 1 else {}
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    stage = None
    if rank.pp_size > 1:
        num_layers = resolved.shape.num_layers
        layers = stage_layers(num_layers, rank.pp_size, rank.pp_rank)
        stage = PipelineStage(model, num_layers, layers, rank.is_first_stage, rank.is_last_stage)
    if load_format == "dummy" or resolved.model_dir is None:
        source: _WeightSource = _DummyWeights(resolved.hf_config, seed, device)
    else:
        source = _Checkpoint(resolved.model_dir, model)
    _materialize(model, names, shards, source, device)
    return model.eval().requires_grad_(False), stage


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters are created on the meta device; buffers stay real (their values come from __init__)."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


class _WeightSource:
    def load(self, names: list[str], shard: Shard | None, out: torch.Tensor) -> None:
        raise NotImplementedError


def weight_files(model_dir: Path) -> list[Path]:
    """A checkpoint's weight files: its safetensors files, or else its .bin files."""
    return sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))


class _Checkpoint(_WeightSource):
    """Reads only the slices a rank needs from safetensors files (or whole tensors from .bin files)."""

    def __init__(self, model_dir: Path, model: torch.nn.Module) -> None:
        self.files: dict[str, Any] = {}
        for path in weight_files(model_dir):
            if path.suffix == ".safetensors":
                handle = safe_open(path, framework="pt")
                self.files.update(dict.fromkeys(handle.keys(), handle))
            else:
                state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                self.files.update({key: state for key in state})
        if not self.files:
            raise ValueError(f"no weights (*.safetensors) in {model_dir}: use --load-format dummy")
        self.tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
        self.prefix = model.base_model_prefix + "."
        self.model_type = model.config.model_type

    def _key(self, names: list[str]) -> str:
        candidates = [*names, *(self.tied[n] for n in names if n in self.tied)]
        candidates += [n.removeprefix(self.prefix) for n in candidates]
        for key in candidates:
            if key in self.files:
                return key
        raise ValueError(f"the {self.model_type} checkpoint has no tensor for {names[0]}")

    def load(self, names: list[str], shard: Shard | None, out: torch.Tensor) -> None:
        key = self._key(names)
        handle = self.files[key]
        if isinstance(handle, dict):
            tensor = handle[key]
            tensor = shard.take(tensor) if shard else tensor
        elif shard is None:
            tensor = handle.get_tensor(key)
        else:
            index = (slice(None),) * shard.dim + (slice(shard.start, shard.end),)
            tensor = handle.get_slice(key)[index]
        if tensor.shape != out.shape:
            raise ValueError(
                f"{key}: the checkpoint's shape {tuple(tensor.shape)} is not the model's {tuple(out.shape)}"
            )
        out.copy_(tensor)


class _DummyWeights(_WeightSource):
    """Random weights drawn per full tensor from a seed and the tensor's name, then sliced.

    Every parallel layout of a model therefore computes with the same dummy weights.
    """

    def __init__(self, hf_config: PretrainedConfig, seed: int, device: torch.device) -> None:
        self.std = getattr(hf_config, "initializer_range", None) or getattr(hf_config, "init_std", None) or 0.02
        self.seed = seed
        self.device = device

    def load(self, names: list[str], shard: Shard | None, out: torch.Tensor) -> None:
        name = names[0]
        if out.dim() == 1:  # biases start at zero, norm scales at one
            out.fill_(0.0 if name.endswith("bias") else 1.0)
            return
        full_shape = list(out.shape)
        if shard is not None:
            full_shape[shard.dim] = shard.full_size
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(full_shape, dtype=torch.float32, device=self.device).normal_(
            0.0, self.std, generator=generator
        )
        out.copy_(shard.take(full) if shard else full)


def _materialize(
    model: torch.nn.Module,
    names: dict[int, list[str]],
    shards: dict[str, Shard],
    source: _WeightSource,
    device: torch.device,
) -> None:
    made: dict[int, torch.nn.Parameter] = {}  # tied parameters stay one tensor
    with torch.no_grad():
        for module in model.modules():
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in made:
                    real = torch.empty(param.shape, dtype=param.dtype, device=device)
                    param_names = names[id(param)]
                    source.load(param_names, shards.get(param_names[0]), real)
                    made[id(param)] = torch.nn.Parameter(real, requires_grad=False)
                module._parameters[pname] = made[id(param)]
            for bname, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[bname] = buffer.to(device)
