"""An instance's outputs, queued apart for each API server: every request's deltas go to the server
that sent it (its owner), which long-polls for its own and for nothing else, so no server routes
another's tokens. A server that stops polling for the lease it asks for (its process died) has its
requests ended on the instance, freeing their KV, while the other servers' go on.

The one-server cluster is the server ``""``; deltas of a request whose owner is not known (any
left after its run ended) go there too, where the orchestrator drops what it does not know.
Not thread-safe: the instance calls it under its lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from distserve.core.outputs import RequestDelta

DEFAULT_SERVER = ""


@dataclass
class ServerQueue:
    deltas: list[RequestDelta] = field(default_factory=list)
    urgent: bool = False  # a delta holds a first token, a hand-over or an end: the poll returns at once
    next_return: float = 0.0  # time.monotonic() before which plain decode tokens wait
    polls: int = 0  # the server's calls waiting here now: a server inside a long poll is alive
    lease: float | None = None  # seconds without a call after which its requests end (None: never)
    last_poll: float = field(default_factory=time.monotonic)  # when its latest call returned


@dataclass
class ServerLoad:
    """What one server's requests hold on an instance, in the router's units."""

    load_tokens: int = 0  # prompts and the most their samples may generate
    prefill_tokens: int = 0  # prompt tokens not yet computed

    def add(self, prompt_tokens: int, max_tokens: list[int], to_prefill: int) -> None:
        self.load_tokens += prompt_tokens + sum(max_tokens)
        self.prefill_tokens += max(0, to_prefill)


class OutputQueues:
    def __init__(self) -> None:
        self.queues: dict[str, ServerQueue] = {DEFAULT_SERVER: ServerQueue()}
        self.owners: dict[str, str] = {}  # request id -> the server that sent it

    def own(self, request_id: str, server: str) -> None:
        self.owners[request_id] = server
        self.queues.setdefault(server, ServerQueue())

    def queue(self, server: str) -> ServerQueue:
        """``server``'s queue (a server polling before it sent anything gets one)."""
        return self.queues.setdefault(server, ServerQueue())

    def put(self, delta: RequestDelta, run_over: bool) -> ServerQueue:
        """Queue ``delta`` for its request's owner, whose queue it returns; ``run_over``: the
        request's last delta here, after which its owner is forgotten."""
        server = self.owners.pop(delta.request_id, DEFAULT_SERVER) if run_over else self.owners.get(delta.request_id)
        target = self.queues.get(server if server is not None else DEFAULT_SERVER) or self.queues[DEFAULT_SERVER]
        target.deltas.append(delta)
        target.urgent = target.urgent or delta.finished or delta.handover is not None or delta.first
        return target

    def silent(self, now: float) -> list[str]:
        """The servers with requests here that have not polled for their lease, none of their
        calls waiting: gone (or cut off), so their requests will never be read."""
        owning = set(self.owners.values())
        return [
            server
            for server, q in self.queues.items()
            if server in owning and q.lease is not None and not q.polls and now - q.last_poll > q.lease
        ]

    def drop_server(self, server: str) -> list[str]:
        """Forget a silent server: its queue, and the ids of its requests, which the caller ends."""
        self.queues.pop(server, None)
        requests = [request_id for request_id, owner in self.owners.items() if owner == server]
        for request_id in requests:
            del self.owners[request_id]
        return requests
