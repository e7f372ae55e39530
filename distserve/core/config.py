"""Engine configuration: dataclasses that map one-to-one onto YAML sections and CLI flags.

Every field is a config key (``section.field`` in YAML) and a CLI flag (``--field-name``);
field names are unique across sections so the flat flag namespace stays unambiguous.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distserve.core.cpu_cores import UNBOUND, parse_cores
from distserve.core.kv_cache_dtype import KV_CACHE_DTYPES
from distserve.core.role import ROLES, Role

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpp", "compiled", "triton", "sdpa")
POLICIES = ("fcfs", "sjf", "priority", "deadline", "deadline-feasible")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
KV_TRANSPORTS = ("auto", "group")
KV_CHECKSUMS = ("auto", "on", "off")
GENERATION_CONFIGS = ("auto", "vllm")


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A config field that is also a CLI flag; ``aliases`` are further spellings of the flag
    (``("--port",)``), for names users bring from other servers."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclass
class ModelConfig:
    model: str = option("tiny-llama", "local Hugging Face model directory, built-in tiny model or preset name")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model's own)")
    load_format: str = option("auto", "'auto' loads safetensors weights, 'dummy' random weights", LOAD_FORMATS)
    dtype: str = option(
        "auto",
        "weight and KV dtype ('auto': on CPU bfloat16 where it has AVX-512 BF16 or AMX, else float32; on CUDA "
        "the checkpoint's float16 or bfloat16, else bfloat16); logits and sampling are float32 in any",
        DTYPES,
    )
    device: str = option("auto", "'auto' picks cuda when available", DEVICES)
    seed: int = option(0, "seed for dummy weights and unseeded sampling")
    max_model_len: int | None = option(None, "context length limit (default: the model's)")
    attention_backend: str = option(
        "auto",
        "paged attention: 'cpp' reads K/V in place in the blocks, for decode and prompts (a C++ kernel "
        "for CPU, float32 or bfloat16, built once per machine in about a second), 'compiled' for decode "
        "(torch.compile, built in 1-5 s at start-up), 'triton' for decode on CUDA (a Triton kernel "
        "that CUDA graphs can capture), 'sdpa' runs SDPA over K/V copied out of them; 'auto' is cpp "
        "on CPU in float32 or bfloat16 when a C++ compiler is found, compiled on CPU in float16, triton "
        "on CUDA when Triton is installed, else sdpa",
        ATTENTION_BACKENDS,
    )
    enforce_eager: bool = option(
        False, "run decode steps eagerly on CUDA, not replayed as CUDA graphs (which need the triton backend)"
    )
    cpu_packed_linear: bool = option(
        True,
        "on CPU, in float32 or (where the CPU has AVX-512 BF16 or AMX) bfloat16, run linear layers through "
        "oneDNN on weights packed once at load (1.4-2.2x faster at decode batch sizes); off: torch's linear",
    )
    generation_config: str = option(
        "auto",
        "as vLLM's: 'auto' takes the sampling defaults of a request that leaves temperature, top_p, top_k, "
        "min_p, repetition_penalty, presence_penalty, frequency_penalty or max_tokens out from the model's "
        "generation_config.json (max_new_tokens as max_tokens); 'vllm' ignores it (the server's own defaults)",
        GENERATION_CONFIGS,
    )

    def __post_init__(self) -> None:
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("generation_config", self.generation_config, GENERATION_CONFIGS)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


@dataclass
class CacheConfig:
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV blocks per instance (default: sized from memory)")
    kv_cache_memory_fraction: float = option(
        0.9, "share of free device memory the KV cache may take when num_kv_blocks is unset"
    )
    gpu_memory_utilization: float | None = option(
        None,
        "as in vLLM: share of the device's total memory (on CPU: of system memory) this instance may "
        "use for weights, activations and KV cache; when set, kv_cache_memory_fraction is not used",
    )
    enable_prefix_caching: bool = option(True, "share KV blocks of identical prompt prefixes")
    swap_space: float = option(
        0.0,
        "GiB of host memory per rank that a preempted sequence's KV is copied out to, and back when it "
        "resumes, where that costs less than recomputing it (as vLLM's swap_space); 0: always recompute",
    )
    kv_tier_space: float = option(
        0.0,
        "GiB of host memory on each node for the shared prefix tier: full KV blocks, keyed by the prefix "
        "cache's block hashes, that every instance on the node saves what it computes to and looks prompts "
        "up in before computing them (another node's tier is asked on a miss); the largest value of any "
        "pool sizes it, and an instance with 0 leaves it alone; 0 everywhere: no tier",
    )
    kv_cache_dtype: str = option(
        "auto",
        "what the KV cache stores (vLLM's flag): 'auto' the model's dtype; 'int8' (any device) or 'fp8' "
        "(e4m3: CUDA, and CPU through the C++ kernel) one byte a value and a float32 scale per token and KV "
        "head, about half a bfloat16 cache's bytes: twice the tokens in the same memory and half the bytes "
        "a decode step and a hand-over read; the model's weights keep their dtype. Every instance of a "
        "cluster must use the same",
        KV_CACHE_DTYPES,
    )
    kv_transport: str = option(
        "auto",
        "how a pull moves KV between two instances' ranks: 'auto' reads the source's cache in place when "
        "they can (CUDA IPC between GPUs of one machine, shared memory between CPU processes of one Ray "
        "node), else a two-rank group (NCCL on GPUs, gloo on CPU); 'group' always the group",
        KV_TRANSPORTS,
    )
    kv_transfer_checksum: str = option(
        "auto",
        "check KV pulls: the source and destination ranks digest the KV sent and received and a mismatch "
        "fails the pull (the request runs again, counted in kv_checksum_mismatches); 'auto' checks pulls "
        "over a group (gloo, NCCL) and not those read in place, where on a CPU the check took longer than "
        "the copy; 'on' checks every pull, 'off' none",
        KV_CHECKSUMS,
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("kv_transport", self.kv_transport, KV_TRANSPORTS)
        _check_choice("kv_transfer_checksum", self.kv_transfer_checksum, KV_CHECKSUMS)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be at least 0 GiB, got {self.swap_space}")
        if self.kv_tier_space < 0:
            raise ValueError(f"kv_tier_space must be at least 0 GiB, got {self.kv_tier_space}")


@dataclass
class SchedulerConfig:
    role: Role = option(Role.COLOCATED, "which phases this instance runs (in a cluster, its pool sets it)", ROLES)
    policy: str = option("fcfs", "prefill queue order", POLICIES)
    max_num_batched_tokens: int = option(
        4096, "prefill token budget per batch (DistServe's L_m); with chunked prefill, every step's tokens"
    )
    enable_chunked_prefill: bool = option(
        False,
        "while an instance is colocated: each step runs every decoding sequence's token, then chunks of "
        "prompts up to max_num_batched_tokens, as vLLM does (off: a step is a whole prefill batch or a "
        "decode step)",
    )
    tpot_aware_chunking: bool = option(
        False,
        "with chunked prefill: while a request with a TPOT SLO (its own, else the cluster's "
        "role_control.slo_tpot) is decoding, a step's prompt chunks are cut to what keeps the step "
        "within that SLO, by the instance's measured step times (off: every step may take "
        "max_num_batched_tokens)",
    )
    max_num_seqs: int = option(256, "most sequences running at once")
    sjf_aging_tokens: float = option(
        64.0, "SJF aging: a waiting prompt counts this many tokens shorter per prefill step it waits"
    )
    kv_hold_fraction: float = option(
        0.5,
        "prefill instances: share of KV blocks that prefilled requests waiting for decode may hold "
        "before no new prompt is admitted (back-pressure)",
    )
    kv_hold_timeout: float = option(
        60.0,
        "prefill instances: seconds a prefilled request's KV waits for a decode instance to pull it; "
        "then its blocks are freed and the request is reported failed (the orchestrator re-runs it)",
    )
    finish_decoding_as_prefill: bool = option(
        False,
        "an instance that becomes a prefill instance decodes the requests it was decoding to their end, "
        "beside the new prompts it hands on (off: it hands them on to decode instances at once)",
    )

    def __post_init__(self) -> None:
        self.role = Role.parse(self.role)
        _check_choice("policy", self.policy, POLICIES)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.sjf_aging_tokens < 0:
            raise ValueError(f"sjf_aging_tokens must be >= 0, got {self.sjf_aging_tokens}")
        if not 0.0 < self.kv_hold_fraction <= 1.0:
            raise ValueError(f"kv_hold_fraction must be in (0, 1], got {self.kv_hold_fraction}")
        if not self.kv_hold_timeout > 0:
            raise ValueError(f"kv_hold_timeout must be > 0 seconds, got {self.kv_hold_timeout}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = option(1, "tensor parallel ranks per pipeline stage", aliases=("-tp",))
    pipeline_parallel_size: int = option(
        1, "pipeline stages (contiguous slices of the decoder layers)", aliases=("-pp",)
    )
    placement_strategy: str = option(
        "STRICT_PACK", "Ray placement group strategy for an instance's workers", PLACEMENT_STRATEGIES
    )
    worker_cpus: float = option(0.05, "CPUs each worker reserves in its placement bundle (small: Ray only books it)")
    cpu_threads: int | None = option(
        None, "torch threads of each CPU worker (default: its bound cores, else cores / tensor_parallel_size)"
    )
    cpu_cores: str = option(
        "auto",
        "CPU cores of the instances' torch threads: a list such as 0-3,8 (a pool's list is split among "
        "its instances, each instance's among its workers), 'none' (unbound), or 'auto': in a cluster, "
        "cores of their own for every worker when the machine has enough, the rest left to the "
        "serving processes (printed at start); unbound for an engine alone",
    )
    # The node group of each pipeline stage (a plan file's ``nodes`` of the instance's pool; see
    # ``distserve.engine.node_groups``): the stage's ranks run on that node. Empty: Ray places them.
    nodes: tuple[str, ...] = field(default=(), metadata={"internal": True})

    def __post_init__(self) -> None:
        _check_choice("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        self.nodes = tuple(str(node) for node in self.nodes)
        if self.nodes and len(self.nodes) != self.pipeline_parallel_size:
            raise ValueError(
                f"nodes names a node for each of the {self.pipeline_parallel_size} pipeline stages, "
                f"got {list(self.nodes)}"
            )
        if self.cpu_cores not in UNBOUND and len(parse_cores(self.cpu_cores)) < self.world_size:
            raise ValueError(f"cpu_cores '{self.cpu_cores}' has fewer cores than the {self.world_size} workers")
        if self.worker_cpus <= 0:
            raise ValueError(f"worker_cpus must be positive (Ray rejects empty bundles), got {self.worker_cpus}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def rank_cores(self, rank: int) -> list[int] | None:
        """The cores of worker ``rank``: its share of ``cpu_cores``, in rank order; None when unbound."""
        if self.cpu_cores in UNBOUND:
            return None
        cores = parse_cores(self.cpu_cores)
        share = len(cores) // self.world_size
        return cores[rank * share : (rank + 1) * share]

    def worker_threads(self) -> int | None:
        """Torch threads of each CPU worker: ``cpu_threads``, else as many as its bound cores; None
        when neither says (the worker then divides the machine's cores among the TP ranks)."""
        cores = self.rank_cores(0)
        return self.cpu_threads or (len(cores) if cores else None)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_flat(cls, **options: Any) -> EngineConfig:
        """Build from flat keyword options (``block_size=8``), as the CLI and ``LLM(...)`` pass them."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in options.items():
            section = FIELD_SECTION.get(key)
            if section is None:
                raise ValueError(f"unknown engine option '{key}'; known options: {', '.join(sorted(FIELD_SECTION))}")
            sections[section][key] = value
        return cls(**{name: SECTIONS[name](**values) for name, values in sections.items()})

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Read the ``model:``, ``cache:``, ``scheduler:`` and ``parallel:`` sections; ``overrides`` (flat keys) win."""
        return cls.from_sections(read_sections(path), str(path), **overrides)

    @classmethod
    def from_sections(cls, data: dict[str, Any], source: str = "config", **overrides: Any) -> EngineConfig:
        """Build from a mapping of sections, as in a YAML file; ``overrides`` (flat keys) win."""
        flat: dict[str, Any] = {}
        for section, values in data.items():
            if section not in SECTIONS:
                raise ValueError(f"{source}: unknown section '{section}'; expected one of {', '.join(SECTIONS)}")
            for key, value in (values or {}).items():
                if FIELD_SECTION.get(key) != section:
                    raise ValueError(f"{source}: '{key}' is not a key of section '{section}'")
                flat[key] = value
        flat.update(overrides)
        return cls.from_flat(**flat)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sections of plain values (roles as their names), as YAML holds them."""
        return dataclasses.asdict(self, dict_factory=lambda items: {k: _plain(v) for k, v in items})


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
}
FIELD_SECTION: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def read_sections(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping of sections."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)}, ...)")
    return data


def is_int(value: Any) -> bool:
    """An integer, and not a bool: YAML's and JSON's `true` is not a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that a float can hold, and not a bool (JSON's 10**309 is an int past
    the largest float: no sampling value can be made of it)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value.value if isinstance(value, Role) else value


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got '{value}'")
