"""The decode side of a hand-over: pulling a prefilled request's KV from the prefill instance.

The decode role admits a ``Handover`` when it can allocate its blocks and gives it to the
``Migrator``, which pulls the KV from the prefill instance's ranks over pair communicators
(``channel``) on its own thread, tells the prefill instance to free its blocks, and reports the
pull done or failed. The decode role starts decoding the request only then.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from distserve.core.handover import Handover
from distserve.kv_transfer.channel import IN_PLACE_TRANSPORTS, Moved, channel_peers
from distserve.kv_transfer.checksum import KVChecksumMismatch
from distserve.kv_transfer.plan import KVEndpoint, TransferPart, plan_transfer, token_slots, transfer_rounds

logger = logging.getLogger(__name__)


@dataclass
class MigrationRecord:
    request_id: str
    num_tokens: int
    num_bytes: int  # received by all of this instance's ranks together
    transport: str  # how it moved: "gloo", "nccl", "ipc" or "shm" ("ipc+nccl" where the pull's channels differ)
    start: float  # time.time() when the pull began and ended
    end: float


@dataclass
class PullTotals:
    """The pulls from one prefill instance so far: how the KV moved, and how much in what time."""

    transport: str
    pulls: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


class KVNoLongerHeld(RuntimeError):
    """The prefill instance freed the KV before the pull ended (hold deadline, abort)."""


class Migrator:
    """Decode side: pulls the KV of admitted requests from their prefill instances on its own
    thread, one request at a time, and reports each one done (or failed) through ``on_done(request
    id, attempt, record, error)``.

    It keeps what it learnt of each prefill instance (handle, ranks, transfer plan, connected
    channels) until that instance is gone: a pull that fails on the way, or ``forget``."""

    MAX_RECORDS = 10_000

    def __init__(
        self,
        name: str,
        endpoints: list[KVEndpoint],
        block_size: int,
        on_done: Callable[[str, int, MigrationRecord | None, str | None], None],
    ) -> None:
        self.name = name
        self.endpoints = endpoints
        self.block_size = block_size
        self.on_done = on_done
        self._records: OrderedDict[str, MigrationRecord] = OrderedDict()
        self._totals: dict[str, PullTotals] = {}  # by prefill instance
        self.num_pulls = 0
        self.num_checksum_mismatches = 0  # pulls failed because what arrived was not what was sent
        self._records_lock = threading.Lock()
        self._sources: dict[str, tuple[Any, list[KVEndpoint], list[TransferPart]]] = {}
        self._connected: dict[str, str] = {}  # channel: its transport
        # ("pull", handover, block table), ("forget", instance name), or None to stop.
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-migrator", daemon=True)
        self._thread.start()

    def submit(self, handover: Handover, block_table: list[int]) -> None:
        self._queue.put(("pull", handover, list(block_table)))

    def forget(self, instance_name: str) -> None:
        """A prefill instance is gone: drop what this migrator keeps of it (in turn with the pulls)."""
        self._queue.put(("forget", instance_name))

    def stop(self) -> None:
        self._queue.put(None)

    def sources(self) -> dict[str, list[str]]:
        """The prefill instances this migrator knows, each with its connected channels."""
        names, connected = list(self._sources), list(self._connected)  # copies: the pull thread changes them
        return {name: sorted(c for c in connected if channel_peers(c)[0] == name) for name in names}

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if item[0] == "forget":
                self._forget(item[1])
                continue
            _, handover, block_table = item
            try:
                record = self._pull(handover, block_table)
            except Exception as e:  # the prefill side died or refused: the request cannot continue here
                logger.exception("%s: pulling the KV of %s failed", self.name, handover.request_id)
                # The link broke: connect afresh next time. A refused or mismatched pull ran to its
                # end over channels still in step.
                if not isinstance(e, (KVNoLongerHeld, KVChecksumMismatch)):
                    self._forget(handover.prefill_instance, on_ranks=True)
                error = f"KV migration from {handover.prefill_instance} failed: {e}"
                self.on_done(handover.request_id, handover.attempt, None, error)
            else:
                self.on_done(handover.request_id, handover.attempt, record, None)

    def _forget(self, instance_name: str, on_ranks: bool = False) -> None:
        """Drop the source ``instance_name``; ``on_ranks``: this instance's ranks drop its channels too."""
        self._sources.pop(instance_name, None)
        self._connected = {c: t for c, t in self._connected.items() if channel_peers(c)[0] != instance_name}
        if on_ranks:
            try:
                ray.get([e.call("drop_peer", instance_name) for e in self.endpoints])
            except Exception:  # a rank of ours is gone too: the instance fails over as a whole
                logger.exception("%s: could not drop the channels of %s", self.name, instance_name)

    def _source(self, instance_name: str) -> tuple[Any, list[KVEndpoint], list[TransferPart]]:
        """The prefill instance's handle, its ranks, and which of them send what to which of ours."""
        if instance_name not in self._sources:
            handle = ray.get_actor(instance_name)
            endpoints = ray.get(handle.kv_endpoints.remote())
            plan = plan_transfer([e.layout for e in endpoints], [e.layout for e in self.endpoints])
            self._sources[instance_name] = (handle, endpoints, plan)
        return self._sources[instance_name]

    def _channel(self, instance_name: str, sources: list[KVEndpoint], part: TransferPart) -> str:
        """The pair communicator of a part, made on first use: both ends join it at once."""
        channel = f"{instance_name}.{part.src}>{self.name}.{part.dst}"
        if channel not in self._connected:
            src, dst = sources[part.src], self.endpoints[part.dst]
            address = ray.get(src.call("store_address"))
            ray.get([src.call("connect", channel, True, address), dst.call("connect", channel, False, address)])
            self._connected[channel] = ray.get(dst.call("transport", channel))
        return channel

    def records(self) -> dict[str, MigrationRecord]:
        """The latest pulls, by request id."""
        with self._records_lock:
            return dict(self._records)

    def totals(self) -> dict[str, PullTotals]:
        """The pulls from each prefill instance so far, by its name."""
        with self._records_lock:
            return {name: dataclasses.replace(totals) for name, totals in self._totals.items()}

    def _pull(self, handover: Handover, block_table: list[int]) -> MigrationRecord:
        start = time.time()
        handle, sources, plan = self._source(handover.prefill_instance)
        num_tokens = handover.num_kv_tokens
        src_slots = token_slots(handover.block_table, num_tokens, handover.block_size)
        dst_slots = token_slots(block_table, num_tokens, self.block_size)
        rounds = transfer_rounds(plan)
        channels = [[self._channel(handover.prefill_instance, sources, part) for part in r] for r in rounds]
        transports = {self._connected[c] for names in channels for c in names}
        # Over groups the source frees its blocks in the call that sends the last of them; a
        # destination that reads them in place needs them until its copy is done.
        release_with_send = not transports & IN_PLACE_TRANSPORTS
        num_bytes, held, mismatched = 0, True, []
        for i, (round_, names) in enumerate(zip(rounds, channels)):
            recvs = [
                self.endpoints[part.dst].call("recv", channel, dst_slots, part.layers, part.kv_heads, src_slots)
                for part, channel in zip(round_, names)
            ]
            sends = [
                (part.src, (channel, src_slots, part.layers, part.kv_heads, dst_slots))
                for part, channel in zip(round_, names)
            ]
            release = release_with_send and i == len(rounds) - 1
            sent = handle.send_kv.remote(handover.request_id, handover.attempt, sends, release)
            received: list[Moved] = ray.get(recvs)
            sent_moved, held = ray.get(sent)
            num_bytes += sum(m.num_bytes for m in received)
            mismatched += [name for name, s, r in zip(names, sent_moved, received) if not s.agrees(r)]
        # Else the prefill instance frees its blocks now, unless it did so at its hold deadline
        # already, in which case they may have been reused during the pull.
        if not release_with_send:
            held = ray.get(handle.release_kv.remote(handover.request_id, handover.attempt))
        if not held:
            raise KVNoLongerHeld(f"{handover.prefill_instance} no longer held the KV (hold deadline or abort)")
        if mismatched:
            with self._records_lock:
                self.num_checksum_mismatches += 1
            raise KVChecksumMismatch(f"the KV received over {', '.join(mismatched)} is not what was sent")
        transport = "+".join(sorted(transports))
        record = MigrationRecord(handover.request_id, num_tokens, num_bytes, transport, start, time.time())
        with self._records_lock:
            self.num_pulls += 1
            self._records[handover.request_id] = record
            totals = self._totals.setdefault(handover.prefill_instance, PullTotals(transport))
            totals.transport = transport
            totals.pulls += 1
            totals.num_bytes += num_bytes
            totals.seconds += record.end - record.start
            while len(self._records) > self.MAX_RECORDS:
                self._records.popitem(last=False)
        return record
