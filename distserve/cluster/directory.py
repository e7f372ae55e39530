"""What the API servers of one cluster share: the cluster manager's view of its instances, the
role changes a server is asked for, which only the manager makes, and each server's status, so
that any of them can list them all.

The first API server manages the cluster (starts, replaces and fences instances, changes their
roles, runs the role controller); it publishes its instances here whenever they change, and each
other server follows by long-polling ``watch``. A server that sees an instance fail re-runs its own
requests at once, without waiting for the view: every server polls every instance. A role change
asked of another server is queued here for the manager, and its answer goes back the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

import ray

from distserve.cluster.instance import InstanceInfo
from distserve.core.config import EngineConfig
from distserve.core.role import Role

STATUS_REPORT_S = 1.0  # how often each API server reports its status
STATUS_STALE_S = 5.0  # a server that has not reported for this long is left out of the list


@dataclass(frozen=True)
class InstanceView:
    """One instance as the manager sees it."""

    name: str
    role: Role
    handle: Any
    info: InstanceInfo
    config: EngineConfig
    failure: str | None
    changing_to: Role | None
    replaces: str | None  # the failed instance it took the place of


@dataclass(frozen=True)
class ClusterView:
    instances: tuple[InstanceView, ...]
    replacing: dict[Role, int]  # replacements under way, by role
    changing_roles: bool

    @property
    def key(self) -> tuple:
        """What a server acts on; a change of anything else (an instance's counts) is not news."""
        return (
            tuple((i.name, i.role, i.failure, i.changing_to) for i in self.instances),
            tuple(sorted(self.replacing.items())),
            self.changing_roles,
        )


@dataclass(frozen=True)
class RoleRequest:
    """A role change asked of a server that does not manage the cluster."""

    id: int
    roles: dict[str, str]
    role_control: str | None


@ray.remote(num_cpus=0)
class ClusterDirectory:
    def __init__(self) -> None:
        self.version = 0
        self.view: ClusterView | None = None
        self._changed = asyncio.Condition()
        self._requests: asyncio.Queue[RoleRequest] = asyncio.Queue()
        self._answers: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._statuses: dict[int, tuple[float, Any]] = {}  # server index -> (when reported, its status)

    async def publish(self, view: ClusterView) -> None:
        async with self._changed:
            self.version += 1
            self.view = view
            self._changed.notify_all()

    async def watch(self, version: int, timeout: float) -> tuple[int, ClusterView | None]:
        """The view once its version is past ``version`` (or after ``timeout`` seconds, as it is)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version > version), timeout)
            except asyncio.TimeoutError:
                pass
            return self.version, self.view

    async def set_roles(self, roles: dict[str, str], role_control: str | None) -> Any:
        """Ask the manager for role changes; its answer: the records, or the exception it raised."""
        request = RoleRequest(next(self._ids), roles, role_control)
        answer = self._answers[request.id] = asyncio.get_running_loop().create_future()
        await self._requests.put(request)
        try:
            return await answer
        finally:
            del self._answers[request.id]

    async def next_role_request(self, timeout: float) -> RoleRequest | None:
        """The manager's long poll for role changes asked of other servers."""
        try:
            return await asyncio.wait_for(self._requests.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def answer(self, request_id: int, answer: Any) -> None:
        future = self._answers.get(request_id)
        if future is not None and not future.done():
            future.set_result(answer)

    async def report(self, index: int, status: Any) -> None:
        """A server's status, reported every ``STATUS_REPORT_S``."""
        self._statuses[index] = (time.monotonic(), status)

    async def statuses(self) -> list[Any]:
        """The statuses of the servers that reported lately, by index."""
        now = time.monotonic()
        fresh = {i: s for i, (when, s) in self._statuses.items() if now - when < STATUS_STALE_S}
        return [fresh[i] for i in sorted(fresh)]
