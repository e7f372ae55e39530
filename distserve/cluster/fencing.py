"""Fencing an instance that stopped answering: its processes are killed on their node.

A process that is stopped (SIGSTOP, a swapped-out or frozen host) takes no message, so Ray's own
kill of its actor leaves it in place, holding its sockets: a decode instance pulling KV from it
would wait in the transfer until the collective timeout, minutes later. SIGKILL is delivered to a
stopped process too; once the process is gone its peers' transfers fail at once and their
requests run again elsewhere. The kill runs as a task pinned to the instance's node, so it reaches
a process on any node of the Ray cluster. This module imports nothing heavy: the task's worker
loads it without torch.
"""

from __future__ import annotations

import logging
import os
import signal

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
def _kill_processes(pids: tuple[int, ...]) -> list[int]:
    """SIGKILL ``pids`` on this node; the ones that were still there."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append(pid)
    return killed


async def fence(handle: ray.actor.ActorHandle, processes: tuple[tuple[str, int], ...]) -> None:
    """Kill an instance's actor and, on each node, its ``processes`` (Ray node id, pid), whatever
    state they are in."""
    try:
        ray.kill(handle)  # its pending calls raise now, and Ray will not restart it
    except Exception:
        logger.exception("could not kill the actor of a fenced instance")
    by_node: dict[str, list[int]] = {}
    for node_id, pid in processes:
        by_node.setdefault(node_id, []).append(pid)
    for node_id, pids in by_node.items():
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        try:
            killed = await _kill_processes.options(scheduling_strategy=strategy).remote(tuple(pids))
        except Exception:  # the node is gone as well: so are the processes
            logger.exception("could not kill processes %s on node %s", pids, node_id)
            continue
        logger.warning("fenced: killed processes %s of %s on node %s", killed, pids, node_id)
