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


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def _packed_matmul(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight oneDNN holds packed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = _packed(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_matmul(x, self.packed_weight, self.bias, self.out_features)


# Linears of one module that read the same input, as transformers' decoder layers call them: their
# weights stacked are one GEMM. At a decode step's few rows the GEMMs stream their weights from
# memory and each call pays a start; for the 58M Llama's step, one row, one thread, bfloat16:
# 7.2 against 8.1 ms for its linears (q, k and v merged, gate and up merged), 4 rows 7.6 against
# 8.3, 32 rows 20.8 against 21.7.
MERGED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class MergedLinears:
    """Linears that read the same input, as one packed GEMM: the first of them called on an input
    computes every one's output; the others, called on the same tensor, take their slice of it.
    Called on another input (a model that does not feed them alike), the GEMM runs again for it."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.packed_weight = _packed(torch.cat([linear.weight.detach() for linear in linears]))
        biases = [linear.bias for linear in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        ends = torch.tensor([linear.out_features for linear in linears]).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self.out_features = ends[-1]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._left: set[int] = set()  # members yet to take their slice of ``_output``

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:
        if x is not self._input or member not in self._left:
            self._input, self._left = x, set(range(len(self.bounds)))
            self._output = _packed_matmul(x, self.packed_weight, self.bias, self.out_features)
        start, end = self.bounds[member]
        out = self._output[..., start:end]
        self._left.discard(member)
        if not self._left:  # every member served: hold no activation past this layer
            self._input = self._output = None
        return out


class MergedSlice(nn.Module):
    """One member of ``MergedLinears``, in its linear's place."""

    def __init__(self, merged: MergedLinears, member: int, linear: nn.Linear) -> None:
        super().__init__()
        self.merged, self.member = merged, member
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merged.output(x, self.member)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build and device pack linear weights: on CPU, torch built with oneDNN, float32,
    or bfloat16 where the CPU multiplies it in hardware."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and has_bf16_instructions())


def _mergeable(linears: list) -> bool:
    """Plain linears of real weights on CPU, alike in input size and in having a bias or not."""
    first = linears[0]
    return all(
        type(linear) is nn.Linear
        and linear.weight.device.type == "cpu"
        and linear.in_features == first.in_features
        and (linear.bias is None) == (first.bias is None)
        for linear in linears
    )


def pack_linears(model: nn.Module, merge: bool = True) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` holding real weights by a ``PackedLinear``
    (tensor-parallel layers, which are not plain, keep theirs), and with ``merge`` those of a
    module named in ``MERGED_PROJECTIONS`` by ``MergedSlice``s of one GEMM; the number replaced."""
    replaced = 0
    for module in list(model.modules()):
        for names in MERGED_PROJECTIONS if merge else ():
            linears = [getattr(module, name, None) for name in names]
            if None in linears or not _mergeable(linears):
                continue
            merged = MergedLinears(linears)
            for member, (name, linear) in enumerate(zip(names, linears)):
                setattr(module, name, MergedSlice(merged, member, linear))
            replaced += len(names)
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                setattr(module, name, PackedLinear(child))
                replaced += 1
    return replaced
