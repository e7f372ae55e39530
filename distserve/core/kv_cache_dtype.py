"""What a KV cache stores per value: the model's dtype (``auto``), or 8 bits with a scale.

An 8-bit cache (``int8``, or ``fp8``: e4m3) keeps each token's K (and V) per KV head as
``head_dim`` one-byte codes followed by that row's float32 scale, in the same slot: a slot is
``kv_heads x (head_dim + 4)`` bytes. A scale per token and head (rather than per block) is set once,
when its token is written, so a block never needs requantizing as it fills; and because the scale
sits in its token's slot, everything that moves slots (a hand-over, swap, the prefix tier, a
copy-on-write fork) moves the scales with them without knowing they are there.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_BYTES = 4  # a float32 scale per token, KV head and K/V
CODE_MAX = {"int8": 127.0, "fp8": 448.0}  # the largest code: a row's largest magnitude maps to it


def is_quantized(cache_dtype: str) -> bool:
    return cache_dtype != "auto"


def slot_width(head_dim: int, cache_dtype: str) -> int:
    """Elements one KV head takes in a slot: its values, and in an 8-bit cache its scale's 4 bytes."""
    return head_dim + SCALE_BYTES if is_quantized(cache_dtype) else head_dim


def kv_value_bytes(head_dim: int, cache_dtype: str, dtype_bytes: int) -> float:
    """Bytes a cache takes per K or V value, scales included: ``dtype_bytes`` (the model's) for ``auto``."""
    if not is_quantized(cache_dtype):
        return float(dtype_bytes)
    return slot_width(head_dim, cache_dtype) / head_dim


def check_kv_cache_dtype(cache_dtype: str, head_dim: int) -> None:
    """ValueError for a cache dtype this head size cannot use."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}")
    if is_quantized(cache_dtype) and head_dim % SCALE_BYTES:
        raise ValueError(f"an {cache_dtype} KV cache needs a head size that is a multiple of 4, not {head_dim}")
