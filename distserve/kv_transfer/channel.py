"""One rank's end of the KV transfers between instances: pair communicators and send/recv of
token slots.

A pair of ranks talks over a two-rank communicator of its own (gloo on CPU, NCCL between GPUs),
made on demand from the source rank's rendezvous store and independent of both instances' own
groups, so either instance can be replaced without touching the other.

A transfer names the token slots on each side, so blocks are addressed whole but only the
tokens that hold KV are sent: the bytes moved are exactly layers x 2 x tokens x heads x
head_dim x dtype size.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from distserve.kv_transfer.plan import KVLayout
from distserve.parallel.process_group import COLLECTIVE_TIMEOUT, create_store


class KVTransfer:
    """One rank's end of its KV communicators: hosts a rendezvous store (as a source), joins
    pair communicators, and sends or receives the KV of given token slots."""

    def __init__(self, kv_tensor: torch.Tensor, layout: KVLayout) -> None:
        self.kv_tensor = kv_tensor  # the rank's cache, [layers, 2, slots, kv_heads, head_dim]
        self.layout = layout
        self.device = kv_tensor.device
        self._store: dist.TCPStore | None = None
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._setup_lock = threading.Lock()

    def describe(self) -> KVLayout:
        return self.layout

    def store_address(self) -> tuple[str, int]:
        """The address of this rank's rendezvous store, opened on first use."""
        with self._setup_lock:
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
        self._groups[channel] = group
        self._locks[channel] = threading.Lock()

    def send_probe(self, channel: str, num_bytes: int) -> int:
        """Send one contiguous tensor of ``num_bytes``: the raw speed of the pair's link."""
        with self._locks[channel]:
            self._groups[channel].send([self._staging((channel, 0), (num_bytes,), torch.uint8)], 1, 0).wait()
        return num_bytes

    def recv_probe(self, channel: str, num_bytes: int) -> int:
        with self._locks[channel]:
            self._groups[channel].recv([self._staging((channel, 0), (num_bytes,), torch.uint8)], 0, 0).wait()
        return num_bytes

    def _staging(self, key: tuple[str, int], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer: fresh multi-MiB CPU tensors cost more in page faults than the copy
        itself (measured 8x slower for a 64 MiB gather)."""
        numel = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buffer[:numel].view(shape)

    def _layer_views(self, layers: range, heads: range) -> list[torch.Tensor]:
        """``[2, slots, heads, head_dim]`` views of the cache, one per layer."""
        first_layer, first_head = self.layout.layers.start, self.layout.kv_heads.start
        head_slice = slice(heads.start - first_head, heads.stop - first_head)
        return [self.kv_tensor[layer - first_layer, :, :, head_slice] for layer in layers]

    def send(self, channel: str, slots: list[int], layers: range, heads: range) -> int:
        """Send the K and V of ``slots`` for ``layers`` x ``heads``; returns the bytes sent.

        A layer at a time through two staging buffers: gathering one layer overlaps sending the
        previous one, and the buffers hold two layers, not the whole request.
        """
        index = torch.tensor(slots, device=self.device)
        views = self._layer_views(layers, heads)
        group = self._groups[channel]
        pending = []
        with self._locks[channel]:  # one transfer at a time per pair keeps sends and receives matched
            for i, view in enumerate(views):
                if len(pending) == 2:
                    pending.pop(0).wait()  # the buffer this layer reuses has gone out
                data = self._staging((channel, i % 2), (2, len(slots), *view.shape[2:]), view.dtype)
                torch.index_select(view, 1, index, out=data)
                pending.append(group.send([data], 1, i))
            for work in pending:
                work.wait()
        return _num_bytes(views, len(slots))

    def recv(self, channel: str, slots: list[int], layers: range, heads: range) -> int:
        """Receive into ``slots`` what the source sends for ``layers`` x ``heads``; returns the bytes.

        The next layer's receive is posted before this one is copied into the cache.
        """
        index = torch.tensor(slots, device=self.device)
        views = self._layer_views(layers, heads)
        group = self._groups[channel]
        buffers = [
            self._staging((channel, i % 2), (2, len(slots), *v.shape[2:]), v.dtype) for i, v in enumerate(views[:2])
        ]
        with self._locks[channel]:
            works = [group.recv([buffers[i]], 0, i) for i in range(len(buffers))]
            for i, view in enumerate(views):
                works[i].wait()
                view.index_copy_(1, index, buffers[i % 2])
                if i + 2 < len(views):
                    works.append(group.recv([buffers[i % 2]], 0, i + 2))
        return _num_bytes(views, len(slots))


def _num_bytes(views: list[torch.Tensor], num_slots: int) -> int:
    """K and V of ``num_slots`` tokens in each ``[2, slots, heads, head_dim]`` layer view."""
    return sum(2 * num_slots * view.shape[2] * view.shape[3] * view.element_size() for view in views)
