"""distserve: disaggregated prefill/decode LLM serving."""

from distserve.cluster import AsyncCluster, Cluster
from distserve.cluster_config import ClusterConfig, PoolConfig
from distserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from distserve.llm import LLM
from distserve.outputs import RequestOutput
from distserve.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncCluster",
    "Cluster",
    "ClusterConfig",
    "PoolConfig",
    "ParallelConfig",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
