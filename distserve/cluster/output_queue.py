"""A request's outputs on their way from the orchestrator's polls to its client's stream."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class OutputQueue:
    """``asyncio.Queue``'s ``put_nowait``, ``get``, ``get_nowait`` and ``empty`` for one consumer,
    without its task counts and putters' queue: every token passes through one, and asyncio.Queue's
    bookkeeping cost as much as the rest of a token's way from the poll to the client's stream."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():  # done: its consumer was cancelled
            self._waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items
