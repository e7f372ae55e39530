"""What a cluster runs: pools of instances by role, each instance an engine configuration.

A disaggregated cluster has a prefill pool and a decode pool; a colocated one (the baseline)
has one pool of instances that do both phases. Every pool starts from the shared engine
settings and overrides any of them (flat keys: ``tensor_parallel_size``, ``num_kv_blocks``,
``max_num_batched_tokens`` ...), so prefill and decode can differ in parallelism and sizing.

```yaml
model: {model: tiny-llama}
cache: {block_size: 16}
cluster:
  prefill: {instances: 1, tensor_parallel_size: 2}
  decode: {instances: 2, max_num_seqs: 128}
  max_request_attempts: 3          # runs of a request, the first included, across instance failures
  replace_failed_instances: true   # start a new instance in place of one that died
  liveness_timeout: 10             # seconds unanswered (or a step stuck) before an instance is fenced
  stream_interval: 0.005           # seconds between an instance's output batches (first tokens and ends at once)
  input_workers: 2                 # threads that tokenize and compile grammars, off the serving loop
  api_servers: 2                   # API server processes sharing the ports, each streaming its own requests
  role_control: {mode: adaptive, slo_ttft: 0.5, slo_tpot: 0.05}  # roles follow the load
  local_prefill: {mode: auto, max_tokens: 256}  # short prompts prefilled on their decode instance
  limits: {max_n: 16, max_tokens: 4096}  # what one request may ask for (distserve.core.request_limits)
```
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distserve.cluster.role_control.config import RoleControlConfig
from distserve.core.config import FIELD_SECTION, EngineConfig, is_int, is_number, read_sections
from distserve.core.cpu_cores import UNBOUND, format_cores, parse_cores
from distserve.core.local_prefill import LocalPrefillConfig
from distserve.core.request_limits import RequestLimits
from distserve.core.role import ROLES, Role

CLUSTER_KEYS = (
    "name",
    "max_request_attempts",
    "replace_failed_instances",
    "liveness_timeout",
    "stream_interval",
    "input_workers",
    "api_servers",
    "server_lease",
    "role_control",
    "local_prefill",
    "limits",
)
# Per-pool CLI flags of ``distserve launch``: (flag dest, role, pool key);
# ``--prefill-tensor-parallel-size`` is ``cluster.prefill.tensor_parallel_size``.
POOL_FLAGS = [
    (f"{role}_{key}", role, key)
    for role in ROLES
    for key in ("instances", "tensor_parallel_size", "pipeline_parallel_size")
]

# Role-control CLI flags of ``distserve launch``: (flag dest, key of ``cluster.role_control``).
ROLE_CONTROL_FLAGS = [("role_control", "mode"), ("slo_ttft", "slo_ttft"), ("slo_tpot", "slo_tpot")]
# Per-request disaggregation CLI flags: (flag dest, key of ``cluster.local_prefill``).
LOCAL_PREFILL_FLAGS = [("local_prefill", "mode"), ("local_prefill_max_tokens", "max_tokens")]
# Request limit CLI flags: (flag dest, key of ``cluster.limits``); ``--limits-max-n`` is ``cluster.limits.max_n``.
LIMITS_FLAGS = [(f"limits_{f.name}", f.name) for f in dataclasses.fields(RequestLimits)]


def _split_cores(spec: str, instances: int) -> list[str]:
    """Each of ``instances`` instances' cpu_cores: an equal run of a pool's core list, or ``spec``."""
    if spec in UNBOUND:
        return [spec] * instances
    cores = parse_cores(spec)
    share = len(cores) // instances
    if share < 1:
        raise ValueError(f"cpu_cores '{spec}' has fewer cores than the pool's {instances} instances")
    return [format_cores(cores[i * share : (i + 1) * share]) for i in range(instances)]


@dataclass
class PoolConfig:
    role: Role
    instances: int = 1
    options: dict[str, Any] = field(default_factory=dict)  # flat engine options for this pool only
    # Each instance's node group per pipeline stage (``distserve.engine.node_groups``), as plan files
    # write them: ``[[0], [1]]`` puts two one-stage instances on node groups 0 and 1. None: Ray places them.
    nodes: list[list[str]] | None = None

    @classmethod
    def from_options(cls, role: str, options: dict[str, Any] | None) -> PoolConfig:
        """A pool from its YAML section or keyword dict: ``instances``, ``nodes`` and engine overrides."""
        options = dict(options or {})
        return cls(role, options.pop("instances", 1), options, options.pop("nodes", None))

    def __post_init__(self) -> None:
        self.role = Role.parse(self.role)
        if not is_int(self.instances) or self.instances < 1:
            raise ValueError(f"the {self.role} pool needs at least one instance, got {self.instances}")
        unknown = sorted(set(self.options) - set(FIELD_SECTION))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)} in the {self.role} pool")
        if "role" in self.options:
            raise ValueError(f"the {self.role} pool sets its instances' role: leave 'role' out")
        if self.nodes is not None:
            if not isinstance(self.nodes, list) or len(self.nodes) != self.instances:
                raise ValueError(f"the {self.role} pool's nodes lists one entry per instance ({self.instances})")
            if not all(isinstance(stages, list) and stages for stages in self.nodes):
                raise ValueError(f"each of the {self.role} pool's nodes is a list of node groups, one per stage")


@dataclass
class ClusterConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    pools: list[PoolConfig] = field(default_factory=lambda: [PoolConfig("prefill"), PoolConfig("decode")])
    name: str = field(default_factory=lambda: f"distserve-{uuid.uuid4().hex[:6]}")  # prefixes actor names
    # A request on an instance that dies is re-run from its prompt on a healthy one, up to this many
    # runs in all; 1 fails it instead (UNAVAILABLE).
    max_request_attempts: int = 3
    replace_failed_instances: bool = True
    # An instance that leaves the orchestrator's poll of its outputs unanswered this many seconds past
    # the poll's own wait (its process stopped, swapped out, cut off), or whose batch has run this
    # long past twice its tokens at its slowest rate (a rank stopped, a collective that never ends),
    # is fenced: its processes are killed, its requests re-run elsewhere, and it is replaced, as if
    # it had died.
    liveness_timeout: float = 10.0
    # An instance hands its decode tokens over at most every this many seconds (a request's first
    # token and its end at once): each hand-over cost its step loop about 0.6 ms on a CPU, more
    # than half a small decode step. 0: every step.
    stream_interval: float = 0.005
    # Threads that do requests' CPU work off the serving loop (``distserve.cluster.input_workers``):
    # tokenizing, chat templates, bad words, grammar compiles. Requests past them wait their turn.
    input_workers: int = 2
    # API server processes (``distserve.cluster.directory``), each with its own gRPC and HTTP
    # listeners on the shared ports, admitting, routing and streaming its own requests; the first
    # manages the cluster. Instances send each request's outputs to the server that sent it.
    api_servers: int = 1
    # Seconds an instance keeps the requests of an API server (not the first) that has stopped
    # asking for their outputs: past it, the server is taken for dead and they end, KV freed.
    server_lease: float = 10.0
    role_control: RoleControlConfig = field(default_factory=RoleControlConfig)
    # Per-request disaggregation (``distserve.core.local_prefill``): which prompts a decode instance
    # prefills itself. Off: every request is disaggregated.
    local_prefill: LocalPrefillConfig = field(default_factory=LocalPrefillConfig)
    # What one request may ask for, checked where it enters (gRPC, HTTP and the Python API alike).
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        self.local_prefill = LocalPrefillConfig.parse(self.local_prefill)
        self.limits = RequestLimits.parse(self.limits)
        if isinstance(self.role_control, dict):
            unknown = set(self.role_control) - set(RoleControlConfig.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown role_control option(s): {', '.join(sorted(unknown))}")
            self.role_control = RoleControlConfig(**self.role_control)
        if not is_int(self.max_request_attempts) or self.max_request_attempts < 1:
            raise ValueError(f"max_request_attempts must be a positive integer, got {self.max_request_attempts!r}")
        if not is_number(self.stream_interval) or not 0 <= self.stream_interval <= 1:
            raise ValueError(f"stream_interval must be between 0 and 1 second, got {self.stream_interval!r}")
        if not is_int(self.input_workers) or self.input_workers < 1:
            raise ValueError(f"input_workers must be a positive integer, got {self.input_workers!r}")
        if not is_int(self.api_servers) or self.api_servers < 1:
            raise ValueError(f"api_servers must be a positive integer, got {self.api_servers!r}")
        if not is_number(self.server_lease) or not self.server_lease > 0:
            raise ValueError(f"server_lease must be > 0 seconds, got {self.server_lease!r}")
        if self.api_servers > 1 and self.role_control.mode == "adaptive":
            raise ValueError(
                "adaptive role control judges the requests of one API server: with api_servers > 1, "
                "change roles by hand (SetRoles) or run one API server"
            )
        if not is_number(self.liveness_timeout) or not self.liveness_timeout > 0:
            raise ValueError(f"liveness_timeout must be > 0 seconds, got {self.liveness_timeout!r}")
        if not isinstance(self.replace_failed_instances, bool):
            raise ValueError(f"replace_failed_instances must be true or false, got {self.replace_failed_instances!r}")
        roles = [pool.role for pool in self.pools]
        if len(set(roles)) != len(roles):
            raise ValueError(f"each role may have one pool, got {[str(r) for r in roles]}")
        if sorted(roles) not in ([Role.DECODE, Role.PREFILL], [Role.COLOCATED]):
            raise ValueError(
                "a cluster has a prefill and a decode pool (disaggregated) or one colocated pool, "
                f"got {[str(r) for r in roles]}"
            )
        for pool in self.pools:  # checked now, not when the pool's instances start
            try:
                self._pool_instances(pool)
            except ValueError as e:
                raise ValueError(f"the {pool.role} pool: {e}") from None
        self._check_kv_cache_dtypes()

    def _check_kv_cache_dtypes(self) -> None:
        """One KV cache dtype for every pool: a decode instance pulls a prefill instance's blocks slot
        for slot (an 8-bit block's scales in its slots) and a node's prefix tier holds every pool's
        blocks, so two layouts would meet where nothing converts one into the other."""
        dtypes = {pool.role: self.engine_config(pool).cache.kv_cache_dtype for pool in self.pools}
        if len(set(dtypes.values())) > 1:
            got = " and ".join(f"{role} {dtype}" for role, dtype in dtypes.items())
            raise ValueError(
                "a hand-over copies KV blocks as they are: every pool must use the same "
                f"cache.kv_cache_dtype, got {got}"
            )

    @property
    def disaggregated(self) -> bool:
        return any(pool.role is Role.PREFILL for pool in self.pools)

    def pool(self, role: Role) -> PoolConfig | None:
        return next((pool for pool in self.pools if pool.role == role), None)

    def engine_config(self, pool: PoolConfig) -> EngineConfig:
        """The engine config of the pool's instances: the shared settings and the pool's own."""
        base = {key: value for section in self.engine.to_dict().values() for key, value in section.items()}
        return EngineConfig.from_flat(**{**base, **pool.options, "role": pool.role})

    def _pool_instances(self, pool: PoolConfig) -> list[EngineConfig]:
        """The engine config of each of the pool's instances: a pool's core list split among them."""
        engine = self.engine_config(pool)
        nodes = pool.nodes or [()] * pool.instances
        return [
            dataclasses.replace(engine, parallel=dataclasses.replace(engine.parallel, cpu_cores=cores, nodes=stages))
            for cores, stages in zip(_split_cores(engine.parallel.cpu_cores, pool.instances), nodes)
        ]

    def instance_configs(self) -> list[tuple[str, EngineConfig]]:
        """(actor name, engine config) of every instance."""
        return [
            (f"{self.name}-{pool.role}-{i}", engine)
            for pool in self.pools
            for i, engine in enumerate(self._pool_instances(pool))
        ]

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config", **engine_overrides: Any) -> ClusterConfig:
        """The engine sections (``model:``, ``cache:`` ...) plus a ``cluster:`` section of pools."""
        data = dict(data)
        cluster = dict(data.pop("cluster", None) or {})
        engine = EngineConfig.from_sections(data, source, **engine_overrides)
        return cls.from_pools(engine, cluster)

    @classmethod
    def from_pools(cls, engine: EngineConfig, pools: dict[str, Any]) -> ClusterConfig:
        """``pools`` maps roles to pool options, plus the optional cluster-wide keys (``CLUSTER_KEYS``);
        no pools means 1 prefill + 1 decode, and one of the two alone keeps the other's defaults."""
        pools = dict(pools)
        settings = {key: pools.pop(key) for key in CLUSTER_KEYS if key in pools}
        if "colocated" not in pools and pools.keys() & {"prefill", "decode"}:
            pools = {"prefill": pools.pop("prefill", None) or {}, "decode": pools.pop("decode", None) or {}, **pools}
        if not settings.get("name", True):
            settings.pop("name")
        parsed = [PoolConfig.from_options(role, options) for role, options in pools.items()]
        return cls(engine, parsed or cls().pools, **settings)

    @classmethod
    def from_yaml(cls, path: str | Path, **engine_overrides: Any) -> ClusterConfig:
        return cls.from_dict(read_sections(path), str(path), **engine_overrides)
