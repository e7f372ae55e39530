"""What a KV transport is: one way of moving the K and V of some token slots, layers and heads from a
source rank's cache to a destination rank's, over the channel the two ranks share.

A rank has one transport object of each kind its device can use (``transports.TRANSPORTS``), made
when its ``KVTransfer`` is, and each of its channels is served by one of them through a link (the
transport's per-channel state: a process group, the source's cache opened in this process, ...).
``KVTransfer`` does the rest: it tries its device's transports in order when a channel connects,
takes one transfer at a time per channel, digests what moved and compares the two ends, and drops
channels when a peer is gone. So a transport only moves bytes; a new one (NIXL, Mooncake) is one
module under ``transports/`` and one entry in ``TRANSPORTS``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist

from distserve.kv_transfer.plan import KVLayout
from distserve.kv_transfer.shared_memory import SharedFile

Link = TypeVar("Link")


@dataclass(frozen=True)
class RankKV:
    """A rank's KV cache as its transports see it. The cache is ``[layers, 2, slots, kv_heads,
    slot_width]`` of whatever element type the cache stores (an 8-bit cache's rows end in their
    scales): transports read shapes and dtypes from the tensor and move rows whole."""

    tensor: torch.Tensor
    layout: KVLayout  # the part of the model the cache holds
    chunk_tokens: int  # tokens of one layer's K or V a transport moves at once, at most
    shared: SharedFile | None  # on CPU, how another process maps ``tensor``
    in_place: bool  # whether this rank lets destinations read its cache in place, and reads so itself
    # One transfer at a time on this rank, whatever its transport: a transport holds it while it moves
    # bytes (a group's staging buffers are the rank's, and transfer plans count on it).
    lock: threading.Lock

    @property
    def device(self) -> torch.device:
        return self.tensor.device


class KVTransport(ABC, Generic[Link]):
    """One kind of link between two ranks, for every channel of a rank that it serves.

    ``connect`` runs at both ends at once and agrees, through the channel's store, on whether this
    transport serves the channel: both ends get a link, or both None (the next transport is tried;
    the last of a device's transports always connects). Then the source's ``send`` and the
    destination's ``recv`` run at once for each transfer, in the same order on a channel, and each
    returns the bytes it moved; an in-place transport's destination reads the source's cache itself
    (``in_place``), and its source's ``send`` moves nothing."""

    name: ClassVar[str]  # as pulls are counted by: "shm", "ipc", "gloo", "nccl"
    in_place: ClassVar[bool] = False  # the destination reads the source's cache where it lies

    def __init__(self, kv: RankKV) -> None:
        self.kv = kv

    @abstractmethod
    def connect(self, channel: str, is_source: bool, store: dist.Store) -> Link | None:
        """Both ends of ``channel``: its link, or None where this transport cannot serve it.
        ``store`` is the source rank's, under a prefix of this channel and transport, reached over
        a connection that no other channel waits on."""

    @abstractmethod
    def send(self, link: Link, slots: list[int], layers: range, heads: range, dst_slots: list[int]) -> int:
        """Source: send the K and V of ``slots`` for model ``layers`` x ``heads`` to the
        destination's ``dst_slots``; the bytes sent."""

    @abstractmethod
    def recv(self, link: Link, slots: list[int], layers: range, heads: range, src_slots: list[int]) -> int:
        """Destination: receive into ``slots`` the K and V of the source's ``src_slots`` for model
        ``layers`` x ``heads``; the bytes received, in ``slots`` once it returns."""

    @abstractmethod
    def probe(self, link: Link, buffer: torch.Tensor, send: bool, message_bytes: int) -> None:
        """Move ``buffer`` (a byte tensor on the rank's device) as raw bytes, in messages of
        ``message_bytes`` (0: one), to (``send``) or from the other end: the link's own speed, for
        benchmarks. Not called at an in-place source."""

    def close(self, link: Link) -> None:
        """Let go of a channel's link (its peer is gone): what it holds goes with it."""

    def staging_bytes(self) -> int:
        """Memory this transport holds for all of the rank's channels (staging buffers)."""
        return 0


def part(cache: torch.Tensor, layout: KVLayout, layers: range, heads: range) -> torch.Tensor:
    """The ``[layers, 2, slots, heads, slot_width]`` view of a rank's cache (holding ``layout``)
    for model ``layers`` x ``heads``."""
    first_layer, first_head = layout.layers.start, layout.kv_heads.start
    layer_slice = slice(layers.start - first_layer, layers.stop - first_layer)
    return cache[layer_slice, :, :, heads.start - first_head : heads.stop - first_head]
