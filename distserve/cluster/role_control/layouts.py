"""Layouts as the controller moves between them: a role per healthy instance, most loaded first
(the instances that become decode keep the requests they decode)."""

from __future__ import annotations

from distserve.core.role import Role


def all_colocated(layout: dict[str, Role]) -> bool:
    """More than one instance, every one colocated: the layout the controller disaggregates."""
    return len(layout) > 1 and all(r is Role.COLOCATED for r in layout.values())


def disaggregated(names: list[str]) -> dict[str, Role]:
    """Half decode (the first, busiest, keep decoding what they hold), half prefill."""
    num_decode = len(names) // 2
    return {n: Role.DECODE if i < num_decode else Role.PREFILL for i, n in enumerate(names)}


def layout_key(roles: dict[str, Role]) -> tuple[Role, ...]:
    """A layout as memory knows it: how many instances of each role, whichever they are."""
    return tuple(sorted(roles.values()))


def roles_for(key: tuple[Role, ...], names: list[str]) -> dict[str, Role]:
    """A layout's roles given to ``names`` (most loaded first): decode roles first, so that the
    instances that decode most keep what they decode, then colocated, then prefill."""
    order = {Role.DECODE: 0, Role.COLOCATED: 1, Role.PREFILL: 2}
    return dict(zip(names, sorted(key, key=order.__getitem__)))
