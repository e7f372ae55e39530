"""What makes a KV transfer checked: a digest of the KV of some token slots, computed by the source
rank over what it sends and by the destination rank over what it received; a pull whose digests
differ failed, and its request runs again, so bytes changed in transit never reach a token.

The digest sums each token's K (and V) bits per layer as 32-bit integers that wrap (the values'
bit patterns, not their floating-point values: a changed bit changes its token's sum by 2**k modulo
2**32, never by 0) and hashes the sums in slot order. A flipped byte changes one sum; a token's KV
written to the wrong slot, layer or K/V side changes their order. Summing reads the KV once at
memory speed (wrapping 32-bit sums ran 2.4x as fast as exact 64-bit ones here).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

# The integer type whose bit pattern reads one element of a KV cache of that element size.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class KVChecksumMismatch(RuntimeError):
    """The KV a destination received is not what its source sent."""


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """``slots`` as runs of consecutive slots, each (first slot, length), in order."""
    if not slots:
        return []
    array = np.asarray(slots)
    breaks = (np.flatnonzero(np.diff(array) != 1) + 1).tolist()
    return [(int(array[start]), stop - start) for start, stop in zip([0, *breaks], [*breaks, len(array)])]


def kv_digest(part: torch.Tensor, slots: list[int]) -> str:
    """The digest of the K and V held in ``slots`` of ``part`` (a ``[layers, 2, slots, heads,
    head_dim]`` view of a rank's cache: the layers and heads one transfer moves)."""
    bits = _words(part)
    layers = bits.shape[0]
    sums = [
        bits[:, :, start : start + length].reshape(layers, 2, length, -1).sum(-1, dtype=torch.int32)
        for start, length in slot_runs(slots)
    ]
    if not sums:
        return hashlib.blake2b(b"", digest_size=16).hexdigest()
    table = torch.cat(sums, dim=2).cpu().numpy()  # [layers, 2, tokens]
    return hashlib.blake2b(np.ascontiguousarray(table).tobytes(), digest_size=16).hexdigest()


def _words(part: torch.Tensor) -> torch.Tensor:
    """``part``'s bits as 32-bit words where its rows divide into them, else as integers of its
    element size. Summed into 32 bits, 8- and 16-bit integers ran 10x slower than 32-bit words
    here (an int8 cache's 66 MiB in 147 ms, a float32 cache's 256 MiB in 14 ms, one thread)."""
    try:
        return part.view(torch.int32)
    except RuntimeError:  # a row's bytes or a stride not a multiple of 4
        return part.view(_BITS[part.element_size()])
