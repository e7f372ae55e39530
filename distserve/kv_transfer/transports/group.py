"""KV over a two-rank torch.distributed group: gloo between CPU ranks, NCCL between GPUs.

The group serves every channel the in-place transports cannot: CUDA ranks on different machines or
without peer access (NCCL), CPU ranks on different Ray nodes (gloo), and any pair where an end reads
over a group only (``cache.kv_transport: group``). Gloo and NCCL differ only in the process group
made and the size of a message; the messages, their staging and their order are the same code,
since both move tensors of the cache's device by tagged point-to-point calls.

A transfer goes as messages of one layer's K or V for at most ``chunk_tokens`` tokens each
(``message_tokens``: about 1 MiB over gloo, 4,096 tokens over NCCL). Both ends cut the same
messages from both sides' slots (``message_spans``): a long run of tokens whose slots are
consecutive on both sides goes straight out of the source's cache and into the destination's;
short runs are packed into one message, gathered into a staging buffer on one side and scattered
out of one on the other. Each side stages a run too where its part of the heads is not all of its
cache's (tensor-parallel degrees that differ). The two staging buffers of a rank, one message
each, come out of the KV cache's memory budget (``staging_bytes``).
"""

from __future__ import annotations

import functools
import math
from abc import abstractmethod
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from distserve.kv_transfer.transport import KVTransport, RankKV
from distserve.parallel.process_group import COLLECTIVE_TIMEOUT

# A posted send or receive: its work, the staging buffer it uses (None: straight from or into the
# cache), and what to do once it is done (a received staged message's scatter into the cache).
Pending = tuple[dist.Work, int | None, Callable[[], object] | None]

# One message over gloo: TCP on loopback moved 8-64 MiB fastest in messages of 1-2 MiB, 1.5-2x as
# fast as in one send (the sender's writes and the receiver's reads overlap).
GLOO_MESSAGE_BYTES = 1 << 20
# Tokens of one layer's K or V per message over NCCL, whose per-call cost wants long messages.
NCCL_MESSAGE_TOKENS = 4096


