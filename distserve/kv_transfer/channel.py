"""One rank's end of the KV transfers between instances: pair communicators and send/recv of
token slots.

A pair of ranks talks over a channel of its own, made on demand from the source rank's
rendezvous store and independent of both instances' own groups, so either instance can be
replaced without touching the other. A channel is named ``"{source instance}.{rank}>{destination
instance}.{rank}"``; when an instance is gone, its peers drop every channel that names it
(``drop_peer``), so replacements leave nothing behind.

How a channel moves the KV: in place where the destination can read the source's cache, else a
two-rank group. Between CUDA ranks on one machine, CUDA IPC: the source publishes a handle to its
whole KV cache, the destination opens it on its own device and copies the slots it pulls straight
from the source's memory, GPU to GPU (through NVLink or PCIe peer access when the source's GPU is
another one). That is the fastest way within a node, and the only one when both instances share
one GPU: NCCL refuses two ranks on the same device. Between CPU ranks on one machine and one Ray
node, shared memory: the source's cache lives in an anonymous memory file (``shared_memory``), it
publishes ``/proc/<pid>/fd/<fd>``, and the destination maps the file and copies the slots out of
it. Ray nodes sharing a machine count as different machines, so that they move KV as a multi-node
deployment does. A two-rank NCCL group serves CUDA ranks on different machines, a gloo group CPU
ranks on different Ray nodes, and either serves where the source's cache cannot be opened (no peer
access between the GPUs, another container's memory or processes) or an end is told to use a
group only (``cache.kv_transport: group``). The two ends agree on the choice through the store
when they connect.

A transfer names the token slots on each side, so blocks are addressed whole but only the
tokens that hold KV are moved: the bytes are exactly layers x 2 x tokens x heads x head_dim x
dtype size. Over a group it goes as messages of one layer's K or V for at most ``chunk_tokens``
tokens each (``message_tokens``: about 1 MiB over gloo, 4,096 tokens over NCCL). Both ends cut the
same messages from both sides' slots (``message_spans``): a long run of tokens whose slots are
consecutive on both sides goes straight out of the source's cache and into the destination's;
short runs are packed into one message, gathered into a staging buffer on one side and scattered
out of one on the other. Each side stages a run too where its part of the heads is not all of its
cache's (tensor-parallel degrees that differ). The two staging buffers of a rank, one message
each, come out of the KV cache's memory budget (``staging_bytes``). In place, on CUDA one kernel
copies every layer's slots straight from the source's cache into the destination's
(``slot_copy``), without Triton a layer and a chunk at a time through at most one such chunk of
temporary memory; on CPU each run of slots consecutive on both sides (a block or more) is one copy
over every layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import pickle
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from distserve.kv_transfer.checksum import KVChecksumMismatch, kv_digest
from distserve.kv_transfer.plan import KVEndpoint, KVLayout
from distserve.kv_transfer.shared_memory import SharedFile
from distserve.kv_transfer.slot_copy import copy_slot_runs, copy_slots
from distserve.parallel.process_group import COLLECTIVE_TIMEOUT, create_store

logger = logging.getLogger(__name__)

# A posted send or receive: its work, the staging buffer it uses (None: straight from or into the
# cache), and what to do once it is done (a received staged message's scatter into the cache).
Pending = tuple[dist.Work, int | None, Callable[[], object] | None]

# Cold probes of the raw link cycle through this much memory: several times a server CPU's L3.
PROBE_POOL_BYTES = 256 << 20

# How a channel moves the KV, by device: in place (the destination reads the source's cache), or
# over a two-rank group.
TRANSPORTS = {"cuda": ("ipc", "nccl"), "cpu": ("shm", "gloo")}

# One message over gloo: TCP on loopback moved 8-64 MiB fastest in messages of 1-2 MiB, 1.5-2x as
# fast as in one send (the sender's writes and the receiver's reads overlap).
GLOO_MESSAGE_BYTES = 1 << 20
# Tokens of one layer's K or V per message over NCCL, whose per-call cost wants long messages.
NCCL_MESSAGE_TOKENS = 4096


def message_tokens(num_kv_heads: int, head_dim: int, dtype: torch.dtype, device_type: str) -> int:
    """Tokens of one layer's K or V per message over a rank's groups."""
    if device_type == "cuda":
        return NCCL_MESSAGE_TOKENS
    token_bytes = num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return max(1, GLOO_MESSAGE_BYTES // token_bytes)


def staging_bytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype, chunk_tokens: int) -> int:
    """Memory of a rank's two staging buffers: one message of ``chunk_tokens`` tokens each."""
    return 2 * chunk_tokens * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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


