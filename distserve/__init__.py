"""distserve: disaggregated prefill/decode LLM serving.

The public names load on first use, so a client (``distserve.entrypoints.client``, the
benchmark) imports neither torch nor Ray."""

import importlib

_EXPORTS = {
    "LLM": "distserve.entrypoints.llm",
    "AsyncCluster": "distserve.cluster.api",
    "Cluster": "distserve.cluster.api",
    "ClusterConfig": "distserve.cluster.config",
    "PoolConfig": "distserve.cluster.config",
    "ParallelConfig": "distserve.core.config",
    "CacheConfig": "distserve.core.config",
    "EngineConfig": "distserve.core.config",
    "ModelConfig": "distserve.core.config",
    "RequestOutput": "distserve.core.outputs",
    "SamplingParams": "distserve.core.sampling_params",
    "BeamSearchParams": "distserve.core.beams",
    "SchedulerConfig": "distserve.core.config",
    "Role": "distserve.core.role",
    "RequestError": "distserve.core.errors",
    "InstanceFailure": "distserve.core.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distserve' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
