"""The hand-written CPU paged attention kernel (``csrc/paged_attention.cpp``): built with the host's
C++ compiler the first time a process needs it, kept in a per-user cache keyed by its source,
flags and CPU, and called through ctypes on the tensors' memory.

Plain C++ with OpenMP and no torch headers, so it compiles in about a second (an extension
against torch's headers takes tens of seconds) and loads in a millisecond. It links the OpenMP
runtime torch has already loaded, so it runs on torch's threads and their count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from distserve.core.cpu_features import cpu_info
from distserve.core.kv_cache_dtype import slot_width

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
# Linked without -ffast-math: with it, gcc links crtfastmath.o, which flushes subnormal floats to
# zero in the whole process once the library is loaded, torch's arithmetic included.
LINK_FLAGS = ("-shared", "-fopenmp")


class KernelUnavailable(RuntimeError):
    """No C++ compiler, or the kernel failed to build."""


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++`` or ``g++`` on the PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cache_dir() -> Path:
    base = os.environ.get("DISTSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "distserve")
    return Path(base) / "kernels"


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """The built kernel library; raises KernelUnavailable when it cannot be built."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    source = SOURCE.read_text()
    key = hashlib.sha256("\n".join([source, cxx, *COMPILE_FLAGS, *LINK_FLAGS, cpu_info()[:4096]]).encode())
    key = key.hexdigest()[:20]
    library = _cache_dir() / f"paged_attention-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        _build(cxx, library)
    kernel = ctypes.CDLL(str(library))
    kernel.paged_attention.restype = ctypes.c_int
    argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    kernel.paged_attention.argtypes = argtypes
    return kernel


def _build(cxx: str, library: Path) -> None:
    """Compile and link under temporary names, then rename: processes that start together may all
    build it, and none may load a half-written library."""
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        objects, shared = os.path.join(scratch, "kernel.o"), os.path.join(scratch, "kernel.so")
        for command in (
            [cxx, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", objects],
            [cxx, *LINK_FLAGS, objects, "-o", shared],
        ):
            build = subprocess.run(command, capture_output=True, text=True)
            if build.returncode != 0:
                raise KernelUnavailable(f"building {SOURCE.name} failed: {build.stderr.strip()[-2000:]}")
        os.replace(shared, library)


def kernel_available() -> bool:
    """Whether the kernel builds and loads here; when not, a warning says why, once a process."""
    try:
        load_kernel()
    except KernelUnavailable as e:
        _warn_once(str(e))
        return False
    return True


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("the C++ paged attention kernel is not available, another backend runs instead: %s", reason)


KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_CACHE_KINDS = {"auto": 0, "int8": 1, "fp8": 2}  # the kernel's ``cache`` argument


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
    cache_dtype: str = "auto",
) -> torch.Tensor:
    """Causal attention of q ``[tokens, heads, dim]`` (any strides, its last dimension contiguous)
    over a paged cache read in place. Sequence ``s`` owns the query rows ``query_starts[s]`` ..
    ``+ query_lens[s]``, the last positions of its ``context_lens[s]``, whose K/V (its new tokens'
    included) sit in the blocks of its row of ``block_tables`` ``[seqs, max_blocks]``; each row
    attends to the last ``window`` positions up to its own. q float32 or bfloat16; K/V on CPU
    ``[slots, kv_heads, dim]`` of q's dtype, or with ``cache_dtype`` int8 or fp8 ``[slots, kv_heads,
    dim + 4]`` int8 rows of codes and scale (``core/kv_cache_dtype.py``); products and sums in
    float32. Returns ``[tokens, heads, dim]`` in q's dtype."""
    tokens, heads, dim = q.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    stored = q.dtype if cache_dtype == "auto" else torch.int8
    if q.dtype not in KERNEL_DTYPES or not stored == v_cache.dtype == k_cache.dtype:
        raise ValueError(f"the kernel takes float32 or bfloat16, not q {q.dtype} over a {k_cache.dtype} cache")
    if k_cache.shape[2] != slot_width(dim, cache_dtype):
        raise ValueError(f"a {cache_dtype} cache of rows of {k_cache.shape[2]} for queries of head size {dim}")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=q.dtype)
    tables, starts, lens, contexts = (
        t.to(torch.long).contiguous() for t in (block_tables, query_starts, query_lens, context_lens)
    )
    status = load_kernel().paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(), lens.data_ptr(),
        contexts.data_ptr(), out.data_ptr(), len(starts), heads, k_cache.shape[1], dim, block_size, tables.shape[1],
        window, q.stride(0), q.stride(1), scale, q.dtype == torch.bfloat16, _CACHE_KINDS[cache_dtype],
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"paged attention kernel: block size {block_size} or window {window} under 1, or {heads} "
                         f"heads not a multiple of {k_cache.shape[1]} KV heads")  # fmt: skip
    return out
