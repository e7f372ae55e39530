"""GPU and cluster specs for placement: peak FLOP/s, memory bandwidth and size, link bandwidths.

Figures are per direction and dense (no structured sparsity), as NVIDIA datasheets print them; a YAML
file can override any of them (``cluster_from_dict`` / ``load_hardware``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_GIB = 1 << 30


@dataclass(frozen=True)
class GPUSpec:
    """One GPU: dense bf16/fp16 tensor-core FLOP/s, memory bandwidth (bytes/s) and memory (bytes)."""

    name: str
    flops: float
    memory_bandwidth: float
    memory_bytes: int

    def __post_init__(self) -> None:
        for field in ("flops", "memory_bandwidth", "memory_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"GPU {self.name!r}: {field} must be positive, got {getattr(self, field)!r}")


# HBM sizes are binary: nvidia-smi shows 81920 MiB on an A100-80GB, so the datasheets' "GB" is GiB here.
GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense; 40GB HBM2 at 1,555 GB/s.
    "A100-40GB": GPUSpec("A100-40GB", 312e12, 1.555e12, 40 * _GIB),
    # Same datasheet, 80GB HBM2e SXM: 2,039 GB/s.
    "A100-80GB": GPUSpec("A100-80GB", 312e12, 2.039e12, 80 * _GIB),
    # NVIDIA H100 datasheet, SXM: BF16 1,979 TFLOPS with sparsity, so 989 dense; HBM3 3.35 TB/s.
    "H100-80GB": GPUSpec("H100-80GB", 989e12, 3.35e12, 80 * _GIB),
    # NVIDIA H200 datasheet, SXM: same compute as H100; 141GB HBM3e at 4.8 TB/s.
    "H200": GPUSpec("H200", 989e12, 4.8e12, 141 * _GIB),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity); 48GB GDDR6 at 864 GB/s.
    "L40S": GPUSpec("L40S", 362e12, 0.864e12, 48 * _GIB),
}

_GPU_NAMES = {name.lower(): name for name in GPUS}


def gpu_preset_name(name: str) -> str | None:
    """The canonical spelling of a GPU preset, matched case-insensitively (``a100-80gb`` is ``A100-80GB``)."""
    return _GPU_NAMES.get(name.lower())


@dataclass(frozen=True)
class _NodeLinks:
    intra_node_bandwidth: float  # bytes/s per GPU, one direction
    inter_node_bandwidth: float  # bytes/s per node, one direction


# A typical node of each GPU, for link bandwidths a YAML file leaves out. NVLink: A100 600 GB/s and
# H100/H200 900 GB/s bidirectional (datasheets), halved per direction; L40S has no NVLink, so PCIe Gen4 x16
# (64 GB/s bidirectional). Across nodes one NIC per node: HDR 200 Gb/s with A100/L40S, NDR 400 Gb/s with H100/H200.
_NODE_LINKS: dict[str, _NodeLinks] = {
    "A100-40GB": _NodeLinks(300e9, 25e9),
    "A100-80GB": _NodeLinks(300e9, 25e9),
    "H100-80GB": _NodeLinks(450e9, 50e9),
    "H200": _NodeLinks(450e9, 50e9),
    "L40S": _NodeLinks(32e9, 25e9),
}


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes of identical GPUs; bandwidths in bytes/s, intra per GPU and inter per node."""

    gpu: GPUSpec
    num_nodes: int
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float

    def __post_init__(self) -> None:
        for field in ("num_nodes", "gpus_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)!r}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


_GPU_KEYS = {"name", "flops", "memory_bandwidth", "memory_bytes", "memory_gib"}
_CLUSTER_KEYS = {"gpu", "gpu_overrides", "num_nodes", "gpus_per_node", "intra_node_bandwidth", "inter_node_bandwidth"}


def _number(value: Any, field: str) -> float:
    # PyYAML reads "25e9" (no dot) as a string, so accept numbers written either way.
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a number, got {value!r}") from None


def _check_keys(data: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"unknown {where} keys: {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def _gpu_fields(data: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(data, _GPU_KEYS, where)
    if "memory_gib" in data and "memory_bytes" in data:
        raise ValueError(f"{where}: give memory_gib or memory_bytes, not both")
    fields: dict[str, Any] = {}
    if "name" in data:
        fields["name"] = str(data["name"])
    for key in ("flops", "memory_bandwidth"):
        if key in data:
            fields[key] = _number(data[key], key)
    if "memory_bytes" in data:
        fields["memory_bytes"] = int(_number(data["memory_bytes"], "memory_bytes"))
    if "memory_gib" in data:
        fields["memory_bytes"] = int(_number(data["memory_gib"], "memory_gib") * _GIB)
    return fields


def gpu_from_value(value: str | dict[str, Any], overrides: dict[str, Any] | None = None) -> GPUSpec:
    """A preset name (``"A100-80GB"``) or a full ``{name, flops, memory_bandwidth, memory_gib}``, then overrides."""
    if isinstance(value, str):
        preset = gpu_preset_name(value)
        if preset is None:
            raise ValueError(f"gpu: unknown GPU {value!r}; presets: {', '.join(GPUS)}")
        fields = vars(GPUS[preset]).copy()
    elif isinstance(value, dict):
        fields = _gpu_fields(value, "gpu")
        missing = sorted({"name", "flops", "memory_bandwidth", "memory_bytes"} - set(fields))
        if missing:
            raise ValueError(f"gpu: missing {', '.join(missing)} (memory as memory_gib or memory_bytes)")
    else:
        raise ValueError(f"gpu must be a preset name or a mapping, got {value!r}")
    fields.update(_gpu_fields(overrides or {}, "gpu_overrides"))
    return GPUSpec(**fields)


def cluster_from_dict(data: dict[str, Any]) -> ClusterSpec:
    """A cluster from a mapping; link bandwidths default to the GPU preset's typical node."""
    if not isinstance(data, dict):
        raise ValueError(f"hardware config must be a mapping, got {type(data).__name__}")
    _check_keys(data, _CLUSTER_KEYS, "hardware")
    for key in ("gpu", "num_nodes", "gpus_per_node"):
        if key not in data:
            raise ValueError(f"hardware: missing {key}")
    gpu = gpu_from_value(data["gpu"], data.get("gpu_overrides"))
    links = _NODE_LINKS.get(gpu_preset_name(gpu.name))
    bandwidths = {}
    for key in ("intra_node_bandwidth", "inter_node_bandwidth"):
        if key in data:
            bandwidths[key] = _number(data[key], key)
        elif links is not None:
            bandwidths[key] = getattr(links, key)
        else:
            raise ValueError(f"hardware: {key} is required for GPU {gpu.name!r}, which has no preset node")
    return ClusterSpec(gpu=gpu, num_nodes=data["num_nodes"], gpus_per_node=data["gpus_per_node"], **bandwidths)


def load_hardware(path: str | Path) -> ClusterSpec:
    """A cluster from a YAML file in the format of ``cluster_from_dict``."""
    with open(path) as f:
        return cluster_from_dict(yaml.safe_load(f))
