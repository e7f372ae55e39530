"""A deployment: how many instances of which TP,PP, and how their pipeline stages sit on nodes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from placement.hardware import ClusterSpec
from placement.latency import Parallelism

AFFINITIES = ("high", "low")


@dataclass(frozen=True)
class Deployment:
    affinity: str  # "high": instances placed independently; "low": prefill and decode stages share nodes
    prefill: Parallelism
    prefill_instances: int
    decode: Parallelism
    decode_instances: int

    def __post_init__(self) -> None:
        if self.affinity not in AFFINITIES:
            raise ValueError(f"affinity must be one of {', '.join(AFFINITIES)}, got {self.affinity!r}")
        if self.prefill_instances < 1 or self.decode_instances < 1:
            raise ValueError("a deployment needs at least one prefill and one decode instance")
        if self.affinity == "low" and (
            self.prefill.pp != self.decode.pp or self.prefill_instances != self.decode_instances
        ):
            raise ValueError("a low node-affinity deployment pairs prefill and decode instances of equal PP")

    @property
    def gpus(self) -> int:
        return self.prefill_instances * self.prefill.gpus + self.decode_instances * self.decode.gpus

    def describe(self) -> str:
        return (
            f"{self.prefill_instances} prefill x TP,PP={self.prefill} + "
            f"{self.decode_instances} decode x TP,PP={self.decode} ({self.gpus} GPUs, {self.affinity} node-affinity)"
        )

    def grown(self, phase: str) -> Deployment:
        """One more instance of ``phase`` ("prefill" or "decode"); for low affinity one more unit of both."""
        if self.affinity == "low" or phase == "prefill":
            self = replace(self, prefill_instances=self.prefill_instances + 1)
        if self.affinity == "low" or phase == "decode":
            self = replace(self, decode_instances=self.decode_instances + 1)
        return self

    def fits(self, cluster: ClusterSpec) -> bool:
        return self._assign(cluster.num_nodes, cluster.gpus_per_node) is not None

    def node_layout(self, num_nodes: int, gpus_per_node: int) -> list[list[str]] | None:
        """Segments ("prefill-0 stage 1: 2 GPUs") on each node, or None when they do not fit."""
        assigned = self._assign(num_nodes, gpus_per_node)
        if assigned is None:
            return None
        nodes: list[list[str]] = [[] for _ in range(num_nodes)]
        for node, stages in assigned:
            nodes[node].extend(f"{role}-{i} stage {stage}: {tp} GPUs" for role, i, stage, tp in stages)
        return nodes

    def stage_nodes(self, num_nodes: int, gpus_per_node: int) -> dict[str, list[list[int]]] | None:
        """Each instance's node per pipeline stage, by role (``{"prefill": [[0, 1]], ...}``, what a plan
        file's pools name), or None when they do not fit."""
        assigned = self._assign(num_nodes, gpus_per_node)
        if assigned is None:
            return None
        nodes = {"prefill": [[0] * self.prefill.pp for _ in range(self.prefill_instances)],
                 "decode": [[0] * self.decode.pp for _ in range(self.decode_instances)]}  # fmt: skip
        for node, stages in assigned:
            for role, i, stage, _ in stages:
                nodes[role][i][stage] = node
        return nodes

    def _assign(self, num_nodes: int, gpus_per_node: int) -> list[tuple[int, list[tuple[str, int, int, int]]]] | None:
        """The node of each segment of stages (role, instance, stage, TP) placed together, or None.

        A stage's TP ranks stay within a node (tensor parallelism needs NVLink). High affinity packs
        stages first-fit, largest first; low affinity puts stage i of a unit's prefill and decode
        instance on one node, which is what keeps their KV transfer on NVLink.
        """
        segments: list[list[tuple[str, int, int, int]]] = []
        if self.affinity == "high":
            for role, par, count in (
                ("prefill", self.prefill, self.prefill_instances),
                ("decode", self.decode, self.decode_instances),
            ):
                segments += [[(role, i, stage, par.tp)] for i in range(count) for stage in range(par.pp)]
        else:
            segments = [
                [("prefill", i, stage, self.prefill.tp), ("decode", i, stage, self.decode.tp)]
                for i in range(self.prefill_instances)
                for stage in range(self.prefill.pp)
            ]
        free = [gpus_per_node] * num_nodes
        assigned = []
        for stages in sorted(segments, key=lambda seg: -sum(tp for *_, tp in seg)):
            size = sum(tp for *_, tp in stages)
            node = next((n for n in range(num_nodes) if free[n] >= size), None)
            if node is None:
                return None
            free[node] -= size
            assigned.append((node, stages))
        return assigned
