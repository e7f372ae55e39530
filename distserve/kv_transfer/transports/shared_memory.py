"""KV between CPU ranks on one machine and one Ray node, read in place ("shm").

The source's cache lives in an anonymous memory file (``kv_transfer/shared_memory.py``); it
publishes ``/proc/<pid>/fd/<fd>``, and the destination maps the file and copies the slots it pulls
out of it on the pull's thread, one strided copy over every layer for each run of slots consecutive
on both sides (``slot_copy.copy_slot_runs``). Ray nodes sharing a machine count as different
places, so that they move KV as a multi-node deployment does.
"""

from __future__ import annotations

import torch

from distserve.kv_transfer.shared_memory import SharedFile
from distserve.kv_transfer.slot_copy import copy_slot_runs
from distserve.kv_transfer.transports.in_place import InPlaceTransport, machine_key


def ray_node() -> str:
    """This process's Ray node id; empty outside Ray."""
    import ray  # only channels ask: an engine alone never loads Ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


class SharedMemoryTransport(InPlaceTransport):
    name = "shm"
    place_name = "machine or Ray node"

    def _place(self) -> str:
        return f"{machine_key()}/{ray_node()}"

    def _publishes(self) -> bool:
        return super()._publishes() and self.kv.shared is not None  # a cache in ordinary memory cannot be mapped

    def _handle(self) -> SharedFile:
        assert self.kv.shared is not None  # it publishes
        return self.kv.shared

    def _open(self, handle: object) -> torch.Tensor:
        if not isinstance(handle, SharedFile):
            raise ValueError(f"not a shared memory file: {handle!r}")
        return handle.open()

    def _copy(self, here: torch.Tensor, slots: list[int], there: torch.Tensor, src_slots: list[int]) -> None:
        copy_slot_runs(here, slots, there, src_slots)
