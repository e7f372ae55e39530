"""The KV transports, one module each, and the one place that says which a channel may use.

A channel tries its device's transports in order and keeps the first whose handshake succeeds at
both ends; the last of each always does. A new transport (NIXL, Mooncake) is a ``KVTransport``
(``kv_transfer/transport.py``) in a module of its own, put in this table where it is to be tried.
"""

from __future__ import annotations

from distserve.kv_transfer.transport import KVTransport
from distserve.kv_transfer.transports.cuda_ipc import CudaIpcTransport
from distserve.kv_transfer.transports.group import GlooTransport, NcclTransport
from distserve.kv_transfer.transports.shared_memory import SharedMemoryTransport

TRANSPORTS: dict[str, tuple[type[KVTransport], ...]] = {
    "cuda": (CudaIpcTransport, NcclTransport),
    "cpu": (SharedMemoryTransport, GlooTransport),
}
