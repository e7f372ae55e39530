"""From when a layout's requests count for it. A layout has settled once the work from before its
change is done and the queue that formed meanwhile has been prefilled: requests that arrive
earlier wait behind the change, not the layout. A queue that lasts a whole window past the change
is the layout's own (a load at its capacity), and the layout is judged from the change on."""

from __future__ import annotations

from distserve.cluster.role_control.config import RoleControlConfig
from distserve.cluster.role_control.request_records import InFlight


class Settling:
    def __init__(self, config: RoleControlConfig) -> None:
        self.config = config
        self.last_change = 0.0
        # Requests that arrived before the previous layout's work was done, and the queue that
        # formed meanwhile prefilled, waited behind the change: only those after count for the layout.
        self.settled_at: float | None = None
        self._previous_done_at: float | None = None
        # Requests that finished by this time are not the layout's to remember: they finished before
        # it settled, or are remembered already.
        self._recorded_until = 0.0

    def settle(self, in_flight: list[InFlight], now: float) -> None:
        """The layout has settled once no request that arrived before the last change is in flight,
        and then none that arrived before that moment still waits for its first token (the queue
        that formed during the change). One that has not a whole window after its change counts as
        settled at the change: a queue that outlasts the change's transient is this layout's under
        this load (a load at its capacity), and waiting for it to drain would leave every window
        empty while it grows - under a backlog, for as long as the phase that needs another layout."""
        if now - self.last_change >= self.config.window:
            self.settled_at = self.last_change
            return
        if self._previous_done_at is None and all(r.request.arrival >= self.last_change for r in in_flight):
            self._previous_done_at = now
        done = self._previous_done_at
        if done is not None and all(r.first_token is not None or r.request.arrival >= done for r in in_flight):
            self.settled_at = self._recorded_until = now

    def layout_changed(self, now: float) -> None:
        """Roles changed (by the controller or an operator): the next change waits ``min_dwell``, and
        the requests of the new layout count once it has settled."""
        self.last_change, self.settled_at, self._previous_done_at = now, None, None
