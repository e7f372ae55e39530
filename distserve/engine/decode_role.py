"""The decode role: take prefilled requests over from prefill instances, pull their KV, decode.

A handed-over request is admitted when its blocks can be allocated (in arrival order, so a large
request is not overtaken for ever), its KV is pulled into them by the engine's ``KVPuller``
(given at its construction), and only then does it join the scheduler's running batch. Decoding
is continuous batching, with the prompts it does run (a request the batch preempts, recomputed
here through the waiting queue, and a prompt the orchestrator has it prefill itself: per-request
disaggregation, ``cluster.local_prefill``) in steps of their own (``PREFILL_FIRST``) or, with
chunked prefill, in chunks beside the decode tokens, as a colocated instance runs them. Its prefix
cache holds what its requests computed and, once each pull has ended, what they pulled: blocks a
pull writes are neither shared nor cached before then, which would hand out KV that has not arrived.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

from distserve.core.handover import Handover
from distserve.core.role import Role
from distserve.core.sequence import Sequence, SequenceStatus
from distserve.engine.role import InstanceRole, PullOutcome, RoleContext, RoleStats
from distserve.scheduling.block_manager import BlockManager

RunKey = tuple[str, int]  # (request id, attempt)


class PullEnded(Protocol):
    request_id: str
    attempt: int
    record: Any  # with the pull's wall-clock ``start`` and ``end``; None when it failed
    error: str | None


class KVPuller(Protocol):
    def submit(self, handover: Handover, block_table: list[int]) -> None:
        """Start pulling the prompt's KV into ``block_table``; its end comes out of ``poll``."""

    def poll(self) -> list[PullEnded]:
        """The pulls that ended since the last call, for ``DecodeRole.pull_done``."""


class DecodeAdmission:
    """Handed-over requests from arrival to their first decode step.

    Pending (``SequenceStatus.WAITING`` for blocks, in arrival order) -> ``PULLING`` (blocks
    allocated, KV arriving) -> ``RUNNING`` in the running batch. Cancelled while pending, a request
    leaves at once; while pulling its blocks are being written, so it leaves when the pull ends. A
    failed pull ends the request with "error". Runs are keyed by (request id, attempt): a re-run
    may arrive while an abandoned run of the same request is still being written.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.pending: deque[tuple[Sequence, Handover]] = deque()
        self.pulling: dict[RunKey, Sequence] = {}
        self.cancelled: set[RunKey] = set()
        self.num_waits = 0  # times the head of the queue found no room
        self._waiting_head: Sequence | None = None

    def __len__(self) -> int:
        return len(self.pending) + len(self.pulling)

    def add(self, seq: Sequence, handover: Handover) -> None:
        seq.status = SequenceStatus.WAITING
        self.pending.append((seq, handover))

    def admit(self, num_running: int) -> list[tuple[Sequence, Handover]]:
        """Allocate blocks for pending requests, in order, while sequence slots and blocks allow;
        the admitted ones, now PULLING."""
        admitted = []
        while self.pending:
            seq, handover = self.pending[0]
            room = num_running + len(self.pulling) < self.max_num_seqs
            # A beam search's beams each write a block of their own (or a copy) at their first step.
            reserve = len(seq.beams) if seq.beams is not None else 0
            if not room or not self.block_manager.can_allocate(seq, share_cached=False, reserve=reserve):
                if self._waiting_head is not seq:
                    self._waiting_head = seq
                    self.num_waits += 1
                break
            self.pending.popleft()
            # Its blocks are written by the pull: none is shared, and none is cached before it ends.
            self.block_manager.allocate(seq, register=False, share_cached=False)
            seq.metrics.decode_admitted = time.time()
            seq.num_computed_tokens = handover.num_kv_tokens  # what the pull brings
            seq.status = SequenceStatus.PULLING
            self.pulling[_key(seq)] = seq
            admitted.append((seq, handover))
        return admitted

    def cancel(self, seq: Sequence) -> bool:
        """True when the request left at once; False when it leaves at the end of its pull."""
        for entry in self.pending:
            if entry[0] is seq:
                self.pending.remove(entry)
                return True
        if self.pulling.get(_key(seq)) is seq:
            self.cancelled.add(_key(seq))
            return False
        return True

    def done(self, key: RunKey, error: str | None) -> tuple[Sequence, str | None] | None:
        """A pull ended: the request and how it ends now ("abort" cancelled, "error" failed), or
        None for its reason when it goes on to decode. None when no such pull is under way."""
        seq = self.pulling.pop(key, None)
        if seq is None:
            return None
        if key in self.cancelled:
            self.cancelled.discard(key)
            return seq, "abort"
        return seq, None if error is None else "error"


def _key(seq: Sequence) -> RunKey:
    return seq.request_id, seq.attempt


class DecodeRole(InstanceRole):
    role = Role.DECODE
    takes_prompts = False  # but those the orchestrator has it prefill itself (``add``)

    def __init__(self, context: RoleContext) -> None:
        super().__init__(context)
        self.admission = DecodeAdmission(context.scheduler.block_manager, context.config.max_num_seqs)
        # The sibling samples of handed-over requests, forked from the carrier once its KV is here.
        self.siblings: dict[RunKey, list[Sequence]] = {}

    def add(self, seq: Sequence, local_prefill: bool = False) -> None:
        if not local_prefill:
            raise self._not_this_role("new prompts go to prefill or colocated instances, or are prefilled locally")
        self.scheduler.add(seq)

    def add_handover(self, seq: Sequence, handover: Handover, siblings: list[Sequence]) -> None:
        if siblings:
            self.siblings[_key(seq)] = siblings
        self.admission.add(seq, handover)

    def admit(self) -> list[tuple[Sequence, Handover]]:
        return self.admission.admit(self.scheduler.num_running)

    def pull_done(
        self, request_id: str, attempt: int, start: float | None, end: float | None, error: str | None
    ) -> PullOutcome | None:
        """The KV of a run has arrived (``error`` None) or could not be pulled; ``start`` and ``end``
        are the pull's wall-clock times. None when no such pull was under way."""
        result = self.admission.done((request_id, attempt), error)
        if result is None:
            return None
        seq, reason = result
        samples = [seq, *(s for s in self.siblings.pop((request_id, attempt), []) if not s.is_finished)]
        if reason is not None:
            return PullOutcome(samples, reason)
        # Its KV is here: later prompts may share it. The prefill instance saved it to the tier.
        self.scheduler.block_manager.register_computed(seq, 0, save=False)
        for sibling in samples[1:]:
            self.scheduler.block_manager.fork(seq, sibling)
        for sample in samples:
            sample.metrics.decode_admitted = seq.metrics.decode_admitted
            sample.metrics.migration_start, sample.metrics.migration_end = start, end
            self.scheduler.running.add(sample)
        return PullOutcome(samples, None)

    def cancel(self, seq: Sequence) -> bool:
        if self.admission.cancel(seq):
            self.siblings.pop(_key(seq), None)  # they are stopped with it (``abort_request``)
            return True
        return False  # the pull's end finishes it

    def ready_to_leave(self) -> bool:
        return not len(self.admission)

    def stats(self) -> RoleStats:
        return RoleStats(num_pending=len(self.admission), num_admission_waits=self.admission.num_waits)
