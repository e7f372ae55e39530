"""One rank's end of the KV transfers between instances: pair communicators and send/recv of
token slots.

A pair of ranks talks over a two-rank communicator of its own (gloo on CPU, NCCL between GPUs),
made on demand from the source rank's rendezvous store and independent of both instances' own
groups, so either instance can be replaced without touching the other. A channel is named
``"{source instance}.{rank}>{destination instance}.{rank}"``; when an instance is gone, its
peers drop every channel that names it (``drop_peer``), so replacements leave nothing behind.

A transfer names the token slots on each side, so blocks are addressed whole but only the
tokens that hold KV are sent: the bytes moved are exactly layers x 2 x tokens x heads x
head_dim x dtype size. It goes through two staging buffers of a fixed size per rank, a chunk of
at most ``STAGING_TOKENS`` tokens of one layer each, which the KV cache's memory budget sets
aside (``staging_bytes``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from distserve.kv_transfer.plan import KVLayout
from distserve.parallel.process_group import COLLECTIVE_TIMEOUT, create_store

# Tokens of one layer's K and V per staged chunk: big enough that a send is far longer than its
# call overhead, small enough that two chunks are a rounding error beside the KV cache.
STAGING_TOKENS = 4096


def staging_bytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype, chunk_tokens: int = STAGING_TOKENS) -> int:
    """Memory of a rank's two staging buffers: K and V of ``chunk_tokens`` tokens each."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * 2 * chunk_tokens * num_kv_heads * head_dim * element


def channel_peers(channel: str) -> tuple[str, str]:
    """The (source, destination) instance names of a channel."""
    source, destination = channel.split(">")
    return source.rpartition(".")[0], destination.rpartition(".")[0]


