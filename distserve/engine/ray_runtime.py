"""Connecting this process to Ray when it is not yet: to the running cluster, or to a local one
started here.

A local Ray is started from a thread that lives as long as the process. Ray spawns its local
processes (GCS, raylet) with ``PR_SET_PDEATHSIG``, which Linux ties to the *thread* that spawned
them, not the process: started from an event loop's thread they are killed when that thread ends
(a ``Cluster`` closing, an ``asyncio.run`` on a worker thread returning), and the next cluster in
the process finds its GCS gone. From a thread that never ends they live until the process exits,
and Ray's own atexit hook shuts them down then; every cluster in between reuses them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future

import ray

_requests: queue.SimpleQueue[Future[None]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()


def _init_requested_forever() -> None:
    while True:
        future = _requests.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            if not ray.is_initialized():  # an earlier request may have started it
                ray.init()
        except BaseException as error:
            future.set_exception(error)
        else:
            future.set_result(None)


def _request_init() -> Future[None]:
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = threading.Thread(target=_init_requested_forever, name="distserve-ray", daemon=True)
            _thread.start()
    future: Future[None] = Future()
    _requests.put(future)
    return future


def ensure_ray() -> None:
    """Connect to Ray unless this process already is; a local Ray outlives the calling thread."""
    if not ray.is_initialized():
        _request_init().result()


async def ensure_ray_async() -> None:
    """``ensure_ray`` that leaves the event loop running while a local Ray starts (seconds)."""
    if not ray.is_initialized():
        await asyncio.wrap_future(_request_init())
