"""Linear layers on CPU through oneDNN, with each weight reordered once at load into the blocked
layout its GEMM reads ("packed").

torch's ``linear`` on CPU calls MKL's sgemm on the weight as stored, which at the few rows of a
decode step is far from the memory bound: for the 58M benchmark Llama's 57 linears, a step of 4
rows takes 31.7 ms against 14.4 ms packed on 2 threads, 34.0 against 18.9 ms on one
(``scripts/benchmarks/bench_gemm.py``). Packed for 64 rows, the layout is no slower from 1 row to a 256-token
prompt chunk, so one packed copy serves every step; it replaces the weight, so memory stays the
same. In bfloat16 (products in AVX-512 BF16 or AMX, sums in float32) the same step takes about half
the float32 time, packed or not; packed, 32 rows on one thread: 17 ms against 33 ms. A CPU without
those instructions keeps bfloat16 weights as loaded (``cpu_features.BF16_FLAGS``).
"""

from __future__ import annotations

import torch
from torch import nn

from distserve.core.cpu_features import has_bf16_instructions

PACKED_FOR_ROWS = 64  # the row count oneDNN lays the weights out for; see the module's docstring


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight oneDNN holds packed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_FOR_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build and device pack linear weights: on CPU, torch built with oneDNN, float32,
    or bfloat16 where the CPU multiplies it in hardware."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and has_bf16_instructions())


def pack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` holding real weights by a ``PackedLinear``
    (tensor-parallel layers, which are not plain, keep theirs); the number replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                setattr(module, name, PackedLinear(child))
                replaced += 1
    return replaced
