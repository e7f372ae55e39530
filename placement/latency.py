"""Instances as the simulator sees them: latency and KV capacity of a prefill or decode instance at a
given TP/PP, from the analytic roofline or from latency models fitted to profiles of the real engine.

A fitted model (``distserve profile``) is only known at the TP/PP it was profiled at, so with fitted
models the planner considers those parallelisms alone; memory (weights, KV capacity) always comes
from the model shape and the GPU, since it is arithmetic rather than measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from distserve.core.kv_cache_dtype import check_kv_cache_dtype
from distserve.core.model_presets import ModelShape
from placement.fitted import FittedLatency
from placement.hardware import ClusterSpec
from placement.roofline import Efficiency, RooflineModel, kv_transfer_time
from placement.sim_specs import StepTimes
from placement.simulator import DecodeInstanceSpec, PrefillInstanceSpec

PHASES = ("prefill", "decode")


@dataclass(frozen=True, order=True)
class Parallelism:
    """Tensor and pipeline parallel degrees of one instance, written "TP,PP" as in DistServe's tables."""

    tp: int
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be at least 1, got tp={self.tp}, pp={self.pp}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"{self.tp},{self.pp}"

    @classmethod
    def parse(cls, text: str) -> Parallelism:
        """Reads "TP,PP" (or "TP" for PP=1)."""
        parts = text.split(",")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"parallelism {text!r}: expected TP,PP as integers, e.g. 2,1") from None
        if len(values) not in (1, 2):
            raise ValueError(f"parallelism {text!r}: expected TP,PP, e.g. 2,1")
        return cls(*values)


@dataclass(frozen=True)
class InstanceModels:
    """Builds simulator specs for instances of ``model`` on ``cluster``.

    ``max_batch_tokens`` is the prefill token budget and ``max_batch_size`` the decode batch limit,
    as the engine's ``max_num_batched_tokens`` and ``max_num_seqs``. ``fitted`` maps parallelisms to
    profiled latency models; when given, only those parallelisms are candidates. ``kv_cache_dtype``
    is the engine's ``cache.kv_cache_dtype``: the KV an instance holds and a hand-over moves follow
    it, and so do the roofline's step times (a fitted model's are those it was measured with).
    """

    model: ModelShape
    cluster: ClusterSpec
    efficiency: Efficiency = field(default_factory=Efficiency)
    fitted: Mapping[Parallelism, FittedLatency] | None = None
    max_batch_tokens: int = 4096
    max_batch_size: int = 256
    memory_fraction: float = 0.9
    dtype_bytes: int = 2
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        # Here rather than only in the roofline: ``candidates`` takes a roofline's ValueError for a
        # parallelism that does not fit, and would drop every one without a word.
        check_kv_cache_dtype(self.kv_cache_dtype, self.model.head_dim)

    def roofline(self, par: Parallelism) -> RooflineModel:
        """The roofline of ``par``; raises ValueError when the model cannot be split that way."""
        return RooflineModel(
            self.model,
            self.cluster,
            par.tp,
            par.pp,
            self.dtype_bytes,
            self.efficiency,
            cross_node=True,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def kv_capacity_tokens(self, par: Parallelism) -> int:
        return self.roofline(par).kv_capacity_tokens(self.memory_fraction)

    def candidates(self, min_kv_tokens: int = 1) -> list[Parallelism]:
        """Every parallelism the model splits into, within a node's GPUs for TP and the cluster for
        TP x PP, whose weights fit with room for ``min_kv_tokens`` tokens of KV (the longest request)."""
        if self.fitted is not None:
            pars: Sequence[Parallelism] = sorted(self.fitted)
        else:
            pars = [
                Parallelism(tp, pp)
                for tp in range(1, self.cluster.gpus_per_node + 1)
                for pp in range(1, min(self.model.num_layers, self.cluster.num_gpus // tp, self.cluster.num_nodes) + 1)
            ]
        fitting = []
        for par in pars:
            try:
                capacity = self.kv_capacity_tokens(par)
            except ValueError:  # TP does not divide the heads, or more GPUs than the cluster has
                continue
            if capacity >= min_kv_tokens:
                fitting.append(par)
        return fitting

    def _fitted(self, par: Parallelism) -> FittedLatency | None:
        if self.fitted is None:
            return None
        if par not in self.fitted:
            raise ValueError(f"no fitted latency model for TP,PP={par}; profiled: {', '.join(map(str, self.fitted))}")
        return self.fitted[par]

    def prefill_spec(self, par: Parallelism, count: int = 1) -> PrefillInstanceSpec:
        fitted = self._fitted(par)
        if fitted is None:
            roofline = self.roofline(par)
            batch_time: Callable[[list[int]], float] = roofline.prefill_time
            stage_time = roofline.prefill_stage_time if par.pp > 1 else None
        else:
            batch_time = fitted.prefill_time
            # A profile times whole steps, so stages are taken as equal shares of them.
            stage_time = (lambda lengths: fitted.prefill_time(lengths) / par.pp) if par.pp > 1 else None
        return PrefillInstanceSpec(count, batch_time, stage_time, self.max_batch_tokens, self.kv_capacity_tokens(par))

    def decode_spec(self, par: Parallelism, count: int = 1) -> DecodeInstanceSpec:
        fitted = self._fitted(par)
        if fitted is None:
            roofline = self.roofline(par)
            step_time: Callable[[int, int], float] = roofline.decode_time
            step_times: StepTimes = roofline.decode_times
            stage_time = roofline.decode_stage_time if par.pp > 1 else None
        else:
            step_time, step_times = fitted.decode_time, fitted.decode_times
            stage_time = (lambda batch, context: fitted.decode_time(batch, context) / par.pp) if par.pp > 1 else None
        return DecodeInstanceSpec(count, step_time, stage_time, self.max_batch_size, self.kv_capacity_tokens(par),
                                  step_times=step_times)  # fmt: skip

    def transfer_time(self, same_node: bool) -> Callable[[int], float]:
        """KV transfer of a prompt from a prefill to a decode instance, over NVLink within a node or the
        network across nodes (each rank pair moves its share in parallel only within a node, so across
        nodes the node's link carries the whole cache)."""
        c = self.cluster
        bandwidth = (c.intra_node_bandwidth if same_node else c.inter_node_bandwidth) * self.efficiency.communication
        model, dtype_bytes, cache_dtype = self.model, self.dtype_bytes, self.kv_cache_dtype
        return lambda tokens: kv_transfer_time(model, tokens, bandwidth, dtype_bytes, cache_dtype)
