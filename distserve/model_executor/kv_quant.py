"""Writing K/V into an 8-bit cache and reading them back (``core/kv_cache_dtype.py`` has the layout).

Each row (one token's K or V for one KV head) is scaled so that its largest magnitude maps to the
largest code (127 for int8, 448 for fp8 e4m3), stored as codes, and its scale (float32) after them.
Quantizing computes in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

from distserve.core.kv_cache_dtype import CODE_MAX, SCALE_BYTES

# The smallest scale: a row of zeros gets it (its codes are 0 whatever the scale), and no division is by 0.
_MIN_SCALE = 1e-30


def quantize_kv(rows: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """``[tokens, kv_heads, head_dim]`` -> ``[tokens, kv_heads, head_dim + 4]`` int8: codes, then the scale's bytes."""
    x = rows.float()
    scale = (x.abs().amax(-1, keepdim=True) / CODE_MAX[cache_dtype]).clamp_min(_MIN_SCALE)
    scaled = x / scale
    if cache_dtype == "int8":
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def dequantize_kv(slots: torch.Tensor, cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim + 4]`` int8 rows of an 8-bit cache -> ``[..., head_dim]`` values in ``dtype``."""
    codes, scale = slots[..., :-SCALE_BYTES], slots[..., -SCALE_BYTES:]
    values = codes.float() if cache_dtype == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (values * scale.contiguous().view(torch.float32)).to(dtype)
