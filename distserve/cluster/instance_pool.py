"""The cluster's instances, and which of them take new work.

An instance takes new work while it is healthy and not changing role. New prompts go to colocated
instances, and to prefill ones while a decode instance is there (or becoming one) to take their
requests over. While no instance a request needs is left but one is being replaced or changing
role, the request waits for it, up to ``REPLACEMENT_WAIT_S``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from distserve.cluster.routing import InstanceState
from distserve.core.role import Role

# How long a request waits for a replacement when no healthy instance of the role it needs is left.
REPLACEMENT_WAIT_S = 60.0


class InstancePool:
    def __init__(self) -> None:
        self.instances: list[InstanceState] = []
        self.replacing: dict[Role, int] = {}  # replacements under way, by role
        self.changing_roles = False  # a set of role changes is being made (between its phases too)
        self.closed = False  # the cluster is shutting down: no instance is started or polled any more
        self._changed = asyncio.Condition()  # notified when a replacement or a role change ends

    def add(self, entry: InstanceState, replacing: InstanceState | None = None) -> None:
        if replacing is None:
            self.instances.append(entry)
        else:
            self.instances[self.instances.index(replacing)] = entry

    def live(self) -> list[InstanceState]:
        """The instances that have not failed."""
        return [s for s in self.instances if s.failure is None]

    def named(self, name: str) -> InstanceState | None:
        return next((s for s in self.instances if s.name == name), None)

    def pool(self, role: Role) -> list[InstanceState]:
        """The healthy instances of ``role`` that take new work (none is changing role)."""
        return [s for s in self.instances if s.role == role and s.failure is None and s.changing_to is None]

    def entry_pool(self) -> list[InstanceState]:
        """Where new prompts may go: colocated instances, and prefill ones while a decode instance is
        there (or becoming one) to take their requests over."""
        decode = any(Role.DECODE in (s.role, s.changing_to) for s in self.live())
        return self.pool(Role.COLOCATED) + (self.pool(Role.PREFILL) if decode else [])

    @property
    def under_way(self) -> bool:
        """Whether an instance is being replaced or a set of role changes is being made."""
        return any(self.replacing.values()) or self.changing_roles

    def unavailable_role(self) -> str | None:
        """The role the cluster needs with no healthy instance, nor one being replaced or changing."""
        if self.under_way or self.entry_pool():
            return None
        return "decode" if self.pool(Role.PREFILL) else "prefill or colocated"

    async def healthy(self, pool: Callable[[], list[InstanceState]]) -> list[InstanceState]:
        """``pool()`` (healthy instances that take new work); while it is empty but an instance is
        being replaced or changing role, wait for that (up to REPLACEMENT_WAIT_S)."""
        if pool() or not self.under_way:
            return pool()
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: pool() or not self.under_way), REPLACEMENT_WAIT_S)
            except TimeoutError:
                pass
        return pool()

    async def changed(self) -> None:
        """Wake the requests waiting for an instance to take them."""
        async with self._changed:
            self._changed.notify_all()
