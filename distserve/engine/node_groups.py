"""Which Ray node a plan's node group is, and whether the Ray cluster can hold a plan.

A plan file (``distserve place``) names the node of each pipeline stage of each instance by the
planner's node index, ``0`` to ``nodes - 1``: a low node-affinity plan puts stage i of a prefill
instance and of its decode partner on one node, so that their KV crosses that node's fast links.
A Ray node labelled ``distserve.io/node=NAME`` (``ray start --labels distserve.io/node=0``) is node
group NAME. In a Ray cluster where no node carries that label, node group ``k`` is the k-th alive
node in order of IP address, then node id (nodes of one machine share an address: label them).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable

import ray

from distserve.core.config import EngineConfig

NODE_LABEL = "distserve.io/node"
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it: a placement bundle's selector pins it there


def _alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


def ray_node_ids(names: Iterable[str]) -> dict[str, str]:
    """The Ray node id of each node group in ``names``; ValueError saying which the cluster lacks."""
    names = sorted(set(names))
    nodes = _alive_nodes()
    labelled = {node["Labels"][NODE_LABEL]: node["NodeID"] for node in nodes if NODE_LABEL in node.get("Labels", {})}
    if labelled:
        missing = [name for name in names if name not in labelled]
        if missing:
            raise ValueError(
                f"no alive Ray node is labelled {NODE_LABEL}={', '.join(missing)} "
                f"(the labelled ones: {', '.join(sorted(labelled))})"
            )
        return {name: labelled[name] for name in names}
    ordered = [node["NodeID"] for node in sorted(nodes, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))]
    resolved = {}
    for name in names:
        if not name.isdigit() or int(name) >= len(ordered):
            raise ValueError(
                f"node group '{name}' is not one of the Ray cluster's {len(ordered)} alive nodes, "
                f"0 to {len(ordered) - 1} (or label the nodes {NODE_LABEL}=NAME)"
            )
        resolved[name] = ordered[int(name)]
    return resolved


def check_nodes_hold(instances: list[tuple[str, EngineConfig]]) -> None:
    """Before anything starts: every node group the instances name exists, and on GPUs each node
    has the GPUs its stages take (one per rank). ValueError in one sentence otherwise."""
    named = [(name, engine) for name, engine in instances if engine.parallel.nodes]
    if not named:
        return
    ids = ray_node_ids(node for _, engine in named for node in engine.parallel.nodes)
    wanted: Counter[str] = Counter()
    for _, engine in named:
        if engine.model.device != "cpu":  # cuda or auto: each rank takes a GPU where the cluster has them
            for node in engine.parallel.nodes:
                wanted[node] += engine.parallel.tensor_parallel_size
    gpus = {node["NodeID"]: node["Resources"].get("GPU", 0) for node in _alive_nodes()}
    if not any(gpus.values()):
        return  # a CPU cluster: ranks take no GPU
    for node, count in sorted(wanted.items()):
        available = gpus.get(ids[node], 0)
        if count > available:
            raise ValueError(
                f"the plan puts {count} GPU ranks on node group {node}, whose Ray node has {available:g} GPUs"
            )


def on_nodes_left(engine: EngineConfig) -> EngineConfig:
    """``engine`` for a replacement: on the node groups it names while they are all alive, else
    wherever Ray places it (a lost node's instances come back on the nodes left)."""
    if not engine.parallel.nodes:
        return engine
    try:
        ray_node_ids(engine.parallel.nodes)
    except ValueError:
        return dataclasses.replace(engine, parallel=dataclasses.replace(engine.parallel, nodes=()))
    return engine
