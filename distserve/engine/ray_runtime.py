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
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any

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


NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
CUDA_MODULE_LOADING = "CUDA_MODULE_LOADING"


def one_gpu_shared_options() -> dict[str, Any]:
    """``ray.init`` options that let a prefill and a decode instance share a machine's one GPU.

    An instance of one rank asks Ray for a whole GPU, so on a one-GPU machine a second instance
    would wait for ever. Ray is told of two GPUs instead and leaves ``CUDA_VISIBLE_DEVICES`` alone,
    so every actor sees the one device; the instances' KV then moves over CUDA IPC, as between two
    GPUs of a node. Empty unless this machine has exactly one GPU. Size each instance's KV cache
    by blocks (``num_kv_blocks``): sized by free memory, the first would take the second's share.
    """
    import torch

    if torch.cuda.device_count() != 1:
        return {}
    os.environ[NOSET_CUDA_VISIBLE_DEVICES] = "1"  # the local raylet and its workers inherit it
    return {"num_gpus": 2, "runtime_env": {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}}


def cuda_actor_options(device: str) -> dict[str, Any]:
    """Ray options for an actor that runs a model on ``device``: on CUDA, its process loads every
    kernel when its CUDA context starts (``CUDA_MODULE_LOADING=EAGER``) unless the environment Ray
    is started from names a mode. CUDA's default, lazy loading, loads each kernel at its first
    launch: on an H200 the first steps of shapes an instance had not yet run (chunked steps of 1 to
    13 sequences in the first role changes) stalled 1.0-1.3 s each, all of it in the forward pass,
    and with every kernel loaded at start no step did."""
    if device != "cuda":
        return {}
    return {"runtime_env": {"env_vars": {CUDA_MODULE_LOADING: os.environ.get(CUDA_MODULE_LOADING, "EAGER")}}}
