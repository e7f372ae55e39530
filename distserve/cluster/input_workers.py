"""Threads that do requests' CPU work away from the serving loop: tokenizing prompts, chat
templates, bad words, grammar compiles, ``/tokenize`` and ``/detokenize``.

One asyncio loop serves gRPC, HTTP and every instance's output poll; work done on it holds every
stream for as long as it takes (tokenizing 2 MiB of prompt took 2.0 s with the tiny model's
tokenizer). Here the loop hands the work to a thread and awaits its result, so it goes on routing
tokens meanwhile. Threads suffice because the work gives the GIL up: transformers' fast tokenizers
encode through ``encode_batch``, which releases it while Rust works (a 2 MiB prompt kept another
thread from running at most 0.08 s in all its 2.0 s, the token lists' conversion; the
``tokenizers`` library's own ``Tokenizer.encode`` would have kept it throughout), the grammar
library releases it while compiling, and pure-Python work (a chat template) gives it up every
``sys.getswitchinterval()``. The work is the same function wherever it runs
(``InputProcessor.process`` validates for the engines too).

``num_workers`` threads run jobs; the others wait in order of arrival. Each waiting job is a
request's, so the servers' admission limit (``max_pending_requests``) bounds the queue and is where
a busy server refuses (RESOURCE_EXHAUSTED / 429), once: a request it admitted is not refused later
for the same load, and a Python API caller's batch of thousands of prompts waits its turn rather
than failing in part.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class InputWorkers:
    def __init__(self, num_workers: int) -> None:
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="distserve-input")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a worker thread; its exception is raised here. A job cancelled
        while it waits never runs; one cancelled while it runs finishes (a thread cannot be
        stopped) and its result is dropped."""
        job = self._executor.submit(functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            job.cancel()  # at once: the wrapper's own cancel of it comes a turn of the loop later
            raise

    def shutdown(self) -> None:
        """Drop the waiting jobs; running ones end on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)
