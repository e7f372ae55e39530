"""A token bitmask per row of logits: bit ``t % 32`` of int32 word ``t // 32`` allows token ``t``.
Structured outputs' matchers (``distserve.engine.structured_output``) fill it; the sampler applies
it, setting the logits of every token it does not allow to -inf."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask of ``rows`` rows, every token allowed: rows no matcher fills leave their
    logits as they are."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def word_bit(bit: int) -> int:
    """The int32 value with only ``bit`` set (bit 31 is the sign)."""
    return -(2**31) if bit == 31 else 1 << bit


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Set the logits of tokens ``bitmask`` does not allow to -inf, in place.

    ``logits`` is [rows, width]; ``bitmask`` has a row per logits row (``allocate_bitmask``); only
    the rows in ``rows_index`` are masked (all if None). Tokens past the bitmask's width (the
    logits of a model wider than the vocabulary masked) are never allowed. CPU float32, bfloat16
    and float16 logits use xgrammar's CPU kernel; other devices and dtypes unpack the bitmask with
    torch on the logits' device.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} need a row each")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if rows_index is not None:
        rows_index = torch.as_tensor(rows_index, dtype=torch.long)
        if rows_index.numel() == 0:
            return
    width = logits.shape[1]
    covered = min(width, bitmask.shape[1] * 32)
    if (
        logits.device.type == "cpu"
        and bitmask.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and logits.stride(1) == 1
    ):
        import xgrammar as xgr  # only a structured output's step needs the grammar library

        indices = None if rows_index is None else rows_index.tolist()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=indices, backend="cpu")
    else:
        _apply_bitmask_torch(logits, bitmask, rows_index, covered)
    if width > covered:
        if rows_index is None:
            logits[:, covered:] = float("-inf")
        else:
            logits[rows_index.to(logits.device), covered:] = float("-inf")


def _apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: torch.Tensor | None, covered: int
) -> None:
    """apply_bitmask's unpack in torch, for any device: a bit per token, no loop over rows."""
    device = logits.device
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    if rows_index is not None:
        rows_index = rows_index.to(device)
        words = words.index_select(0, rows_index)
    blocked = ((words.unsqueeze(-1) >> _SHIFTS[device]) & 1 == 0).flatten(1)[:, :covered]
    if rows_index is None:
        logits[:, :covered].masked_fill_(blocked, float("-inf"))
    else:
        part = logits.index_select(0, rows_index)
        part[:, :covered].masked_fill_(blocked, float("-inf"))
        logits.index_copy_(0, rows_index, part)
