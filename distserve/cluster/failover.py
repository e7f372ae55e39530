"""What happens when an instance dies: it is replaced, and the requests that needed it run again.

A dead instance (its long poll raised: the actor died, or it reported its workers failed) is
replaced by a new actor under a new name (``<cluster>-<role>-rN``), tried ``REPLACEMENT_ATTEMPTS``
times with backoff. Each request that still needed it is aborted where else it was (freeing its
blocks there) and run again from its prompt as its next attempt, up to ``max_request_attempts``
runs. A request whose KV had already reached its decode instance no longer needs the prefill
side and goes on. While no instance of a role is left but one is starting, requests wait for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from distserve.cluster.instance import launch_instance
from distserve.cluster.routing import InstanceState
from distserve.core.errors import InstanceFailure
from distserve.core.role import Role

if TYPE_CHECKING:
    from distserve.cluster.orchestrator import Orchestrator, RequestState

logger = logging.getLogger(__name__)

# How long a request waits for a replacement when no healthy instance of the role it needs is left.
REPLACEMENT_WAIT_S = 60.0
# Starting a replacement is tried this many times, waiting twice as long after each failure.
REPLACEMENT_ATTEMPTS = 3
REPLACEMENT_BACKOFF_S = 1.0


class Failover:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        self._replacing: dict[Role, int] = {}  # replacements under way, by role
        self._pool_changed = asyncio.Condition()  # notified when a replacement or a role change ends
        self._generation = 0  # numbers replacement actors' names

    def instance_failed(self, entry: InstanceState, error: BaseException) -> None:
        """``entry`` is gone: replace it (if configured) and re-run (or fail) what needed it."""
        orchestrator = self.orchestrator
        entry.failure = str(error)
        logger.error("instance %s failed: %s", entry.name, error)
        if orchestrator.config.replace_failed_instances and not orchestrator.closed:
            self._replacing[entry.role] = self._replacing.get(entry.role, 0) + 1
            orchestrator.spawn(self._replace(entry))
        orchestrator.spawn(self._tell_peers(entry))
        for state in list(orchestrator.requests.values()):
            if state.finished or entry not in state.instances():
                continue
            if entry is state.prefill and entry is not state.decode and state.metrics.migration_end is not None:
                continue  # its KV is on the decode instance already: it no longer needs the prefill side
            failure = InstanceFailure(f"instance {entry.name} failed: {error}")
            orchestrator.spawn(self.rerun(state, state.attempt, failure))

    async def _tell_peers(self, failed: InstanceState) -> None:
        """Every live instance drops its KV channels to ``failed`` (their communicators and what the
        migrator cached); one that cannot answer is gone too and will be told nothing."""
        peers = [s for s in self.orchestrator.instances if s is not failed and s.failure is None]
        await asyncio.gather(*(s.handle.forget_peer.remote(failed.name) for s in peers), return_exceptions=True)

    async def healthy(self, pool: Callable[[], list[InstanceState]]) -> list[InstanceState]:
        """``pool()`` (healthy instances that take new work); while it is empty but an instance is
        being replaced or changing role, wait for that (up to REPLACEMENT_WAIT_S)."""
        if pool() or not self._under_way():
            return pool()
        async with self._pool_changed:
            try:
                await asyncio.wait_for(
                    self._pool_changed.wait_for(lambda: pool() or not self._under_way()), REPLACEMENT_WAIT_S
                )
            except TimeoutError:
                pass
        return pool()

    async def pools_changed(self) -> None:
        """Wake the requests waiting for an instance to take them."""
        async with self._pool_changed:
            self._pool_changed.notify_all()

    def _under_way(self) -> bool:
        return any(self._replacing.values()) or self.orchestrator.roles.under_way

    def unavailable_role(self) -> str | None:
        """The role the cluster needs with no healthy instance, nor one being replaced or changing."""
        if self._under_way():
            return None
        orchestrator = self.orchestrator
        if not orchestrator.entry_pool():
            return "decode" if orchestrator.pool(Role.PREFILL) else "prefill or colocated"
        return None

    async def rerun(self, state: RequestState, attempt: int, error: InstanceFailure | None) -> None:
        """Free the failed run's (``attempt``'s) blocks on the instances still up, then run the request
        again from its prompt as its next attempt, so outputs of the old run still in flight are told
        apart. Another failure of the same run, reported while or after this one re-runs it, is ignored.
        ``error`` None: the run was given back by a role change, which counts as no failure."""
        orchestrator = self.orchestrator
        if state.finished or state.cancelled or state.attempt != attempt or state.rerunning:
            return
        state.rerunning = True
        try:
            targets = state.instances()
            orchestrator.unassign(state)
            await orchestrator.abort_run(targets, state.request_id, attempt)
            final = None
            state.failed_runs += error is not None
            if state.failed_runs >= orchestrator.config.max_request_attempts:
                final = error
            elif role := self.unavailable_role():
                final = InstanceFailure(f"{error or 'given back'}; no {role} instance is left to run it again")
            if final is not None:  # no run left: the request ends with the failure
                orchestrator.forget(state)
                state.queue.put_nowait(final)
                return
            state.new_attempt()
            logger.log(logging.WARNING if error else logging.DEBUG, "%s; re-running %s (run %d)",
                       error or "given back by a role change", state.request_id, state.attempt + 1)  # fmt: skip
        finally:
            state.rerunning = False
        try:
            await orchestrator.submit(state)
        except Exception as e:
            state.queue.put_nowait(e)

    async def _replace(self, failed: InstanceState) -> None:
        """Start a new instance in place of ``failed``, under a new actor name (peers know each other
        by name), and poll it once its model is loaded. After the last failed try the dead instance
        stays listed, with why it was not replaced."""
        orchestrator = self.orchestrator
        try:
            try:
                ray.kill(failed.handle)  # a failed worker may leave the actor itself up
            except Exception:
                pass
            entry = await self._launch_replacement(failed)
            if entry is None:
                return
            if orchestrator.closed:
                ray.kill(entry.handle)
                return
            orchestrator.add_instance(entry, replacing=failed)
            logger.info("%s replaces %s", entry.name, failed.name)
            orchestrator.spread_prompts()  # the failed one's prompts went to the others meanwhile
        finally:
            self._replacing[failed.role] -= 1
            async with self._pool_changed:
                self._pool_changed.notify_all()

    async def _launch_replacement(self, failed: InstanceState) -> InstanceState | None:
        loop = asyncio.get_running_loop()
        for attempt in range(REPLACEMENT_ATTEMPTS):
            if attempt:
                await asyncio.sleep(REPLACEMENT_BACKOFF_S * 2 ** (attempt - 1))
            if self.orchestrator.closed:
                return None
            self._generation += 1
            name = f"{self.orchestrator.config.name}-{failed.role}-r{self._generation}"
            try:
                handle = await loop.run_in_executor(None, launch_instance, failed.config, name)
                return InstanceState(name, failed.role, handle, await handle.info.remote(), failed.config)
            except Exception as e:
                logger.error("could not replace %s (try %d of %d): %s", failed.name, attempt + 1,
                             REPLACEMENT_ATTEMPTS, e)  # fmt: skip
                error = e
        failed.failure = f"{failed.failure}; not replaced after {REPLACEMENT_ATTEMPTS} tries: {error}"
        return None
