"""What this machine's CPU can do, read from ``/proc/cpuinfo``: which dtype serves fastest on it,
and what the C++ kernel is compiled for."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# Instructions that multiply bfloat16 with float32 accumulation in hardware: AVX-512 BF16
# (Cooper Lake, Zen 4 and later) and AMX (Sapphire Rapids and later). Without them bfloat16 is
# slower than float32: the 57 linears of the 58M Llama's decode step at 32 rows, one thread, oneDNN
# packed, on a Zen 4 held to AVX-512 without BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE): bfloat16
# 94 ms, float32 33 ms; with its BF16 instructions, bfloat16 17 ms.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_info() -> str:
    """The model name and flags lines of ``/proc/cpuinfo`` (the processor's name elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return "".join(line for line in info.splitlines(keepends=True) if line.startswith(("model name", "flags")))


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    for line in cpu_info().splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_bf16_instructions() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)
