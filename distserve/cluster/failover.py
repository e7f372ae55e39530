"""What happens when an instance dies: it is replaced, and the requests that needed it run again.

A dead instance (its long poll raised: the actor died, or it reported its workers failed) is
replaced by a new actor under a new name (``<cluster>-<role>-rN``), tried ``REPLACEMENT_ATTEMPTS``
times with backoff. Each request that still needed it is aborted where else it was (freeing its
blocks there) and run again from its prompt as its next attempt, up to ``max_request_attempts``
runs (``Orchestrator.rerun``). A request whose KV had already reached its decode instance no longer
needs the prefill side and goes on. While no instance of a role is left but one is starting,
requests wait for it (``InstancePool.healthy``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import ray

from distserve.cluster.instance import launch_instance
from distserve.cluster.instance_pool import InstancePool
from distserve.cluster.request_table import RequestState
from distserve.cluster.routing import InstanceState
from distserve.core.errors import InstanceFailure
from distserve.engine.node_groups import on_nodes_left

logger = logging.getLogger(__name__)

# Starting a replacement is tried this many times, waiting twice as long after each failure.
REPLACEMENT_ATTEMPTS = 3
REPLACEMENT_BACKOFF_S = 1.0


class Failover:
    """Replaces failed instances (``replace``) under names after the cluster's (``name``) and says
    which requests need running again; the orchestrator re-runs them. ``spawn`` runs a coroutine in
    the background; ``replaced(new, failed)`` puts a started replacement to work."""

    def __init__(
        self,
        name: str,
        replace: bool,
        instances: InstancePool,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        replaced: Callable[[InstanceState, InstanceState], None],
        tier_stores: dict[str, Any] | None = None,
        manages: bool = True,
    ) -> None:
        """``tier_stores``: the prefix tier's stores by node id (filled once the cluster starts).
        ``manages``: this server manages the cluster; another only counts on its replacements
        (until the view it follows says otherwise) and re-runs its own requests."""
        self.name = name
        self.manages = manages
        self.tier_stores = tier_stores if tier_stores is not None else {}
        self.replace = replace
        self.instances = instances
        self.spawn = spawn
        self.replaced = replaced
        self._generation = 0  # numbers replacement actors' names

    def instance_failed(
        self, entry: InstanceState, error: BaseException, requests: Iterable[RequestState]
    ) -> list[tuple[RequestState, InstanceFailure]]:
        """``entry`` is gone: replace it (if configured); the runs of ``requests`` that needed it,
        with the failure to re-run (or fail) them with."""
        entry.failure = str(error)
        logger.error("instance %s failed: %s", entry.name, error)
        if self.replace and not self.instances.closed:
            self.instances.replacing[entry.role] = self.instances.replacing.get(entry.role, 0) + 1
            if self.manages:
                self.spawn(self._replace(entry))
        if self.manages:
            self.spawn(self._tell_peers(entry))
        needed = []
        for state in requests:
            if state.finished or entry not in state.instances():
                continue
            if entry is state.prefill and entry is not state.decode and state.metrics.migration_end is not None:
                continue  # its KV is on the decode instance already: it no longer needs the prefill side
            needed.append((state, InstanceFailure(f"instance {entry.name} failed: {error}")))
        return needed

    async def _tell_peers(self, failed: InstanceState) -> None:
        """Every live instance drops its KV channels to ``failed`` (their communicators and what the
        migrator cached); one that cannot answer is gone too and will be told nothing."""
        peers = [s for s in self.instances.live() if s is not failed]
        calls = [s.handle.forget_peer.remote(failed.name) for s in peers]
        calls += [store.forget.remote(failed.name) for store in self.tier_stores.values()]  # its pins
        await asyncio.gather(*calls, return_exceptions=True)

    async def _replace(self, failed: InstanceState) -> None:
        """Start a new instance in place of ``failed``, under a new actor name (peers know each other
        by name), and put it to work once its model is loaded. After the last failed try the dead
        instance stays listed, with why it was not replaced."""
        try:
            try:
                ray.kill(failed.handle)  # a failed worker may leave the actor itself up
            except Exception:
                pass
            entry = await self._launch_replacement(failed)
            if entry is None:
                return
            if self.instances.closed:
                ray.kill(entry.handle)
                return
            logger.info("%s replaces %s", entry.name, failed.name)
            self.replaced(entry, failed)
        finally:
            self.instances.replacing[failed.role] -= 1
            await self.instances.changed()

    async def _launch_replacement(self, failed: InstanceState) -> InstanceState | None:
        loop = asyncio.get_running_loop()
        for attempt in range(REPLACEMENT_ATTEMPTS):
            if attempt:
                await asyncio.sleep(REPLACEMENT_BACKOFF_S * 2 ** (attempt - 1))
            if self.instances.closed:
                return None
            self._generation += 1
            name = f"{self.name}-{failed.role}-r{self._generation}"
            config = on_nodes_left(failed.config)
            try:
                handle = await loop.run_in_executor(None, launch_instance, config, name, self.tier_stores)
                return InstanceState(name, failed.role, handle, await handle.info.remote(), config)
            except Exception as e:
                logger.error("could not replace %s (try %d of %d): %s", failed.name, attempt + 1,
                             REPLACEMENT_ATTEMPTS, e)  # fmt: skip
                error = e
        failed.failure = f"{failed.failure}; not replaced after {REPLACEMENT_ATTEMPTS} tries: {error}"
        return None
