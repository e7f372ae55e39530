"""Pipeline parallelism: a stage keeps a contiguous slice of the decoder layers.

The model's own forward still runs on every stage, so nothing of the architecture is copied:
the decoder-layer list holds only the stage's layers, a later stage's first layer takes the
hidden states received from the previous stage in place of what the embeddings produced, and
an earlier stage stops right after its last layer. Token embeddings live on the first stage
only, the LM head on the last.
"""

from __future__ import annotations

import torch
from torch import nn


class StageDone(Exception):
    """Raised after a stage's last layer to end the forward pass with that layer's output."""

    def __init__(self, hidden_states: torch.Tensor) -> None:
        super().__init__("pipeline stage finished")
        self.hidden_states = hidden_states


class ZeroEmbedding(nn.Module):
    """Stands in for token embeddings on later stages, whose input comes from the previous stage."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.dim, dtype=self.dtype, device=input_ids.device)


class PipelineStage:
    """Installs a stage's slicing and hooks on a model; ``received`` feeds its first layer."""

    def __init__(self, model: nn.Module, num_layers: int, layers: range, is_first: bool, is_last: bool) -> None:
        self.received: torch.Tensor | None = None
        parent, attr, all_layers = find_decoder_layers(model, num_layers)
        own = nn.ModuleList(all_layers[i] for i in layers)
        setattr(parent, attr, own)
        if not is_first:
            embed = model.get_input_embeddings()
            model.set_input_embeddings(ZeroEmbedding(embed.embedding_dim, embed.weight.dtype))
            own[0].register_forward_pre_hook(self._feed, with_kwargs=True)
        if not is_last:
            model.set_output_embeddings(nn.Identity())
            own[-1].register_forward_hook(_finish)

    def _feed(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = self.received.view(1, *self.received.shape)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}


def _finish(module: nn.Module, args: tuple, output) -> None:
    hidden = output[0] if isinstance(output, tuple) else output
    raise StageDone(hidden[0])


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[nn.Module, str, nn.ModuleList]:
    """The module list of decoder layers (the one with ``num_layers`` entries) and its owner."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == num_layers
    ]
    if len(found) != 1:
        raise ValueError(
            f"cannot tell the decoder layers of {model.config.model_type} apart "
            f"({len(found)} module lists of {num_layers} entries): pipeline parallelism is not available for it"
        )
    name, layers = found[0]
    parent_name, _, attr = name.rpartition(".")
    return model.get_submodule(parent_name), attr, layers