def channel_peers(channel: str) -> tuple[str, str]:
    """The (source, destination) instance names of a channel."""
    source, destination = channel.split(">")
    return source.rpartition(".")[0], destination.rpartition(".")[0]


def machine_key() -> str:
    """Names this machine and this boot of it: CUDA IPC handles and /proc paths mean something only there."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def ray_node() -> str:
    """This process's Ray node id; empty outside Ray."""
    import ray  # only channels ask: an engine alone never loads Ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


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


@dataclass
class IpcPeer:
    """A channel that reads the source's cache in place (CUDA IPC, or shared memory on CPU). The
    destination's end holds the source's whole KV cache, opened on its own device, and the part of
    the model it holds; the source's end holds nothing (None)."""

    tensor: torch.Tensor | None
    layout: KVLayout | None


# The caches of this process's sources by token: CUDA cannot open an IPC handle in the process
# that made it, so a destination in the same process reads the tensor itself (on CPU too: cheaper).
_CACHES_IN_PROCESS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


class KVTransfer:
    """One rank's end of its KV communicators: hosts a rendezvous store (as a source), joins
    pair communicators, and sends or receives the KV of given token slots.

    Transfers on a rank take turns through its one pair of staging buffers; the decode side pulls
    one request at a time anyway, and a source's link is shared by its transfers.

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
        self.kv_tensor = kv_tensor  # the rank's cache, [layers, 2, slots, kv_heads, head_dim]
        self.layout = layout
        self.device = kv_tensor.device
        heads, head_dim = kv_tensor.shape[3:]
        self.chunk_tokens = chunk_tokens or message_tokens(heads, head_dim, kv_tensor.dtype, self.device.type)
        self.shared = shared
        self.in_place = in_place
        self.checksum = checksum
        self._in_place_transport, self._group_transport = TRANSPORTS[self.device.type]
        self._store: dist.TCPStore | None = None
        self._groups: dict[str, dist.ProcessGroup | IpcPeer] = {}
        self._groups_lock = threading.Lock()  # guards _groups: joins and drops come from any thread
        self._transfer_lock = threading.Lock()  # one transfer at a time through the staging buffers
        # One pull at a time on each channel: a group matches messages by tag, so two transfers on it
        # must go in the same order at both ends, which the destination keeps by driving both.
        self._channel_locks: dict[str, threading.Lock] = {}
        self._buffers: list[torch.Tensor] = []
        self._probe_buffer: torch.Tensor | None = None  # the raw link's probes (benchmarks)
        self._probe_offset = 0  # where the next cold probe starts in it
        self._token = uuid.uuid4().hex  # names this cache to a destination in the same process
        self._copy_stream: torch.cuda.Stream | None = None  # IPC pulls: beside the steps' stream

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
        group: dist.ProcessGroup | IpcPeer | None
        if is_source:
            # A wait on a store object holds it from every other thread until it ends: the
            # source's handshake waits over a connection of its own, not the rank's shared one.
            own = dist.TCPStore(*address, 2, is_master=False, timeout=COLLECTIVE_TIMEOUT)
            group = self._ipc_source(dist.PrefixStore(f"kv/{channel}", own))
        else:
            group = self._ipc_destination(channel, prefixed)
        if group is None:
            rank = 0 if is_source else 1
            if self.device.type == "cuda":
                group = dist.ProcessGroupNCCL(prefixed, rank, 2)
            else:
                group = dist.ProcessGroupGloo(prefixed, rank, 2, COLLECTIVE_TIMEOUT)
        with self._groups_lock:
            self._groups[channel] = group

    # The handshake, keys under the channel's prefix: the source sets "ipc/source" (where it is,
    # whether it publishes its cache, process, token, layout); the destination answers "ipc/reply":
    # the group's transport ("nccl" or "gloo": elsewhere, or either end reads over a group only),
    # "local" (same process: it takes the tensor itself) or "handle"; to "handle" the source sets
    # "ipc/handle" (its cache reduced for CUDA IPC, or its shared memory file) and the destination
    # sets "ipc/mode" to the in-place transport ("ipc" or "shm") if it opened it, else the group's.
    # The source deletes the keys once it has its answer, so a channel connected again under the
    # same name starts afresh.
    _IPC_KEYS = ("ipc/source", "ipc/reply", "ipc/handle", "ipc/mode")

    def _publishes(self) -> bool:
        """Whether this rank, as a source, lets a destination read its cache in place."""
        return self.in_place and (self.device.type == "cuda" or self.shared is not None)

    def _place(self) -> str:
        """Where a destination must be to read this rank's cache in place: on the same machine and
        boot (a CUDA IPC handle or a /proc path means nothing elsewhere); on CPU also on the same
        Ray node, so that Ray nodes sharing a machine move KV as separate machines do."""
        return machine_key() if self.device.type == "cuda" else f"{machine_key()}/{ray_node()}"

    def _ipc_source(self, store: dist.Store) -> IpcPeer | None:
        """The source's half of the handshake: a channel read in place, or None for a group."""
        publishes = self._publishes()
        if publishes:
            _CACHES_IN_PROCESS[self._token] = self.kv_tensor
        source = {
            "place": self._place(),
            "publishes": publishes,
            "pid": os.getpid(),
            "token": self._token,
            "layout": self.layout,
        }
        try:
            store.set("ipc/source", pickle.dumps(source))
            reply = store.get("ipc/reply").decode()
            if reply == "handle":
                # Reduced per destination: each one releases its own reference when it drops the channel.
                handle = reduce_tensor(self.kv_tensor) if self.device.type == "cuda" else self.shared
                store.set("ipc/handle", pickle.dumps(handle))
                reply = store.get("ipc/mode").decode()
        finally:
            for key in self._IPC_KEYS:
                store.delete_key(key)
        return IpcPeer(None, None) if reply in ("local", self._in_place_transport) else None

    def _ipc_destination(self, channel: str, store: dist.Store) -> IpcPeer | None:
        """The destination's half of the handshake: the source's cache opened, or None for a group."""
        source = pickle.loads(store.get("ipc/source"))
        apart = self._apart(source)
        if apart:
            logger.info("KV channel %s over %s: %s", channel, self._group_transport, apart)
            store.set("ipc/reply", self._group_transport)
            return None
        # The same pid with a token unknown here is another container's process: it takes the handle.
        if source["pid"] == os.getpid() and (tensor := _CACHES_IN_PROCESS.get(source["token"])) is not None:
            local = tensor.device == self.device  # on another device of this process NCCL serves
            store.set("ipc/reply", "local" if local else self._group_transport)
            return IpcPeer(tensor, source["layout"]) if local else None
        store.set("ipc/reply", "handle")
        handle = store.get("ipc/handle")
        try:
            tensor = self._open(pickle.loads(handle))
        except Exception:  # no peer access between the GPUs, another container's memory, permissions
            logger.warning(
                "KV channel %s: could not open the source's KV cache in place: using %s",
                channel,
                self._group_transport,
                exc_info=True,
            )
            tensor = None
        store.set("ipc/mode", self._group_transport if tensor is None else self._in_place_transport)
        return None if tensor is None else IpcPeer(tensor, source["layout"])

    def _apart(self, source: dict) -> str:
        """Why the destination cannot read ``source``'s cache in place; empty if it may try."""
        if not self.in_place:
            return "this end reads over a group only"
        if not source["publishes"]:
            return "the source does not publish its cache"
        if source["place"] != self._place():
            return "the source is on another machine" + ("" if self.device.type == "cuda" else " or Ray node")
        return ""

    def _open(self, handle: SharedFile | tuple[Callable[..., torch.Tensor], tuple]) -> torch.Tensor:
        """The source's cache from what it published, mapped into this process."""
        if self.device.type == "cpu":
            if not isinstance(handle, SharedFile):
                raise ValueError(f"not a shared memory file: {handle!r}")
            return handle.open()
        return self._open_cuda(*handle)

    def _open_cuda(self, rebuild: Callable[..., torch.Tensor], args: tuple) -> torch.Tensor:
        """The source's cache from its reduced handle, opened on this rank's device.

        The handle carries the source's device index, which means another GPU or none at all in
        this process when the two see different devices (each Ray actor sees only its own). CUDA
        maps the memory into the device it is opened on, reaching the source's GPU by peer access
        if it is another, so it is opened on this rank's device and the copies run here."""
        if rebuild is not rebuild_cuda_tensor:
            raise ValueError(f"not a CUDA tensor handle: {rebuild}")
        bound = inspect.signature(rebuild).bind(*args)
        bound.arguments["storage_device"] = self.device.index
        # Opening waits for the source's event on the current stream: make it the one the copies use.
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream()):
            return rebuild(*bound.args, **bound.kwargs)

    def _stream(self) -> torch.cuda.Stream:
        """The stream of IPC copies: a decode step on the default stream neither waits for them nor
        they for it (the blocks they fill are no step's yet)."""
        with self._groups_lock:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            return self._copy_stream

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Where in-place copies run, done when it exits: on CUDA on the IPC stream, waited for; on
        CPU on this thread."""
        if self.device.type != "cuda":
            yield
            return
        stream = self._stream()
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

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
        with self._groups_lock:
            return self._channel_locks.setdefault(channel, threading.Lock())

    def _has(self, channel: str) -> bool:
        with self._groups_lock:
            return channel in self._groups

    def transport(self, channel: str) -> str:
        """How ``channel`` moves the KV: "ipc" or "shm" (in place), "nccl" or "gloo" (a group)."""
        in_place = isinstance(self._group(channel), IpcPeer)
        return self._in_place_transport if in_place else self._group_transport

    def drop_peer(self, instance: str) -> list[str]:
        """Forget every channel to or from ``instance`` (it is gone); the channels dropped."""
        with self._groups_lock:
            dropped = [c for c in self._groups if instance in channel_peers(c)]
            groups = [self._groups.pop(c) for c in dropped]
            for c in [c for c in self._channel_locks if instance in channel_peers(c)]:
                del self._channel_locks[c]
        for group in groups:
            # NCCL holds device resources until its communicator is aborted; an in-place peer's
            # mapping of the source's cache goes with the last reference to its tensor, here.
            if hasattr(group, "abort"):
                group.abort()
        return dropped

    def peers(self) -> dict[str, object]:
        """What this rank holds for transfers: its channels and the bytes of its staging buffers."""
        with self._groups_lock:
            channels = sorted(self._groups)
        return {"channels": channels, "staging_bytes": sum(b.numel() * b.element_size() for b in self._buffers)}

    def _group(self, channel: str) -> dist.ProcessGroup | IpcPeer:
        with self._groups_lock:
            return self._groups[channel]

    def send_probe(self, channel: str, num_bytes: int, message_bytes: int = 0, cold: bool = False) -> int:
        """Send one contiguous tensor of ``num_bytes``: the raw speed of the pair's link. In
        messages of ``message_bytes`` posted at once (0: one message); ``cold``: from memory no
        recent probe touched, as a KV transfer reads and writes (``_probe``)."""
        group = self._group(channel)
        if not isinstance(group, IpcPeer):  # in place the destination reads
            pieces = _pieces(self._probe(num_bytes, cold), message_bytes)
            _drain([(group.send([piece], 1, tag), None, None) for tag, piece in pieces])
        return num_bytes

    def recv_probe(self, channel: str, num_bytes: int, message_bytes: int = 0, cold: bool = False) -> int:
        group = self._group(channel)
        if not isinstance(group, IpcPeer):
            pieces = _pieces(self._probe(num_bytes, cold), message_bytes)
            _drain([(group.recv([piece], 0, tag), None, None) for tag, piece in pieces])
            return num_bytes
        # One contiguous copy out of the source's cache (again from its start past its end).
        source = group.tensor.view(-1).view(torch.uint8)
        with self._copying():
            buffer = self._probe(num_bytes, cold)
            for start in range(0, num_bytes, source.numel()):
                piece = buffer[start : start + source.numel()]
                piece.copy_(source[: piece.numel()])
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
        if not cold:
            return self._probe_buffer[:num_bytes]
        if self._probe_offset + num_bytes > self._probe_buffer.numel():
            self._probe_offset = 0
        start, self._probe_offset = self._probe_offset, self._probe_offset + num_bytes
        return self._probe_buffer[start : start + num_bytes]

    def _staging(self, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Staging buffer ``index`` (0 or 1) as a view of ``shape``. Allocated once, at their fixed
        size: fresh multi-MiB tensors cost more in page faults than the copy itself (measured 8x
        slower for a 64 MiB gather on CPU)."""
        if not self._buffers:
            heads, head_dim = self.kv_tensor.shape[3:]
            numel = self.chunk_tokens * heads * head_dim
            self._buffers = [torch.empty(numel, dtype=self.kv_tensor.dtype, device=self.device) for _ in range(2)]
        return self._buffers[index][: math.prod(shape)].view(shape)

    def _messages(
        self, slots: list[int], src_slots: list[int], dst_slots: list[int], layers: range, heads: range
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """This side's messages in order: (the cache's slots of one message as a contiguous view,
        None) where it is sent or received in place, else (the ``[slots, heads, head_dim]`` view of
        one layer's K or V, the message's slot index into it) to go through a staging buffer."""
        first_layer, first_head = self.layout.layers.start, self.layout.kv_heads.start
        head_slice = slice(heads.start - first_head, heads.stop - first_head)
        whole = len(heads) == self.kv_tensor.shape[3]  # a run's slots are contiguous memory
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        spans = message_spans(src_slots, dst_slots, self.chunk_tokens)
        for layer in layers:
            for kv in range(2):
                view = self.kv_tensor[layer - first_layer, kv, :, head_slice]
                for start, stop, run in spans:
                    if run and whole:
                        yield view[slots[start] : slots[start] + stop - start], None
                    else:
                        yield view, index[start:stop]

    def send(self, channel: str, slots: list[int], layers: range, heads: range, dst_slots: list[int]) -> Moved:
        """Send the K and V of ``slots`` for ``layers`` x ``heads`` (to the destination's
        ``dst_slots``); returns the bytes sent and their digest.

        Messages in place are all posted at once; a staged one waits for its buffer's last send,
        so gathering one overlaps sending the other. In place the destination reads them itself;
        the bytes are the same.
        """
        group = self._group(channel)
        if isinstance(group, IpcPeer):
            return self._moved(slots, layers, heads, in_place=True)
        num_bytes = 0
        with self._transfer_lock:
            pending: list[Pending] = []
            staged = 0
            for tag, (view, index) in enumerate(self._messages(slots, slots, dst_slots, layers, heads)):
                data = view
                if index is not None:
                    buffer, staged = staged % 2, staged + 1
                    _drain(pending, buffer)
                    data = self._staging(buffer, (len(index), *view.shape[1:]))
                    torch.index_select(view, 0, index, out=data)
                pending.append((group.send([data], 1, tag), None if index is None else buffer, None))
                num_bytes += data.numel() * data.element_size()
            _drain(pending)
        return self._moved(slots, layers, heads, num_bytes=num_bytes)

    def recv(self, channel: str, slots: list[int], layers: range, heads: range, src_slots: list[int]) -> Moved:
        """Receive into ``slots`` what the source sends of its ``src_slots`` for ``layers`` x
        ``heads``; returns the bytes and the digest of what is now in ``slots``. In place it copies
        them out of the source's cache itself.

        Messages in place are all posted at once; a staged one is scattered into the cache once
        it is in, before its buffer takes another.
        """
        group = self._group(channel)
        if isinstance(group, IpcPeer):
            if len(src_slots) != len(slots):
                raise ValueError("a channel in place needs the source's slots, as many as the destination's")
            return self._pull(group, src_slots, slots, layers, heads)
        num_bytes = 0
        with self._transfer_lock:
            pending: list[Pending] = []
            staged = 0
            for tag, (view, index) in enumerate(self._messages(slots, src_slots, slots, layers, heads)):
                data, scatter, buffer = view, None, None
                if index is not None:
                    buffer, staged = staged % 2, staged + 1
                    _drain(pending, buffer)
                    data = self._staging(buffer, (len(index), *view.shape[1:]))
                    scatter = functools.partial(view.index_copy_, 0, index, data)
                pending.append((group.recv([data], 0, tag), buffer, scatter))
                num_bytes += data.numel() * data.element_size()
            _drain(pending)
        return self._moved(slots, layers, heads, num_bytes=num_bytes)

    def _pull(self, peer: IpcPeer, src_slots: list[int], slots: list[int], layers: range, heads: range) -> Moved:
        """Copy the source's ``src_slots`` into ``slots``, every layer at once (``slot_copy``: on
        CUDA GPU to GPU in one gather-scatter, on CPU a run of consecutive slots at a time); back
        once the copies are done, since the source may reuse its blocks as soon as the pull is
        reported."""
        assert peer.tensor is not None and peer.layout is not None  # a destination's end
        here, there = _part(self.kv_tensor, self.layout, layers, heads), _part(peer.tensor, peer.layout, layers, heads)
        with self._transfer_lock, self._copying():
            if self.device.type == "cpu":
                copy_slot_runs(here, slots, there, src_slots)
            else:
                # Through NumPy: torch.tensor of a list of Python ints is 3-4x slower, which was as
                # long as the copy itself for thousands of tokens.
                index, src_index = torch.from_numpy(np.array((slots, src_slots), dtype=np.int64)).to(self.device)
                copy_slots(here, index, there, src_index, self.chunk_tokens)
        return self._moved(slots, layers, heads, in_place=True)

    def _moved(
        self, slots: list[int], layers: range, heads: range, num_bytes: int | None = None, in_place: bool = False
    ) -> Moved:
        """The K and V of ``slots`` for ``layers`` x ``heads``: their bytes (``num_bytes`` where the
        messages counted them) and, where this transfer is checked, their digest as the cache holds
        them (``in_place``: the destination reads the source's cache itself)."""
        if num_bytes is None:
            head_dim = self.kv_tensor.shape[4]
            num_bytes = len(layers) * 2 * len(slots) * len(heads) * head_dim * self.kv_tensor.element_size()
        if self.checksum == "off" or (self.checksum == "auto" and in_place):
            return Moved(num_bytes)
        # On the current stream, which a group's received messages were waited on and in-place
        # copies were synchronized with already.
        return Moved(num_bytes, kv_digest(_part(self.kv_tensor, self.layout, layers, heads), slots))


def _pieces(buffer: torch.Tensor, piece_numel: int) -> list[tuple[int, torch.Tensor]]:
    """``buffer`` cut into pieces of ``piece_numel`` elements (0: whole), with their tags."""
    return list(enumerate(buffer.split(piece_numel or buffer.numel())))


def _drain(pending: list[Pending], buffer: int | None = None) -> None:
    """Complete the oldest of ``pending`` until staging ``buffer`` is free, or all of them."""
    while pending and (buffer is None or any(entry[1] == buffer for entry in pending)):
        work, _, then = pending.pop(0)
        work.wait()
        if then is not None:
            then()


def _part(cache: torch.Tensor, layout: KVLayout, layers: range, heads: range) -> torch.Tensor:
    """The ``[layers, 2, slots, heads, head_dim]`` view of a rank's cache (holding ``layout``) for
    model ``layers`` x ``heads``."""
    first_layer, first_head = layout.layers.start, layout.kv_heads.start
    layer_slice = slice(layers.start - first_layer, layers.stop - first_layer)
    return cache[layer_slice, :, :, heads.start - first_head : heads.stop - first_head]
