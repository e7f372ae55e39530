"""KV between CUDA ranks on one machine, read in place over CUDA IPC ("ipc").

The source publishes a handle to its whole KV cache; the destination opens it on its own device and
copies the slots it pulls straight from the source's memory, GPU to GPU (through NVLink or PCIe
peer access when the source's GPU is another one), every layer in one gather-scatter
(``slot_copy.copy_slots``; without Triton a layer and a chunk at a time), on a stream of its own.
That is the fastest way within a node, and the only one when both instances share one GPU: NCCL
refuses two ranks on the same device.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from distserve.kv_transfer.slot_copy import copy_slots
from distserve.kv_transfer.transport import RankKV
from distserve.kv_transfer.transports.in_place import InPlaceTransport, machine_key


class CudaIpcTransport(InPlaceTransport):
    name = "ipc"

    def __init__(self, kv: RankKV) -> None:
        super().__init__(kv)
        # The copies' stream: a decode step on the default stream neither waits for them nor they
        # for it (the blocks they fill are no step's yet).
        self._stream = torch.cuda.Stream(kv.device)

    def _place(self) -> str:
        return machine_key()

    def _handle(self) -> tuple:
        return reduce_tensor(self.kv.tensor)

    def _open(self, handle: object) -> torch.Tensor:
        """The source's cache from its reduced handle, opened on this rank's device.

        The handle carries the source's device index, which means another GPU or none at all in
        this process when the two see different devices (each Ray actor sees only its own). CUDA
        maps the memory into the device it is opened on, reaching the source's GPU by peer access
        if it is another, so it is opened on this rank's device and the copies run here."""
        rebuild, args = handle
        if rebuild is not rebuild_cuda_tensor:
            raise ValueError(f"not a CUDA tensor handle: {rebuild}")
        bound = inspect.signature(rebuild).bind(*args)
        bound.arguments["storage_device"] = self.kv.device.index
        # Opening waits for the source's event on the current stream: make it the one the copies use.
        with torch.cuda.device(self.kv.device), torch.cuda.stream(self._stream):
            return rebuild(*bound.args, **bound.kwargs)

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()

    def _copy(self, here: torch.Tensor, slots: list[int], there: torch.Tensor, src_slots: list[int]) -> None:
        # Through NumPy: torch.tensor of a list of Python ints is 3-4x slower, which was as long as
        # the copy itself for thousands of tokens.
        index, src_index = torch.from_numpy(np.array((slots, src_slots), dtype=np.int64)).to(self.kv.device)
        copy_slots(here, index, there, src_index, self.kv.chunk_tokens)
