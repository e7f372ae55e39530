"""One rank's end of the KV transfers between instances: its channels, and send/recv of token slots
over them.

A pair of ranks talks over a channel of its own, made on demand from the source rank's rendezvous
store and independent of both instances' own groups, so either instance can be replaced without
touching the other. A channel is named ``"{source instance}.{rank}>{destination
instance}.{rank}"``; when an instance is gone, its peers drop every channel that names it
(``drop_peer``), so replacements leave nothing behind.

A transport moves a channel's KV (``transport.py``; one module each under ``transports/``): in
place where the destination can read the source's cache (CUDA IPC between GPUs of one machine,
shared memory between CPU processes of one Ray node), else a two-rank group (NCCL, gloo). The two
ends agree on which when they connect, trying their device's transports in order
(``transports.TRANSPORTS``). What every transport shares is here: the channels and their locks,
the digests of what each end moved and their comparison (``Moved``), and the destination's
``pull``, which drives both ends. A transfer names the token slots on each side, so blocks are
addressed whole but only the tokens that hold KV are moved: the bytes are exactly layers x 2 x
tokens x heads x slot width x element size.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distserve.kv_transfer.checksum import KVChecksumMismatch, kv_digest
from distserve.kv_transfer.plan import KVEndpoint, KVLayout
from distserve.kv_transfer.shared_memory import SharedFile
from distserve.kv_transfer.transport import KVTransport, RankKV, part
from distserve.kv_transfer.transports import TRANSPORTS
from distserve.kv_transfer.transports.group import (
    GLOO_MESSAGE_BYTES,
    NCCL_MESSAGE_TOKENS,
    message_tokens,
    staging_bytes,
)
from distserve.parallel.process_group import COLLECTIVE_TIMEOUT, create_store

# The group's message sizes and staging are read from here too, by the KV cache's budget and the benchmarks.
__all__ = [
    "GLOO_MESSAGE_BYTES",
    "NCCL_MESSAGE_TOKENS",
    "KVTransfer",
    "Moved",
    "channel_peers",
    "message_tokens",
    "staging_bytes",
]

# Cold probes of the raw link cycle through this much memory: several times a server CPU's L3.
PROBE_POOL_BYTES = 256 << 20


def channel_peers(channel: str) -> tuple[str, str]:
    """The (source, destination) instance names of a channel."""
    source, destination = channel.split(">")
    return source.rpartition(".")[0], destination.rpartition(".")[0]


@dataclass(frozen=True)
class Moved:
    """What one end of a transfer moved: its bytes, and the digest of the KV it sent or received
    (``checksum``), empty where transfers are not checked."""

    num_bytes: int
    digest: str = ""
    transport: str = ""  # a destination's pull: how the channel moved it ("shm", "gloo", ...)

    def agrees(self, other: Moved) -> bool:
        """Whether the two ends of a transfer moved the same KV, as far as both checked it (pools
        may be told apart which pulls to check)."""
        return not (self.digest and other.digest) or self.digest == other.digest


class KVTransfer:
    """One rank's end of its KV channels: hosts a rendezvous store (as a source), connects
    channels, and sends or receives the KV of given token slots.

    Transfers on a rank take turns (``RankKV.lock``): a group's go through the rank's one pair of
    staging buffers, and a source's link is shared by its transfers.

    ``in_place``: read a source's cache in place where both ends can (else always a group).
    ``shared``: on CPU, how another process maps this rank's cache; without it the cache is read
    over gloo only. ``checksum``: which transfers each end digests the KV of (``checksum``), for the
    puller to compare: "auto" those over a group, "on" all, "off" none."""

    def __init__(
        self,
        kv_tensor: torch.Tensor,
        layout: KVLayout,
        chunk_tokens: int | None = None,
        shared: SharedFile | None = None,
        in_place: bool = True,
        checksum: str = "auto",
    ) -> None:
        self.kv_tensor = kv_tensor  # the rank's cache, [layers, 2, slots, kv_heads, slot_width]
        self.layout = layout
        self.device = kv_tensor.device
        heads, width = kv_tensor.shape[3:]
        self.chunk_tokens = chunk_tokens or message_tokens(heads, width, kv_tensor.dtype, self.device.type)
        self.checksum = checksum
        kv = RankKV(kv_tensor, layout, self.chunk_tokens, shared, in_place, threading.Lock())
        self._transports = [transport(kv) for transport in TRANSPORTS[self.device.type]]
        self._store: dist.TCPStore | None = None
        self._channels: dict[str, tuple[KVTransport, object]] = {}  # each channel's transport and link
        self._channels_lock = threading.Lock()  # guards _channels: joins and drops come from any thread
        # One pull at a time on each channel: a group matches messages by tag, so two transfers on it
        # must go in the same order at both ends, which the destination keeps by driving both.
        self._channel_locks: dict[str, threading.Lock] = {}
        self._probe_buffer: torch.Tensor | None = None  # the raw link's probes (benchmarks)
        self._probe_offset = 0  # where the next cold probe starts in it

    def describe(self) -> KVLayout:
        return self.layout

    def store_address(self) -> tuple[str, int]:
        """The address of this rank's rendezvous store, opened on first use."""
        with self._channels_lock:
            if self._store is None:
                self._store = create_store(world_size=2)
            return self._store.host, self._store.port

    def connect(self, channel: str, is_source: bool, address: tuple[str, int]) -> None:
        """Connect ``channel`` over the first of the device's transports that both ends can use;
        both ends call this at the same time."""
        # A wait on a store object holds it from every other thread until it ends: each end meets
        # the other over a connection of its own, not the source rank's shared one.
        store = dist.TCPStore(*address, 2, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        for transport in self._transports:
            link = transport.connect(channel, is_source, dist.PrefixStore(f"kv/{channel}/{transport.name}", store))
            if link is not None:
                break
        else:
            raise RuntimeError(f"no KV transport connected {channel}")  # the last one always does
        with self._channels_lock:
            self._channels[channel] = (transport, link)

    def pull(
        self, channel: str, source: KVEndpoint, slots: list[int], layers: range, heads: range, src_slots: list[int]
    ) -> Moved:
        """Destination: pull the source rank's ``src_slots`` into ``slots`` for ``layers`` x
        ``heads`` over ``channel``, joining it with the source first if new, and check that what
        arrived is what was sent (raises KVChecksumMismatch where both ends digested it)."""
        import ray  # only a rank inside Ray pulls: tests move KV between bare processes too

        with self._channel_lock(channel):
            if not self._has(channel):
                address = ray.get(source.call("store_address"))
                joined = source.call("connect", channel, True, address)
                self.connect(channel, False, address)
                ray.get(joined)
            sent = source.call("send", channel, src_slots, layers, heads, slots)
            received = self.recv(channel, slots, layers, heads, src_slots)
            sent = ray.get(sent)
        if not sent.agrees(received):
            raise KVChecksumMismatch(f"the KV received over {channel} is not what was sent")
        return dataclasses.replace(received, transport=self.transport(channel))

    def _channel_lock(self, channel: str) -> threading.Lock:
        with self._channels_lock:
            return self._channel_locks.setdefault(channel, threading.Lock())

    def _has(self, channel: str) -> bool:
        with self._channels_lock:
            return channel in self._channels

    def _link(self, channel: str) -> tuple[KVTransport, object]:
        with self._channels_lock:
            return self._channels[channel]

    def transport(self, channel: str) -> str:
        """How ``channel`` moves the KV: "ipc" or "shm" (in place), "nccl" or "gloo" (a group)."""
        return self._link(channel)[0].name

    def drop_peer(self, instance: str) -> list[str]:
        """Forget every channel to or from ``instance`` (it is gone); the channels dropped."""
        with self._channels_lock:
            dropped = [c for c in self._channels if instance in channel_peers(c)]
            links = [self._channels.pop(c) for c in dropped]
            for c in [c for c in self._channel_locks if instance in channel_peers(c)]:
                del self._channel_locks[c]
        for transport, link in links:
            transport.close(link)  # an in-place link's mapping of the source's cache goes with it, here
        return dropped

    def peers(self) -> dict[str, object]:
        """What this rank holds for transfers: its channels and the bytes of its staging buffers."""
        with self._channels_lock:
            channels = sorted(self._channels)
        return {"channels": channels, "staging_bytes": sum(t.staging_bytes() for t in self._transports)}

    def send_probe(self, channel: str, num_bytes: int, message_bytes: int = 0, cold: bool = False) -> int:
        """Send one contiguous tensor of ``num_bytes``: the raw speed of the pair's link. In
        messages of ``message_bytes`` posted at once (0: one message); ``cold``: from memory no
        recent probe touched, as a KV transfer reads and writes (``_probe``)."""
        transport, link = self._link(channel)
        if not transport.in_place:  # in place the destination reads
            transport.probe(link, self._probe(num_bytes, cold), True, message_bytes)
        return num_bytes

    def recv_probe(self, channel: str, num_bytes: int, message_bytes: int = 0, cold: bool = False) -> int:
        transport, link = self._link(channel)
        transport.probe(link, self._probe(num_bytes, cold), False, message_bytes)
        return num_bytes

    def _probe(self, num_bytes: int, cold: bool = False) -> torch.Tensor:
        """The probes' buffer, kept from one to the next and written once when made: on CPU a fresh
        one's page faults were most of a probe's time (off the main thread glibc maps a fresh
        128 MiB buffer anew each time: filling one took 110 ms, filling a kept one 16 ms).

        A warm probe reuses its start, which may stay in the CPU's cache when small (on the machine
        measured, warm and cold 8 MiB probes took alike). A cold one takes the next
        ``num_bytes`` of a buffer of at least ``PROBE_POOL_BYTES``, as a KV transfer moves KV that
        no step touched since it was written."""
        size = max(num_bytes, PROBE_POOL_BYTES) if cold else num_bytes
        if self._probe_buffer is None or self._probe_buffer.numel() < size:
            self._probe_buffer = torch.zeros(size, dtype=torch.uint8, device=self.device)
            self._probe_offset = 0
            if self.device.type == "cuda":  # zeroed on this stream: a transport may copy on its own
                torch.cuda.synchronize(self.device)
        if not cold:
            return self._probe_buffer[:num_bytes]
        if self._probe_offset + num_bytes > self._probe_buffer.numel():
            self._probe_offset = 0
        start, self._probe_offset = self._probe_offset, self._probe_offset + num_bytes
        return self._probe_buffer[start : start + num_bytes]

    def send(self, channel: str, slots: list[int], layers: range, heads: range, dst_slots: list[int]) -> Moved:
        """Send the K and V of ``slots`` for ``layers`` x ``heads`` (to the destination's
        ``dst_slots``); returns the bytes sent and their digest. In place the destination reads
        them itself; the bytes are the same."""
        transport, link = self._link(channel)
        num_bytes = transport.send(link, slots, layers, heads, dst_slots)
        return self._moved(slots, layers, heads, num_bytes=num_bytes, in_place=transport.in_place)

    def recv(self, channel: str, slots: list[int], layers: range, heads: range, src_slots: list[int]) -> Moved:
        """Receive into ``slots`` what the source sends of its ``src_slots`` for ``layers`` x
        ``heads``; returns the bytes and the digest of what is now in ``slots``. In place it copies
        them out of the source's cache itself."""
        transport, link = self._link(channel)
        num_bytes = transport.recv(link, slots, layers, heads, src_slots)
        return self._moved(slots, layers, heads, num_bytes=num_bytes, in_place=transport.in_place)

    def _moved(self, slots: list[int], layers: range, heads: range, num_bytes: int, in_place: bool) -> Moved:
        """The K and V of ``slots`` for ``layers`` x ``heads``: their bytes and, where this transfer
        is checked, their digest as the cache holds them (``in_place``: the destination read the
        source's cache itself)."""
        if self.checksum == "off" or (self.checksum == "auto" and in_place):
            return Moved(num_bytes)
        # On the current stream, which a group's received messages were waited on and in-place
        # copies were synchronized with already.
        return Moved(num_bytes, kv_digest(part(self.kv_tensor, self.layout, layers, heads), slots))
