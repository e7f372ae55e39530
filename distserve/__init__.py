"""distserve: disaggregated prefill/decode LLM serving."""

from distserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from distserve.llm import LLM
from distserve.outputs import RequestOutput
from distserve.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
