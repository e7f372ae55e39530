"""How long the serving loop was kept from running, so that deadlines measured on it can leave it out.

The orchestrator judges an instance stalled when its output poll goes unanswered for
``liveness_timeout`` seconds. Measured in plain wall-clock time on the loop, a stall of the loop
itself (a callback that held it, a C call holding the GIL, the process stopped or swapped out)
would read as every instance stalling at once: when the loop runs again, each poll's deadline has
passed, and which of the deadline and the answer that came meanwhile is handled first is a race.
So the deadline is counted in the loop's running time: ``LoopLag.run`` sleeps ``TICK_S`` at a
time and adds up how late it wakes, and ``stopwatch`` reads the time since it started less the
lag over that time, the lag of a stall not yet over (its tick still to come) included.

A loop that is merely busy adds its small lateness too: a stalled instance is fenced a little
later on a loaded loop, never sooner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

TICK_S = 0.05
STALL_WARNING_S = 1.0  # a stall this long is logged: something ran on the loop that should not


class LoopLag:
    def __init__(self) -> None:
        self._last: float | None = None  # when the latest tick ran; None before the first
        self._lagged = 0.0  # seconds of lag up to the latest tick
        self.largest = 0.0  # the longest stall seen, in seconds

    async def run(self) -> None:
        """Measure the running loop's lag until cancelled."""
        self._last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            late = self.lag_now()
            self._lagged += late
            self._last = time.monotonic()
            self.largest = max(self.largest, late)
            if late >= STALL_WARNING_S:
                logger.warning("the serving loop was held for %.1f s: liveness deadlines leave it out", late)

    def lag_now(self) -> float:
        """How late the next tick is now: the lag of a stall still going on (or just over)."""
        return 0.0 if self._last is None else max(0.0, time.monotonic() - self._last - TICK_S)

    def lagged(self) -> float:
        """Seconds of lag since the measurement began, the current stall's included."""
        return self._lagged + self.lag_now()

    def stopwatch(self) -> Callable[[], float]:
        """A clock from now: seconds the loop has run since, its lag left out."""
        start, lagged = time.monotonic(), self.lagged()
        return lambda: time.monotonic() - start - (self.lagged() - lagged)
