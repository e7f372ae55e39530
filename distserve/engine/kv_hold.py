"""KV kept for another instance to pull: a prefilled request's prompt (for its decode instance), or
a decoding request's whole context when its instance leaves decode and hands it on.

Back-pressure: while held KV takes more than ``kv_hold_fraction`` of the blocks, a prefill role
schedules no new prompt, so a slow or full decode side throttles prefill instead of prefill
running out of blocks. Deadline: KV held longer than ``kv_hold_timeout`` (its puller died, or
never got to it) is freed and the request reported failed, so a lost hand-over cannot pin blocks
forever. The hold belongs to the engine, not to a role: it outlives a role change.
"""

from __future__ import annotations

import threading

from distserve.core.sequence import Sequence, SequenceStatus


class KVHold:
    """The KV of prefilled requests, kept until a decode instance has pulled it.

    A request goes HELD -> RELEASED (pulled; ``take_released`` hands it back to be freed), or
    HELD -> expired (past the deadline; freed), or HELD -> dropped (aborted). ``release`` comes
    from the instance's call threads while the step loop expires, so the states change under a
    lock and a request is released or expired, never both: a release that finds the request no
    longer held is refused, and the puller must not trust what it read.
    """

    def __init__(self, timeout: float, limit_blocks: int) -> None:
        self.timeout = timeout
        self.limit_blocks = limit_blocks
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Sequence, float]] = {}  # request id -> (sequence, held since)
        self._released: list[Sequence] = []

    def hold(self, seq: Sequence, now: float) -> None:
        seq.status = SequenceStatus.HELD
        with self._lock:
            self._held[seq.request_id] = (seq, now)

    def release(self, request_id: str, attempt: int) -> bool:
        """Decode has pulled the KV of this run: True when it was still held, so the pull is valid."""
        with self._lock:
            entry = self._held.get(request_id)
            if entry is None or entry[0].attempt != attempt:
                return False
            del self._held[request_id]
            self._released.append(entry[0])
            return True

    def take(self, request_id: str, attempt: int) -> Sequence | None:
        """Stop holding a run, blocks and all, for its own engine to decode; None if not held."""
        with self._lock:
            entry = self._held.get(request_id)
            if entry is None or entry[0].attempt != attempt:
                return None
            del self._held[request_id]
            return entry[0]

    def take_released(self) -> list[Sequence]:
        with self._lock:
            released, self._released = self._released, []
            return released

    def expire(self, now: float) -> list[Sequence]:
        """Requests held longer than the timeout: no longer held, for the caller to fail."""
        with self._lock:
            expired = [rid for rid, (_, since) in self._held.items() if now - since > self.timeout]
            return [self._held.pop(rid)[0] for rid in expired]

    def drop(self, seq: Sequence) -> bool:
        """Stop holding an aborted request; False if it was not held."""
        with self._lock:
            entry = self._held.get(seq.request_id)
            if entry is None or entry[0] is not seq:
                return False
            del self._held[seq.request_id]
            return True

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Blocks still in use for decode: held, or released and not yet freed."""
        with self._lock:
            seqs = [seq for seq, _ in self._held.values()] + self._released
        return sum(len(seq.block_table) for seq in seqs)

    @property
    def full(self) -> bool:
        return self.num_blocks >= self.limit_blocks
