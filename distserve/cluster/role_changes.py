"""Changing instances' roles while the cluster serves.

``RoleChanger.set_roles`` takes a new role per instance, checks that the layout it leads to can
serve (an instance that takes new prompts; a decode instance whenever a prefill one is left) and
changes the instances in an order that keeps every request somewhere to go: first those that
become decode instances, then the others, and those that leave decode last, once no instance
leaving prefill can hand them anything. An instance that is changing gets no new work from the
orchestrator; it finishes its current step, hands on or gives back what its new role cannot
serve (``Instance.change_role``) and serves its new role from the next step, weights and cache
kept. Once a set of changes is made, the prompts queued at the instances that take new prompts are
spread over them all, newcomers included. Each change is recorded with how long it took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from distserve.cluster.instance_pool import InstancePool
from distserve.cluster.routing import InstanceState
from distserve.core.errors import RequestError
from distserve.core.role import Role

logger = logging.getLogger(__name__)


@dataclass
class RoleChangeRecord:
    instance: str
    old_role: Role
    new_role: Role
    started: float  # wall-clock time the change was asked for
    seconds: float  # until the instance served its new role
    reason: str  # "operator", or what the controller saw
    error: str | None = None  # why the change did not happen


class RoleChanger:
    """Makes sets of role changes. ``leaving(layout)`` is told the layout a set of changes leaves,
    before it starts; ``changed()``, once a set has changed a role."""

    def __init__(
        self, instances: InstancePool, leaving: Callable[[dict[str, Role]], None], changed: Callable[[], None]
    ) -> None:
        self.instances = instances
        self.leaving = leaving
        self.changed = changed
        self.history: list[RoleChangeRecord] = []
        self._lock = asyncio.Lock()  # one set of changes at a time

    def layout(self) -> dict[str, Role]:
        """The role of every healthy instance."""
        return {s.name: s.role for s in self.instances.live()}

    async def set_roles(self, roles: dict[str, Role | str], reason: str = "operator") -> list[RoleChangeRecord]:
        """Give the named instances these roles; returns a record per instance whose role changed.
        Raises RequestError, changing nothing, for an unknown or failed instance or a layout that
        could not serve."""
        async with self._lock:
            changes = self._check(roles)
            if changes:  # what the layout being left served, by an operator's change too
                self.leaving(self.layout())
            records = []
            self.instances.changing_roles = bool(changes)
            try:
                for phase in self._phases(changes):
                    records += await asyncio.gather(*(self._change(entry, role, reason) for entry, role in phase))
            finally:
                self.instances.changing_roles = False
                await self.instances.changed()
                if records:
                    self.changed()
            return records

    def _check(self, roles: dict[str, Role | str]) -> dict[InstanceState, Role]:
        by_name = {s.name: s for s in self.instances.instances}
        changes = {}
        for name, role in roles.items():
            entry = by_name.get(name)
            if entry is None:
                raise RequestError(f"no instance is named '{name}' (instances: {', '.join(by_name)})")
            if entry.failure is not None:
                raise RequestError(f"instance {name} has failed and cannot change role: {entry.failure}")
            try:
                role = Role.parse(role)
            except ValueError as e:
                raise RequestError(str(e)) from None
            if role is not entry.role:
                changes[entry] = role
        layout = {**self.layout(), **{entry.name: role for entry, role in changes.items()}}
        if problem := layout_problem(layout):
            raise RequestError(f"cannot set these roles: {problem}")
        return changes

    @staticmethod
    def _phases(changes: dict[InstanceState, Role]) -> list[list[tuple[InstanceState, Role]]]:
        to_decode = [(e, r) for e, r in changes.items() if r is Role.DECODE]
        from_decode = [(e, r) for e, r in changes.items() if e.role is Role.DECODE]
        others = [(e, r) for e, r in changes.items() if (e, r) not in to_decode + from_decode]
        return [phase for phase in (to_decode, others, from_decode) if phase]

    async def _change(self, entry: InstanceState, role: Role, reason: str) -> RoleChangeRecord:
        record = RoleChangeRecord(entry.name, entry.role, role, time.time(), 0.0, reason)
        entry.changing_to = role
        try:
            record.seconds = await entry.handle.change_role.remote(role)
            entry.role = role
            entry.config = dataclasses.replace(
                entry.config, scheduler=dataclasses.replace(entry.config.scheduler, role=role)
            )  # what a replacement starts as
            logger.info("%s: %s -> %s in %.3f s (%s)", entry.name, record.old_role, role, record.seconds, reason)
        except Exception as e:  # it died meanwhile (failover takes over) or refused
            record.error = str(e)
            logger.error("%s could not change to %s: %s", entry.name, role, e)
        finally:
            entry.changing_to = None
            await self.instances.changed()
        self.history.append(record)
        return record


def layout_problem(layout: dict[str, Role]) -> str | None:
    """Why instances with these roles could not serve, or None."""
    roles = list(layout.values())
    if Role.PREFILL not in roles and Role.COLOCATED not in roles:
        return "no instance would take new prompts (prefill or colocated)"
    if Role.PREFILL in roles and Role.DECODE not in roles:
        return "prefill instances need a decode instance to hand their requests to"
    return None
