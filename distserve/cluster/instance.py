"""An instance: one TP x PP group that behaves like one engine, as a Ray actor.

The actor owns the engine (scheduler, block manager, output processing) and drives the
executor's workers from its own step loop thread, so callers are never on the per-step path:
they queue requests and long-poll for outputs. A rank of one runs the model in the actor itself.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import ray

from distserve.core.config import EngineConfig
from distserve.core.outputs import RequestDelta, RequestOutput
from distserve.core.sampling_params import SamplingParams
from distserve.engine.executor import InstanceFailure, cluster_device
from distserve.engine.llm_engine import LLMEngine
from distserve.kv_transfer.migrator import KVEndpoint, MigrationRecord, Migrator, PrefilledRequest
from distserve.model_executor.model_loader import resolve_model
from distserve.parallel.ranks import check_parallel_config

logger = logging.getLogger(__name__)

IDLE_HEALTH_CHECK_S = 1.0  # an idle instance pings its workers this often, so a death is seen without traffic
MAX_CONCURRENT_CALLS = 16  # threads serving actor calls: long polls must not block submissions
MAX_EXPIRED_IDS = 10_000  # expired request ids remembered to refuse their late releases


@dataclass
class InstanceInfo:
    name: str
    role: str  # its scheduler: prefill, decode or colocated
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_held: int  # prefill: prefilled requests waiting for decode to pull their KV
    num_pending: int  # decode: prefilled requests waiting for blocks or for their KV
    num_throttled_steps: int  # prefill: steps that admitted nothing because held KV passed its limit
    num_admission_waits: int  # decode: handed-over requests that had to wait for free blocks
    failure: str | None


class Instance:
    def __init__(self, config: EngineConfig, name: str) -> None:
        self.name = name
        self.engine = LLMEngine(config, name=name)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()
        self._outputs_ready = threading.Condition(self._lock)
        self._outputs: list[RequestDelta] = []
        self._active: set[str] = set()  # request ids queued or running, guarded by _lock
        self._failure: str | None = None
        self._stopping = False
        # Decode role: requests handed over by prefill, waiting for blocks, then for their KV.
        self._pending: deque[PrefilledRequest] = deque()
        self._migrating: set[str] = set()
        self._cancelled: set[str] = set()  # aborted while their KV was on its way: dropped on arrival
        self._num_admission_waits = 0
        self._waiting_head: str | None = None  # the request at the head of _pending that found no room
        self._migrator: Migrator | None = None
        # Prefill role: requests pulled (their release on its way to the step loop), and requests whose
        # KV was freed at the hold deadline, so that a late release is refused. Both guarded by _lock.
        self._released: set[str] = set()
        self._expired: OrderedDict[str, None] = OrderedDict()
        if self.engine.role == "decode":
            endpoints = self.engine.executor.kv_endpoints(ray.get_runtime_context().current_actor)
            self._migrator = Migrator(name, endpoints, config.cache.block_size, self._migrated)
        self._loop = threading.Thread(target=self._run, name=f"{name}-step-loop", daemon=True)
        self._loop.start()

    # Calls from the cluster -------------------------------------------------------------------

    def ready(self) -> str:
        return self.name

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue a request; raises ValueError for a bad one, InstanceFailure when down."""
        seq = self.engine.make_sequence(prompt, params, request_id, priority)
        with self._lock:
            self._raise_if_failed()
            if seq.request_id in self._active:
                raise ValueError(f"request id '{seq.request_id}' is already in use")
            self._active.add(seq.request_id)
        self._send("add", seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; its last output says ``finish_reason="abort"``."""
        self._send("abort", request_id)

    def add_prefilled(self, prefilled: PrefilledRequest) -> None:
        """Decode: take a request over from a prefill instance once its blocks can be allocated."""
        with self._lock:
            self._raise_if_failed()
            if self.engine.role != "decode":
                raise ValueError(
                    f"{self.name} is a {self.engine.role} instance: only decode instances take over requests"
                )
            if prefilled.request_id in self._active:
                raise ValueError(f"request id '{prefilled.request_id}' is already in use")
            self._active.add(prefilled.request_id)
        self._send("prefilled", prefilled)

    def release(self, request_id: str) -> bool:
        """Prefill: a decode instance has pulled the request's KV; its blocks can go. False when they
        went at the hold deadline already (maybe during the pull): what was pulled cannot be trusted."""
        with self._lock:
            if request_id in self._expired:
                return False
            self._released.add(request_id)
        self._send("release", request_id)
        return True

    def kv(self, method: str, *args):
        """KV transfer calls to this instance's only rank, which runs in this actor."""
        return self.engine.executor.worker.kv(method, *args)

    def kv_endpoints(self) -> list[KVEndpoint]:
        return self.engine.executor.kv_endpoints(ray.get_runtime_context().current_actor)

    def migrations(self) -> dict[str, MigrationRecord]:
        """Decode: the latest KV pulls, by request id."""
        return self._migrator.records() if self._migrator else {}

    def get_outputs(self, timeout: float = 1.0) -> list[RequestDelta]:
        """What each request gained since the last call, waiting up to ``timeout`` seconds for the
        first news."""
        with self._outputs_ready:
            self._outputs_ready.wait_for(lambda: self._outputs or self._failure, timeout)
            if not self._outputs:
                self._raise_if_failed()
            outputs, self._outputs = self._outputs, []
            return outputs

    def info(self) -> InstanceInfo:
        engine = self.engine
        parallel = engine.config.parallel
        return InstanceInfo(
            name=self.name,
            role=engine.config.scheduler.scheduler,
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            num_blocks=engine.block_manager.num_blocks,
            block_size=engine.block_manager.block_size,
            num_free_blocks=engine.block_manager.num_free_blocks,
            num_waiting=engine.scheduler.num_waiting,
            num_running=engine.scheduler.num_running,
            num_preemptions=engine.scheduler.num_preemptions,
            num_held=len(getattr(engine.scheduler, "held", ())),
            num_pending=len(self._pending) + len(engine.admitting),
            num_throttled_steps=getattr(engine.scheduler, "num_throttled_steps", 0),
            num_admission_waits=self._num_admission_waits,
            failure=self._failure,
        )

    def worker_pids(self) -> list[int]:
        return self.engine.executor.worker_pids()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._loop.join(timeout=30)
        if self._migrator is not None:
            self._migrator.stop()
        self.engine.shutdown()

    # The step loop ---------------------------------------------------------------------------

    def _send(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wakeup.set()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise InstanceFailure(self._failure)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._take_inbox()
                self._expire_held()
                self._admit_prefilled()
                if not engine.has_unfinished_requests():
                    if not self._wakeup.wait(IDLE_HEALTH_CHECK_S):  # a quiet second: are the workers alive?
                        engine.executor.check_health()
                    continue
                outputs = engine.step()
                if not outputs:  # nothing could run (prefill held back): wait for a release
                    self._wakeup.wait(IDLE_HEALTH_CHECK_S)
                self._publish(outputs)
        except InstanceFailure as e:
            self._fail(str(e))
        except Exception as e:  # a bug, not a worker death: fail loudly rather than hang callers
            logger.exception("%s: step loop failed", self.name)
            self._fail(f"{self.name}: step loop failed: {e!r}")

    def _take_inbox(self) -> None:
        outputs = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self.engine.add_sequence(payload)
            elif kind == "abort":
                outputs.extend(self._abort(payload))
            elif kind == "release":
                self.engine.release_prefilled(payload)
                self._forget(payload)
                with self._lock:
                    self._released.discard(payload)
            elif kind == "prefilled":
                self._pending.append(payload)
            elif kind == "migrated":
                outputs.extend(self._start_decoding(*payload))
        self._publish(outputs)

    def _expire_held(self) -> None:
        """Prefill: free the KV of requests no decode instance pulled within the hold deadline and
        report them failed. The step loop comes here at least once a second, idle or not."""
        if self.engine.role != "prefill":
            return
        with self._lock:
            expired = [r for r in self.engine.scheduler.expired(time.monotonic()) if r not in self._released]
            for request_id in expired:
                self._expired[request_id] = None
            while len(self._expired) > MAX_EXPIRED_IDS:
                self._expired.popitem(last=False)
        outputs = []
        for request_id in expired:
            logger.warning("%s: no decode instance pulled %s in time: its KV is freed", self.name, request_id)
            output = self.engine.abort_request(request_id, reason="error")
            if output is not None:
                outputs.append(output)
            self._forget(request_id)
        self._publish(outputs)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        if request_id in self._migrating:  # its blocks are being written: drop it when the pull ends
            self._cancelled.add(request_id)
            return []
        for prefilled in self._pending:
            if prefilled.request_id == request_id:
                self._pending.remove(prefilled)
                return [_aborted(prefilled)]
        output = self.engine.abort_request(request_id)
        return [output] if output is not None else []

    def _admit_prefilled(self) -> None:
        """Decode: allocate blocks for waiting handed-over requests, in arrival order, while they fit."""
        while self._pending:
            seq = self.engine.admit_prefilled(self._pending[0])
            if seq is None:
                if self._waiting_head != self._pending[0].request_id:
                    self._waiting_head = self._pending[0].request_id
                    self._num_admission_waits += 1
                return
            prefilled = self._pending.popleft()
            self._migrating.add(prefilled.request_id)
            self._migrator.submit(prefilled, seq.block_table)

    def _migrated(self, request_id: str, record: MigrationRecord | None, error: str | None) -> None:
        """Called on the migrator's thread; the step loop takes it from there."""
        self._send("migrated", (request_id, record, error))

    def _start_decoding(
        self, request_id: str, record: MigrationRecord | None, error: str | None
    ) -> list[RequestOutput]:
        self._migrating.discard(request_id)
        if request_id in self._cancelled or error is not None:
            self._cancelled.discard(request_id)
            if error is not None:
                logger.error("%s: %s: %s", self.name, request_id, error)
            output = self.engine.abort_request(request_id, "error" if error is not None else "abort")
            return [output] if output is not None else []
        self.engine.start_decoding(request_id, record.start, record.end)
        return []

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._active.discard(request_id)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        with self._outputs_ready:
            self._outputs.extend(RequestDelta.of(o) for o in outputs)
            self._active.difference_update(o.request_id for o in outputs if o.finished)
            self._outputs_ready.notify_all()

    def _fail(self, reason: str) -> None:
        logger.error("%s", reason)
        with self._outputs_ready:
            self._failure = reason
            self._outputs_ready.notify_all()


def _aborted(prefilled: PrefilledRequest) -> RequestOutput:
    """The final output of a handed-over request aborted before this instance allocated it."""
    return RequestOutput(
        request_id=prefilled.request_id,
        prompt=prefilled.prompt,
        prompt_token_ids=prefilled.token_ids[: prefilled.num_prompt_tokens],
        output_token_ids=prefilled.token_ids[prefilled.num_prompt_tokens :],
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="abort",
        num_cached_tokens=0,
    )


def launch_instance(config: EngineConfig, name: str) -> Any:
    """Start an instance actor named ``name`` and wait until its model is loaded; returns the handle.

    Raises ValueError for a bad configuration or a name in use, InstanceFailure when a worker fails.
    """
    check_parallel_config(resolve_model(config.model).hf_config, config.parallel)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=cluster_device(config)))
    # A single rank runs in the instance actor, which then needs the GPU; otherwise its workers do.
    gpus = 1 if config.parallel.world_size == 1 and config.model.device == "cuda" else 0
    try:
        ray.get_actor(name)
    except ValueError:
        pass
    else:
        raise ValueError(f"an actor named '{name}' already exists in this Ray cluster: instance names must be unique")
    handle = (
        ray.remote(Instance)
        .options(name=name, num_cpus=0, num_gpus=gpus, max_concurrency=MAX_CONCURRENT_CALLS)
        .remote(config, name)
    )
    try:
        ray.get(handle.ready.remote())
    except ray.exceptions.RayActorError as e:
        ray.kill(handle)
        raise InstanceFailure(f"{name}: the instance failed to start: {e}") from None
    return handle
