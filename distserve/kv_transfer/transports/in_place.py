"""What the in-place transports share: the destination reads the source's cache where it lies.

The source publishes where its whole KV cache is (``_handle``: a CUDA IPC handle, a shared memory
file); a destination that can open it (``_open``) maps it into its process and copies the slots it
pulls straight out of it (``_copy``), so the source sends nothing. A handle means something only
on the source's machine (``_place``), and in the source's own process nothing needs opening: there
the destination takes the tensor itself (CUDA cannot open an IPC handle in the process that made
it; on CPU it is just cheaper). Where the destination cannot read the cache (another place, no
peer access between GPUs, another container's memory, an end that reads over a group only), both
ends say so through the store and the channel's next transport serves it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import uuid
import weakref
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distserve.kv_transfer.plan import KVLayout
from distserve.kv_transfer.transport import KVTransport, RankKV, part

logger = logging.getLogger(__name__)

# The caches of this process's sources by token, for a destination in the same process.
_CACHES_IN_PROCESS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def machine_key() -> str:
    """Names this machine and this boot of it: CUDA IPC handles and /proc paths mean something only there."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


@dataclass
class Peer:
    """A channel read in place. The destination's end holds the source's whole KV cache, opened on
    its own device, and the part of the model it holds; the source's end holds nothing (None)."""

    tensor: torch.Tensor | None
    layout: KVLayout | None


class InPlaceTransport(KVTransport[Peer]):
    """A transport whose destination copies out of the source's cache, opened in its process."""

    in_place = True
    place_name = "machine"  # what ``_place`` names, for the log of a channel it cannot serve

    # The handshake, keys under the channel's and transport's prefix: the source sets "source"
    # (where it is, whether it publishes its cache, process, token, layout); the destination answers
    # "reply": "apart" (it cannot read the cache in place), "local" (same process: it takes the
    # tensor itself) or "handle"; to "handle" the source sets "handle" and the destination sets
    # "mode", "opened" if it opened it. The source deletes the keys once it has its answer, so a
    # channel connected again under the same name starts afresh.
    _KEYS = ("source", "reply", "handle", "mode")

    def __init__(self, kv: RankKV) -> None:
        super().__init__(kv)
        self._token = uuid.uuid4().hex  # names this cache to a destination in the same process

    @abstractmethod
    def _place(self) -> str:
        """Where a destination must be to open this rank's handle."""

    def _publishes(self) -> bool:
        """Whether this rank, as a source, lets a destination read its cache in place."""
        return self.kv.in_place

    @abstractmethod
    def _handle(self) -> object:
        """What a destination opens this rank's cache from (picklable)."""

    @abstractmethod
    def _open(self, handle: object) -> torch.Tensor:
        """The source's cache from its ``_handle``, mapped into this process; raises where it cannot be."""

    @abstractmethod
    def _copy(self, here: torch.Tensor, slots: list[int], there: torch.Tensor, src_slots: list[int]) -> None:
        """``here[:, :, slots] = there[:, :, src_slots]`` (views of two caches of the same shape
        but for their slots), inside ``_copying``."""

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Where the copies run, done when it exits: on this thread, unless a transport says otherwise."""
        yield

    def connect(self, channel: str, is_source: bool, store: dist.Store) -> Peer | None:
        return self._source(store) if is_source else self._destination(channel, store)

    def _source(self, store: dist.Store) -> Peer | None:
        publishes = self._publishes()
        if publishes:
            _CACHES_IN_PROCESS[self._token] = self.kv.tensor
        source = {
            "place": self._place(),
            "publishes": publishes,
            "pid": os.getpid(),
            "token": self._token,
            "layout": self.kv.layout,
        }
        try:
            store.set("source", pickle.dumps(source))
            reply = store.get("reply").decode()
            if reply == "handle":
                # Made per destination: each one releases its own reference when it drops the channel.
                store.set("handle", pickle.dumps(self._handle()))
                reply = store.get("mode").decode()
        finally:
            for key in self._KEYS:
                store.delete_key(key)
        return Peer(None, None) if reply in ("local", "opened") else None

    def _destination(self, channel: str, store: dist.Store) -> Peer | None:
        source = pickle.loads(store.get("source"))
        apart = self._apart(source)
        if apart:
            logger.info("KV channel %s not over %s: %s", channel, self.name, apart)
            store.set("reply", "apart")
            return None
        # The same pid with a token unknown here is another container's process: it takes the handle.
        if source["pid"] == os.getpid() and (tensor := _CACHES_IN_PROCESS.get(source["token"])) is not None:
            local = tensor.device == self.kv.device  # on another device of this process a group serves
            store.set("reply", "local" if local else "apart")
            return Peer(tensor, source["layout"]) if local else None
        store.set("reply", "handle")
        handle = store.get("handle")
        try:
            tensor = self._open(pickle.loads(handle))
        except Exception:  # no peer access between the GPUs, another container's memory, permissions
            logger.warning(
                "KV channel %s: could not open the source's KV cache for %s: using the next transport",
                channel,
                self.name,
                exc_info=True,
            )
            tensor = None
        store.set("mode", "failed" if tensor is None else "opened")
        return None if tensor is None else Peer(tensor, source["layout"])

    def _apart(self, source: dict) -> str:
        """Why the destination cannot read ``source``'s cache in place; empty if it may try."""
        if not self.kv.in_place:
            return "this end reads over a group only"
        if not source["publishes"]:
            return "the source does not publish its cache"
        if source["place"] != self._place():
            return f"the source is on another {self.place_name}"
        return ""

    def send(self, link: Peer, slots: list[int], layers: range, heads: range, dst_slots: list[int]) -> int:
        return _num_bytes(self.kv.tensor, slots, layers, heads)  # the destination reads them itself

    def recv(self, link: Peer, slots: list[int], layers: range, heads: range, src_slots: list[int]) -> int:
        """Copy the source's ``src_slots`` into ``slots``, every layer at once; back once the copies
        are done, since the source may reuse its blocks as soon as the pull is reported."""
        assert link.tensor is not None and link.layout is not None  # a destination's end
        if len(src_slots) != len(slots):
            raise ValueError("a channel in place needs the source's slots, as many as the destination's")
        here, there = part(self.kv.tensor, self.kv.layout, layers, heads), part(link.tensor, link.layout, layers, heads)
        with self.kv.lock, self._copying():
            self._copy(here, slots, there, src_slots)
        return _num_bytes(self.kv.tensor, slots, layers, heads)

    def probe(self, link: Peer, buffer: torch.Tensor, send: bool, message_bytes: int) -> None:
        """One contiguous copy out of the source's cache (again from its start past its end)."""
        assert link.tensor is not None  # a destination's end: an in-place source sends nothing
        source = link.tensor.view(-1).view(torch.uint8)
        with self._copying():
            for start in range(0, buffer.numel(), source.numel()):
                piece = buffer[start : start + source.numel()]
                piece.copy_(source[: piece.numel()])


def _num_bytes(cache: torch.Tensor, slots: list[int], layers: range, heads: range) -> int:
    """The bytes of the K and V of ``slots`` for ``layers`` x ``heads`` of ``cache``."""
    return len(layers) * 2 * len(slots) * len(heads) * cache.shape[4] * cache.element_size()
