"""Tensor parallelism driven by the ``base_model_tp_plan`` that transformers configs carry.

A ``colwise`` linear keeps a slice of its output features, a ``rowwise`` one a slice of its input
features followed by an all-reduce, and ``colwise_gather_output`` (the LM head) all-gathers the
vocabulary slices. Attention projections are split by whole heads; when a model has fewer KV
heads than ranks, each rank keeps the one KV head its query heads use. An embedding or LM head
whose vocabulary does not divide over the ranks is kept whole on each (OPT's 50272 at TP=3).
What can be sharded is ``ModelShape.tensor_parallel_problem``, the rule the planner follows too.
The model is sharded while its parameters are still on the meta device, so a rank only ever
loads its own slices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distserve.core.model_presets import ModelShape

# Plans for families whose transformers config carries none, keyed by model_type; keys are
# relative to the base model, as transformers' own plans are.
OWN_TP_PLANS: dict[str, dict[str, str]] = {
    "opt": {
        "decoder.embed_tokens": "embedding_rowwise",
        "decoder.layers.*.self_attn.q_proj": "colwise",
        "decoder.layers.*.self_attn.k_proj": "colwise",
        "decoder.layers.*.self_attn.v_proj": "colwise",
        "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise",
        "decoder.layers.*.fc2": "rowwise",
    },
}
OWN_MODEL_PLAN = {"lm_head": "colwise_gather_output"}
REPLICATED_STYLES = ("replicated_with_grad_allreduce",)
LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather_output")


@dataclass(frozen=True)
class Shard:
    """The slice ``[start, end)`` along ``dim`` of a full checkpoint tensor that a rank holds."""

    dim: int
    start: int
    end: int
    full_size: int  # of ``dim`` in the full tensor

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.end - self.start)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group, dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, end)`` of the vocabulary; ids elsewhere give zeros, and the ranks' sum is the lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, group, dtype, device) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0)).masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredColumnLinear(nn.Linear):
    """A vocabulary slice of the LM head; the full logits are gathered on every rank of the group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group, dtype, device) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def check_tensor_parallel(hf_config, shape: ModelShape, tp_size: int) -> None:
    """Raise ValueError, naming the family, when ``tp_size`` ranks cannot shard this model: the
    planner's rule (``ModelShape.tensor_parallel_problem``), and a plan to shard it by."""
    config = hf_config.get_text_config()
    has_plan = bool(getattr(config, "base_model_tp_plan", None)) or config.model_type in OWN_TP_PLANS
    problem = shape.tensor_parallel_problem(tp_size, has_plan)
    if problem is not None:
        raise ValueError(problem)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Module-name patterns of the whole model and their styles."""
    config = model.config
    if getattr(config, "base_model_tp_plan", None):
        return dict(model.tp_plan)  # transformers merged the config's plan with the model's (LM head, embeddings)
    own = OWN_TP_PLANS[config.model_type]
    return {**{f"{model.base_model_prefix}.{key}": style for key, style in own.items()}, **OWN_MODEL_PLAN}


def _pattern(plan_key: str) -> re.Pattern:
    return re.compile(re.escape(plan_key).replace(r"\*", r"[^.]+"))


def _split(num_units: int, tp_size: int, tp_rank: int, what: str, replicable: bool) -> tuple[int, int]:
    """This rank's ``[start, end)`` of ``num_units`` units (heads, or features)."""
    if num_units % tp_size == 0:
        per_rank = num_units // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if replicable and tp_size % num_units == 0:
        unit = tp_rank * num_units // tp_size  # the KV head this rank's query heads read
        return unit, unit + 1
    raise ValueError(f"{what}: {num_units} cannot be split over {tp_size} tensor parallel ranks")


def _head_dim(parent: nn.Module) -> int | None:
    """The head size when ``parent`` is an attention module (it has a layer index and a head size)."""
    if hasattr(parent, "layer_idx") and isinstance(getattr(parent, "head_dim", None), int):
        return parent.head_dim
    return None


def shard_model(model: nn.Module, shape: ModelShape, tp_size: int, tp_rank: int, group) -> dict[str, Shard]:
    """Replace the plan's linears by this rank's shards (still on meta); returns each sharded parameter's slice."""
    check_tensor_parallel(model.config, shape, tp_size)
    model_type = model.config.model_type
    plan = [(_pattern(key), style) for key, style in tp_plan(model).items()]
    shards: dict[str, Shard] = {}
    attention_modules: set[nn.Module] = set()
    for name, module in list(model.named_modules()):
        style = next((s for p, s in plan if p.fullmatch(name)), None)
        if style is None or style in REPLICATED_STYLES:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if style == "embedding_rowwise" and type(module) is nn.Embedding:
            if shape.splits_vocab(tp_size):  # otherwise the embeddings stay whole on every rank
                rows = module.num_embeddings // tp_size
                start = tp_rank * rows
                kwargs = {"dtype": module.weight.dtype, "device": module.weight.device}
                setattr(parent, attr, VocabParallelEmbedding(rows, module.embedding_dim, start, group, **kwargs))
                shards[f"{name}.weight"] = Shard(0, start, start + rows, module.num_embeddings)
            continue
        if style == "colwise_gather_output" and not shape.splits_vocab(tp_size):
            continue  # an LM head whose vocabulary does not divide stays whole on every rank
        if style not in LINEAR_STYLES:
            raise ValueError(f"tensor parallel style '{style}' of {name} ({model_type}) is not supported")
        if type(module) is not nn.Linear:
            raise ValueError(f"{name} of {model_type} is a {type(module).__name__}, not a Linear: it cannot be sharded")
        head_dim = _head_dim(parent)
        unit = head_dim or 1
        has_bias = module.bias is not None
        kwargs = {"dtype": module.weight.dtype, "device": module.weight.device}
        if style == "rowwise":
            start, end = _split(module.in_features // unit, tp_size, tp_rank, name, replicable=False)
            new = RowParallelLinear((end - start) * unit, module.out_features, has_bias, group, **kwargs)
            shards[f"{name}.weight"] = Shard(1, start * unit, end * unit, module.in_features)
        else:
            start, end = _split(module.out_features // unit, tp_size, tp_rank, name, replicable=head_dim is not None)
            out = (end - start) * unit
            if style == "colwise_gather_output":
                new = GatheredColumnLinear(module.in_features, out, has_bias, group, **kwargs)
            else:
                new = nn.Linear(module.in_features, out, bias=has_bias, **kwargs)
            shards[f"{name}.weight"] = Shard(0, start * unit, end * unit, module.out_features)
            if has_bias:
                shards[f"{name}.bias"] = Shard(0, start * unit, end * unit, module.out_features)
        setattr(parent, attr, new)
        if head_dim is not None:
            attention_modules.add(parent)
    heads, kv_heads = shape.num_heads // tp_size, local_kv_heads(shape.num_kv_heads, tp_size)
    for attn in attention_modules:
        # Families that reshape with an explicit head count (OPT: num_heads) must see the local one.
        for attr, value in (
            ("num_heads", heads),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("num_key_value_groups", heads // kv_heads),
        ):
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, value)
    return shards


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: its share, or one replicated head when there are fewer heads than ranks."""
    return max(1, num_kv_heads // tp_size)