def message_tokens(num_kv_heads: int, slot_width: int, dtype: torch.dtype, device_type: str) -> int:
    """Tokens of one layer's K or V per message over a rank's groups."""
    if device_type == "cuda":
        return NCCL_MESSAGE_TOKENS
    token_bytes = num_kv_heads * slot_width * torch.empty((), dtype=dtype).element_size()
    return max(1, GLOO_MESSAGE_BYTES // token_bytes)


def staging_bytes(num_kv_heads: int, slot_width: int, dtype: torch.dtype, chunk_tokens: int) -> int:
    """Memory of a rank's two staging buffers: one message of ``chunk_tokens`` tokens each."""
    return 2 * chunk_tokens * num_kv_heads * slot_width * torch.empty((), dtype=dtype).element_size()


def message_spans(src_slots: list[int], dst_slots: list[int], chunk_tokens: int) -> list[tuple[int, int, bool]]:
    """The messages of one layer's K or V, as token positions ``[start, stop)`` and whether they
    are one run of slots consecutive on both sides. A run of at least an eighth of a message goes
    alone, cut at ``chunk_tokens``; shorter ones are packed, ``chunk_tokens`` tokens a message (on
    CPU a message of its own cost less than gathering and scattering one down to runs of 128 KiB:
    a pull of 128 MiB in runs of 2-16 blocks took 42-47 ms, against 55 ms staging runs below half
    a message). Both ends compute the same spans from the same slots."""
    src, dst = np.asarray(src_slots), np.asarray(dst_slots)
    breaks = (np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1).tolist()
    spans: list[tuple[int, int, bool]] = []
    packed = None  # start of the short runs being packed
    for start, stop in zip([0, *breaks], [*breaks, len(src)]):
        if stop - start < max(1, chunk_tokens // 8):
            packed = start if packed is None else packed
            while stop - packed >= chunk_tokens:
                spans.append((packed, packed + chunk_tokens, False))
                packed += chunk_tokens
            packed = None if packed == stop else packed
            continue
        if packed is not None:
            spans.append((packed, start, False))
            packed = None
        spans += [(s, min(s + chunk_tokens, stop), True) for s in range(start, stop, chunk_tokens)]
    if packed is not None and packed < len(src):
        spans.append((packed, len(src), False))
    return spans


class GroupTransport(KVTransport[dist.ProcessGroup]):
    """A channel as a two-rank process group: the source is rank 0, the destination rank 1."""

    def __init__(self, kv: RankKV) -> None:
        super().__init__(kv)
        self._buffers: list[torch.Tensor] = []  # the two staging buffers, made on first use

    @abstractmethod
    def _group(self, store: dist.Store, rank: int) -> dist.ProcessGroup:
        """The two-rank group of this backend, met through ``store``."""

    def connect(self, channel: str, is_source: bool, store: dist.Store) -> dist.ProcessGroup:
        return self._group(store, 0 if is_source else 1)  # a group serves any pair

    def send(self, link: dist.ProcessGroup, slots: list[int], layers: range, heads: range, dst_slots: list[int]) -> int:
        """Messages in place are all posted at once; a staged one waits for its buffer's last send,
        so gathering one overlaps sending the other."""
        num_bytes = 0
        with self.kv.lock:
            pending: list[Pending] = []
            staged = 0
            for tag, (view, index) in enumerate(self._messages(slots, slots, dst_slots, layers, heads)):
                data = view
                if index is not None:
                    buffer, staged = staged % 2, staged + 1
                    _drain(pending, buffer)
                    data = self._staging(buffer, (len(index), *view.shape[1:]))
                    torch.index_select(view, 0, index, out=data)
                pending.append((link.send([data], 1, tag), None if index is None else buffer, None))
                num_bytes += data.numel() * data.element_size()
            _drain(pending)
        return num_bytes

    def recv(self, link: dist.ProcessGroup, slots: list[int], layers: range, heads: range, src_slots: list[int]) -> int:
        """Messages in place are all posted at once; a staged one is scattered into the cache once
        it is in, before its buffer takes another."""
        num_bytes = 0
        with self.kv.lock:
            pending: list[Pending] = []
            staged = 0
            for tag, (view, index) in enumerate(self._messages(slots, src_slots, slots, layers, heads)):
                data, scatter, buffer = view, None, None
                if index is not None:
                    buffer, staged = staged % 2, staged + 1
                    _drain(pending, buffer)
                    data = self._staging(buffer, (len(index), *view.shape[1:]))
                    scatter = functools.partial(view.index_copy_, 0, index, data)
                pending.append((link.recv([data], 0, tag), buffer, scatter))
                num_bytes += data.numel() * data.element_size()
            _drain(pending)
        return num_bytes

    def probe(self, link: dist.ProcessGroup, buffer: torch.Tensor, send: bool, message_bytes: int) -> None:
        pieces = list(enumerate(buffer.split(message_bytes or buffer.numel())))
        if send:
            _drain([(link.send([piece], 1, tag), None, None) for tag, piece in pieces])
        else:
            _drain([(link.recv([piece], 0, tag), None, None) for tag, piece in pieces])

    def close(self, link: dist.ProcessGroup) -> None:
        # NCCL holds device resources until its communicator is aborted.
        if hasattr(link, "abort"):
            link.abort()

    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _staging(self, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Staging buffer ``index`` (0 or 1) as a view of ``shape``. Allocated once, at their fixed
        size: fresh multi-MiB tensors cost more in page faults than the copy itself (measured 8x
        slower for a 64 MiB gather on CPU)."""
        if not self._buffers:
            cache = self.kv.tensor
            numel = self.kv.chunk_tokens * math.prod(cache.shape[3:])
            self._buffers = [torch.empty(numel, dtype=cache.dtype, device=cache.device) for _ in range(2)]
        return self._buffers[index][: math.prod(shape)].view(shape)

    def _messages(
        self, slots: list[int], src_slots: list[int], dst_slots: list[int], layers: range, heads: range
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """This side's messages in order: (the cache's slots of one message as a contiguous view,
        None) where it is sent or received in place, else (the ``[slots, heads, slot_width]`` view
        of one layer's K or V, the message's slot index into it) to go through a staging buffer."""
        cache, layout = self.kv.tensor, self.kv.layout
        first_layer, first_head = layout.layers.start, layout.kv_heads.start
        head_slice = slice(heads.start - first_head, heads.stop - first_head)
        whole = len(heads) == cache.shape[3]  # a run's slots are contiguous memory
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(cache.device)
        spans = message_spans(src_slots, dst_slots, self.kv.chunk_tokens)
        for layer in layers:
            for kv in range(2):
                view = cache[layer - first_layer, kv, :, head_slice]
                for start, stop, run in spans:
                    if run and whole:
                        yield view[slots[start] : slots[start] + stop - start], None
                    else:
                        yield view, index[start:stop]


class GlooTransport(GroupTransport):
    name = "gloo"

    def _group(self, store: dist.Store, rank: int) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(store, rank, 2, COLLECTIVE_TIMEOUT)


class NcclTransport(GroupTransport):
    name = "nccl"

    def _group(self, store: dist.Store, rank: int) -> dist.ProcessGroup:
        return dist.ProcessGroupNCCL(store, rank, 2)


def _drain(pending: list[Pending], buffer: int | None = None) -> None:
    """Complete the oldest of ``pending`` until staging ``buffer`` is free, or all of them."""
    while pending and (buffer is None or any(entry[1] == buffer for entry in pending)):
        work, _, then = pending.pop(0)
        work.wait()
        if then is not None:
            then()
