"""The cluster as the role controller sees it: its instances' names, roles and loads (and what a
forecast needs of them), the requests in flight, and the one thing it does, changing roles. The
orchestrator is one; the controller reads nothing else of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from distserve.cluster.role_control.request_records import InFlight
from distserve.core.config import EngineConfig
from distserve.core.role import Role


class InstanceView(Protocol):
    """One instance, as the controller reads it."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> Role: ...

    @property
    def load_tokens(self) -> int: ...  # the most loaded keep decoding what they hold

    @property
    def failure(self) -> str | None: ...  # None: healthy

    @property
    def config(self) -> EngineConfig: ...  # how its steps are formed: what a forecast assumes

    @property
    def handle(self) -> Any: ...  # its actor: ``step_line`` is its measured step cost


class ClusterView(Protocol):
    @property
    def instances(self) -> Sequence[InstanceView]: ...

    def in_flight(self) -> list[InFlight]:
        """Each request in flight, in order of arrival, with the times of its first and latest tokens."""
        ...

    async def change_roles(self, roles: dict[str, Role], reason: str) -> None:
        """Give the named instances these roles, for ``reason`` (what the controller saw)."""
        ...
