"""CPU core lists (``0-3,8``) and binding a process's threads to them.

A CPU instance's torch threads meet at a barrier after every operator: one thread descheduled by
another process (a server, the orchestrator, Ray's own) holds up the whole step. Threads bound to
cores of their own are not descheduled by each other's instances, and serving processes kept off
those cores do not preempt them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

UNBOUND = ("auto", "none")  # the cpu_cores values that name no cores


def parse_cores(spec: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``; raises ValueError with the part it cannot read."""
    cores: list[int] = []
    for part in (p.strip() for p in str(spec).split(",")):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"'{part}' in cpu cores '{spec}' is not a core number or a range like 0-3") from None
        if low < 0 or high < low:
            raise ValueError(f"'{part}' in cpu cores '{spec}' is not a range of core numbers")
        cores.extend(range(low, high + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"cpu cores '{spec}' name a core twice")
    return cores


def format_cores(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    ranges: list[list[int]] = []
    for core in sorted(cores):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def bind_process(cores: list[int]) -> None:
    """Bind every thread of this process to ``cores``; threads it starts later inherit the binding
    from the thread that starts them (OpenMP's pool included, when torch starts it later)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
        except OSError as e:  # EINVAL: none of them is a core this machine (or its cgroup) has
            raise ValueError(f"cannot bind to cpu cores {format_cores(cores)} ({e.strerror}): the machine has "
                             f"{os.cpu_count()} cores") from None  # fmt: skip
