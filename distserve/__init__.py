"""distserve: disaggregated prefill/decode LLM serving.

The public names load on first use, so a client (``distserve.entrypoints.client``, the
benchmark) imports neither torch nor Ray."""

import importlib

_EXPORTS = {
    "LLM": "distserve.llm",
    "AsyncCluster": "distserve.cluster",
    "Cluster": "distserve.cluster",
    "ClusterConfig": "distserve.cluster_config",
    "PoolConfig": "distserve.cluster_config",
    "ParallelConfig": "distserve.config",
    "CacheConfig": "distserve.config",
    "EngineConfig": "distserve.config",
    "ModelConfig": "distserve.config",
    "RequestOutput": "distserve.outputs",
    "SamplingParams": "distserve.sampling_params",
    "SchedulerConfig": "distserve.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distserve' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