class KVTransfer:
    """One rank's end of its KV communicators: hosts a rendezvous store (as a source), joins
    pair communicators, and sends or receives the KV of given token slots.

    Transfers on a rank take turns through its one pair of staging buffers; the decode side pulls
    one request at a time anyway, and a source's link is shared by its transfers."""

    def __init__(self, kv_tensor: torch.Tensor, layout: KVLayout, chunk_tokens: int = STAGING_TOKENS) -> None:
        self.kv_tensor = kv_tensor  # the rank's cache, [layers, 2, slots, kv_heads, head_dim]
        self.layout = layout
        self.device = kv_tensor.device
        self.chunk_tokens = chunk_tokens
        self._store: dist.TCPStore | None = None
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._groups_lock = threading.Lock()  # guards _groups: joins and drops come from any thread
        self._transfer_lock = threading.Lock()  # one transfer at a time through the staging buffers
        self._buffers: list[torch.Tensor] = []

    def describe(self) -> KVLayout:
        return self.layout

    def store_address(self) -> tuple[str, int]:
        """The address of this rank's rendezvous store, opened on first use."""
        with self._groups_lock:
            if self._store is None:
                self._store = create_store(world_size=2)
            return self._store.host, self._store.port

    def connect(self, channel: str, is_source: bool, address: tuple[str, int]) -> None:
        """Join the two-rank communicator ``channel``; both ends call this at the same time."""
        if is_source:
            store = self._store
        else:
            store = dist.TCPStore(*address, 2, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        prefixed = dist.PrefixStore(f"kv/{channel}", store)
        rank = 0 if is_source else 1
        if self.device.type == "cuda":
            group = dist.ProcessGroupNCCL(prefixed, rank, 2)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, 2, COLLECTIVE_TIMEOUT)
        with self._groups_lock:
            self._groups[channel] = group

    def drop_peer(self, instance: str) -> list[str]:
        """Forget every channel to or from ``instance`` (it is gone); the channels dropped."""
        with self._groups_lock:
            dropped = [c for c in self._groups if instance in channel_peers(c)]
            groups = [self._groups.pop(c) for c in dropped]
        for group in groups:
            if hasattr(group, "abort"):  # NCCL holds device resources until its communicator is aborted
                group.abort()
        return dropped

    def peers(self) -> dict[str, object]:
        """What this rank holds for transfers: its channels and the bytes of its staging buffers."""
        with self._groups_lock:
            channels = sorted(self._groups)
        return {"channels": channels, "staging_bytes": sum(b.numel() * b.element_size() for b in self._buffers)}

    def _group(self, channel: str) -> dist.ProcessGroup:
        with self._groups_lock:
            return self._groups[channel]

    def send_probe(self, channel: str, num_bytes: int) -> int:
        """Send one contiguous tensor of ``num_bytes``: the raw speed of the pair's link."""
        self._group(channel).send([torch.empty(num_bytes, dtype=torch.uint8, device=self.device)], 1, 0).wait()
        return num_bytes

    def recv_probe(self, channel: str, num_bytes: int) -> int:
        self._group(channel).recv([torch.empty(num_bytes, dtype=torch.uint8, device=self.device)], 0, 0).wait()
        return num_bytes

    def _staging(self, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Staging buffer ``index`` (0 or 1) as a view of ``shape``. Allocated once, at their fixed
        size: fresh multi-MiB tensors cost more in page faults than the copy itself (measured 8x
        slower for a 64 MiB gather on CPU)."""
        if not self._buffers:
            heads, head_dim = self.kv_tensor.shape[3:]
            numel = 2 * self.chunk_tokens * heads * head_dim
            self._buffers = [torch.empty(numel, dtype=self.kv_tensor.dtype, device=self.device) for _ in range(2)]
        return self._buffers[index][: math.prod(shape)].view(shape)

    def _pieces(self, slots: list[int], layers: range, heads: range) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(``[2, slots, heads, head_dim]`` cache view of one layer, slot index of a chunk) in send order."""
        first_layer, first_head = self.layout.layers.start, self.layout.kv_heads.start
        head_slice = slice(heads.start - first_head, heads.stop - first_head)
        index = torch.tensor(slots, device=self.device)
        for layer in layers:
            view = self.kv_tensor[layer - first_layer, :, :, head_slice]
            for start in range(0, len(slots), self.chunk_tokens):
                yield view, index[start : start + self.chunk_tokens]

    def send(self, channel: str, slots: list[int], layers: range, heads: range) -> int:
        """Send the K and V of ``slots`` for ``layers`` x ``heads``; returns the bytes sent.

        A chunk at a time through the two staging buffers: gathering one chunk overlaps sending
        the previous one.
        """
        group = self._group(channel)
        pending = []
        num_bytes = 0
        with self._transfer_lock:
            for i, (view, index) in enumerate(self._pieces(slots, layers, heads)):
                if len(pending) == 2:
                    pending.pop(0).wait()  # the buffer this chunk reuses has gone out
                data = self._staging(i % 2, (2, len(index), *view.shape[2:]))
                torch.index_select(view, 1, index, out=data)
                pending.append(group.send([data], 1, i))
                num_bytes += data.numel() * data.element_size()
            for work in pending:
                work.wait()
        return num_bytes

    def recv(self, channel: str, slots: list[int], layers: range, heads: range) -> int:
        """Receive into ``slots`` what the source sends for ``layers`` x ``heads``; returns the bytes.

        The next chunk's receive is posted before this one is copied into the cache.
        """
        group = self._group(channel)
        pieces = list(self._pieces(slots, layers, heads))
        num_bytes = 0
        with self._transfer_lock:
            buffers = [self._staging(i % 2, (2, len(index), *view.shape[2:])) for i, (view, index) in enumerate(pieces)]
            works = [group.recv([buffers[i]], 0, i) for i in range(min(2, len(pieces)))]
            for i, (view, index) in enumerate(pieces):
                works[i].wait()
                view.index_copy_(1, index, buffers[i])
                num_bytes += buffers[i].numel() * buffers[i].element_size()
                if i + 2 < len(pieces):
                    works.append(group.recv([buffers[i + 2]], 0, i + 2))
        return num_bytes
