"""The decode side of a hand-over: pulling prefilled requests' KV from prefill instances, many at once.

The decode engine starts a pull as soon as it has allocated a handed-over request's blocks
(``submit``, from its step loop) and collects the pulls that ended at each turn of that loop
(``poll``); nothing waits on a thread of its own. Each destination rank pulls its part itself
(``KVTransfer.pull``: it joins the channel with the source rank on first use, has the source send,
receives and checks the digests), so a pull is a few Ray calls: a round of rank pulls (more than one
round only where tensor-parallel layouts differ), then the prefill instance's release of its blocks.
Pulls are bounded by the links, not by a queue: each destination rank has at most
``RANK_PULLS`` pulls in its hands, one moving and the others ready behind it, so its link does not
wait for this loop between two steps, and its call threads stay free for the steps and health
checks beside them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass

import ray

from distserve.core.handover import Handover
from distserve.kv_transfer.channel import Moved
from distserve.kv_transfer.checksum import KVChecksumMismatch
from distserve.kv_transfer.plan import (
    KVEndpoint,
    KVSource,
    TransferPart,
    plan_transfer,
    token_slots,
    transfer_rounds,
)

logger = logging.getLogger(__name__)

# Rank pulls in a destination rank's hands at once: one moving, the rest ready behind it, enough that
# its link keeps moving through a decode step (the step loop hands out the next ones between steps).
RANK_PULLS = 8

# What a pull waits for: Ray calls whose answers it is resumed with, in order, or (empty) a free rank.
Waits = list[ray.ObjectRef]


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


@dataclass
class PullEnd:
    """A pull that ended: its run, and its record or why it failed."""

    request_id: str
    attempt: int
    record: MigrationRecord | None
    error: str | None


@dataclass
class Source:
    """A prefill instance as this puller knows it: how to reach its KV, and which of its ranks
    send what to which of ours."""

    kv: KVSource
    plan: list[TransferPart]


class KVNoLongerHeld(RuntimeError):
    """The prefill instance freed the KV before the pull ended (hold deadline, abort)."""


@dataclass
class _Pull:
    handover: Handover
    steps: Generator[Waits, list, MigrationRecord] | None = None
    waits: Waits = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)  # destination ranks it has a rank pull on


class KVPuller:
    """Decode side: pulls the KV of admitted requests from their prefill instances, many at once.

    ``notify`` is called (on a Ray thread) whenever a call a pull waits for has answered: the step
    loop's cue to ``poll``. It keeps what it learnt of each prefill instance until that instance is
    gone: a pull from it that fails on the way, or ``forget``."""

    MAX_RECORDS = 10_000

    def __init__(self, name: str, endpoints: list[KVEndpoint], block_size: int, notify: Callable[[], None]) -> None:
        self.name = name
        self.endpoints = endpoints
        self.block_size = block_size
        self.notify = notify
        self.num_pulls = 0
        self.num_checksum_mismatches = 0  # pulls failed because what arrived was not what was sent
        self._lock = threading.Lock()  # what other threads read: sources, records, totals
        self._records: OrderedDict[str, MigrationRecord] = OrderedDict()
        self._totals: dict[str, PullTotals] = {}  # by prefill instance
        self._sources: dict[str, Source] = {}
        self._pulls: list[_Pull] = []
        self._ended: list[PullEnd] = []  # pulls that ended as they started, for the next poll
        self._busy = [0] * len(endpoints)  # rank pulls in each destination rank's hands

    def submit(self, handover: Handover, block_table: list[int]) -> None:
        """Start pulling the prompt's KV into ``block_table``; its end comes out of ``poll``."""
        pull = _Pull(handover)
        pull.steps = self._pull(pull, list(block_table))
        self._pulls.append(pull)
        end = self._resume(pull, None)  # up to its first calls
        if end is not None:
            self._ended.append(end)

    def poll(self) -> list[PullEnd]:
        """Move every pull on whose calls have answered; the pulls that ended."""
        ended, self._ended = self._ended, []
        progressed = True
        while progressed:  # a pull that ends frees a rank another one waits for
            progressed = False
            waiting = [ref for pull in self._pulls for ref in pull.waits]
            done = set(ray.wait(waiting, num_returns=len(waiting), timeout=0)[0]) if waiting else set()
            for pull in list(self._pulls):
                if not all(ref in done for ref in pull.waits):
                    continue
                try:
                    answers = ray.get(pull.waits)
                except Exception as e:
                    end = self._fail(pull, e)
                else:
                    before = (pull.waits, pull.ranks)
                    end = self._resume(pull, answers)
                    progressed = progressed or end is not None or (pull.waits, pull.ranks) != before
                if end is not None:
                    ended.append(end)
                    progressed = True
        return ended

    def forget(self, instance_name: str) -> None:
        """A prefill instance is gone: drop what this puller keeps of it."""
        with self._lock:
            self._sources.pop(instance_name, None)

    def sources(self) -> list[str]:
        """The prefill instances this puller knows."""
        with self._lock:
            return sorted(self._sources)

    def records(self) -> dict[str, MigrationRecord]:
        """The latest pulls, by request id."""
        with self._lock:
            return dict(self._records)

    def totals(self) -> dict[str, PullTotals]:
        """The pulls from each prefill instance so far, by its name."""
        with self._lock:
            return {name: dataclasses.replace(totals) for name, totals in self._totals.items()}

    # A pull's course -----------------------------------------------------------------------------

    def _resume(self, pull: _Pull, answers: list | None) -> PullEnd | None:
        """Run ``pull`` on with the answers it waited for, up to its next wait or its end."""
        try:
            waits = pull.steps.send(answers)
        except StopIteration as stop:
            self._drop(pull)
            return PullEnd(pull.handover.request_id, pull.handover.attempt, stop.value, None)
        except Exception as e:
            return self._fail(pull, e)
        pull.waits = waits
        for ref in waits:
            ref.future().add_done_callback(lambda _: self.notify())
        return None

    def _fail(self, pull: _Pull, error: Exception) -> PullEnd:
        handover = pull.handover
        pull.steps.close()
        self._drop(pull)
        cause = error.as_instanceof_cause() if isinstance(error, ray.exceptions.RayTaskError) else error
        if isinstance(cause, KVChecksumMismatch):
            self.num_checksum_mismatches += 1
            logger.error("%s: the KV of %s arrived changed: %s", self.name, handover.request_id, cause)
        else:
            logger.error("%s: pulling the KV of %s failed: %s", self.name, handover.request_id, error)
        # The link broke: connect afresh next time. A refused or mismatched pull ran to its end over
        # channels still in step.
        if not isinstance(cause, (KVNoLongerHeld, KVChecksumMismatch)):
            self.forget(handover.prefill_instance)
            try:
                ray.get([e.call("drop_peer", handover.prefill_instance) for e in self.endpoints])
            except Exception:  # a rank of ours is gone too: the instance fails over as a whole
                logger.exception("%s: could not drop the channels of %s", self.name, handover.prefill_instance)
        error_text = f"KV migration from {handover.prefill_instance} failed: {cause}"
        return PullEnd(handover.request_id, handover.attempt, None, error_text)

    def _drop(self, pull: _Pull) -> None:
        self._pulls.remove(pull)
        self._release_ranks(pull)

    def _release_ranks(self, pull: _Pull) -> None:
        for rank in pull.ranks:
            self._busy[rank] -= 1
        pull.ranks = []

    def _pull(self, pull: _Pull, block_table: list[int]) -> Generator[Waits, list, MigrationRecord]:
        """One pull, as the calls it waits for in turn; its record."""
        handover, start = pull.handover, time.time()
        source = self._source(handover)
        num_tokens = handover.num_kv_tokens
        src_slots = token_slots(handover.block_table, num_tokens, handover.block_size)
        dst_slots = token_slots(block_table, num_tokens, self.block_size)
        received: list[Moved] = []
        for round_ in transfer_rounds(source.plan):
            while any(self._busy[part.dst] >= RANK_PULLS for part in round_):
                yield []
            pull.ranks = [part.dst for part in round_]
            for rank in pull.ranks:
                self._busy[rank] += 1
            received += yield [
                self.endpoints[part.dst].call(
                    "pull", self._channel(handover, part), source.kv.endpoints[part.src],
                    dst_slots, part.layers, part.kv_heads, src_slots,
                )
                for part in round_
            ]  # fmt: skip
            self._release_ranks(pull)
        # The prefill instance frees its blocks now, unless it did so at its hold deadline already,
        # in which case they may have been reused during the pull.
        (held,) = yield [source.kv.release(handover.request_id, handover.attempt)]
        if not held:
            raise KVNoLongerHeld(f"{handover.prefill_instance} no longer held the KV (hold deadline or abort)")
        return self._record(handover, received, start)

    def _channel(self, handover: Handover, part: TransferPart) -> str:
        return f"{handover.prefill_instance}.{part.src}>{self.name}.{part.dst}"

    def _source(self, handover: Handover) -> Source:
        """The hand-over's source instance, with the plan of which of its ranks send what to ours."""
        name, kv_source = handover.prefill_instance, handover.kv_source
        source = self._sources.get(name)  # an instance's name is its own: a replacement has another
        if source is None:
            plan = plan_transfer([e.layout for e in kv_source.endpoints], [e.layout for e in self.endpoints])
            source = Source(kv_source, plan)
            with self._lock:
                self._sources[name] = source
        return source

    def _record(self, handover: Handover, received: list[Moved], start: float) -> MigrationRecord:
        transport = "+".join(sorted({m.transport for m in received}))
        num_bytes = sum(m.num_bytes for m in received)
        record = MigrationRecord(handover.request_id, handover.num_kv_tokens, num_bytes, transport, start, time.time())
        with self._lock:
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
