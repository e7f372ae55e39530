"""Plan files: a cluster config that ``distserve launch --plan`` serves, plus the planner's ``plan:``
notes (inputs and predictions), which ``distserve place simulate`` reads back to rebuild the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from distserve.core.model_presets import find_model_preset
from placement.colocation import ColocatedDeployment
from placement.deployment import Deployment
from placement.latency import Parallelism


def _pool(
    par: Parallelism, count: int, per_node: int, options: dict[str, Any], nodes: list[list[int]] | None = None
) -> dict[str, Any]:
    pool = {"instances": count, "tensor_parallel_size": par.tp, "pipeline_parallel_size": par.pp, **options}
    if par.gpus > per_node:
        # The default STRICT_PACK keeps an instance on one node; a larger one must spread its stages.
        pool["placement_strategy"] = "PACK"
    if nodes is not None:  # each instance's node group per stage (distserve.engine.node_groups)
        pool["nodes"] = nodes
    return pool


def _model_section(model: str) -> dict[str, Any]:
    section: dict[str, Any] = {"model": model}
    if find_model_preset(model) is not None and not Path(model).is_dir():
        section["load_format"] = "dummy"
    return section


def cache_dtype_note(notes: dict[str, Any]) -> str:
    """The KV cache dtype of plan notes: a plan from before there was a choice was made for ``auto``."""
    return notes.get("kv_cache_dtype", "auto")


def _cache_section(notes: dict[str, Any]) -> dict[str, Any]:
    # The KV cache dtype the plan's memory was sized for, so the cluster it launches holds what it says.
    return {"kv_cache_dtype": cache_dtype_note(notes)}


def plan_document(
    deployment: Deployment,
    model: str,
    gpus_per_node: int,
    max_batch_tokens: int,
    max_batch_size: int,
    notes: dict[str, Any],
    stage_nodes: dict[str, list[list[int]]] | None = None,
) -> dict[str, Any]:
    """The plan as a mapping: ``model:``, ``cache:`` and ``cluster:`` sections for the engine, ``plan:`` notes.
    ``stage_nodes`` (``Deployment.stage_nodes``): the node of each instance's stages, which
    ``distserve launch --plan`` places them on."""
    nodes = stage_nodes or {}
    return {
        "model": _model_section(model),
        "cache": _cache_section(notes),
        "cluster": {
            "prefill": _pool(
                deployment.prefill,
                deployment.prefill_instances,
                gpus_per_node,
                {"max_num_batched_tokens": max_batch_tokens},
                nodes.get("prefill"),
            ),
            "decode": _pool(
                deployment.decode,
                deployment.decode_instances,
                gpus_per_node,
                {"max_num_seqs": max_batch_size},
                nodes.get("decode"),
            ),
        },
        "plan": {"affinity": deployment.affinity, **notes},
    }


def colocated_plan_document(
    deployment: ColocatedDeployment, model: str, gpus_per_node: int, max_batch_size: int, notes: dict[str, Any]
) -> dict[str, Any]:
    """A colocated plan: one pool of instances running both phases with chunked prefill."""
    options = {
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": deployment.chunk_tokens,
        "max_num_seqs": max_batch_size,
    }
    return {
        "model": _model_section(model),
        "cache": _cache_section(notes),
        "cluster": {"colocated": _pool(deployment.parallelism, deployment.instances, gpus_per_node, options)},
        "plan": notes,
    }


def write_plan(path: str | Path, document: dict[str, Any]) -> None:
    header = "# distserve placement plan: serve it with `distserve launch --plan THIS_FILE`.\n"
    if document["model"].get("load_format") == "dummy":
        header += (
            f"# {document['model']['model']} is a preset, a shape without weights: it serves dummy (random)\n"
            "# weights; for real ones add --model DIR (a local model directory: its weights load).\n"
        )
    header += (
        "# The plan: section is the planner's inputs and predictions; `distserve place simulate --plan\n"
        "# THIS_FILE --rate R` re-predicts it.\n"
    )
    Path(path).write_text(header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False))


def read_plan(path: str | Path) -> tuple[Deployment | ColocatedDeployment, dict[str, Any], dict[str, Any]]:
    """(deployment, plan notes, the whole document) of a plan file."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("plan"), dict) or "cluster" not in data:
        raise ValueError(f"{path}: not a plan file (needs 'cluster:' and 'plan:' sections)")
    notes, pools = data["plan"], data["cluster"]
    try:
        if "colocated" in pools:
            pool = pools["colocated"]
            par = Parallelism(pool.get("tensor_parallel_size", 1), pool.get("pipeline_parallel_size", 1))
            return ColocatedDeployment(par, pool.get("instances", 1), pool["max_num_batched_tokens"]), notes, data
        prefill, decode = pools["prefill"], pools["decode"]
        deployment = Deployment(
            notes.get("affinity", "high"),
            Parallelism(prefill.get("tensor_parallel_size", 1), prefill.get("pipeline_parallel_size", 1)),
            prefill.get("instances", 1),
            Parallelism(decode.get("tensor_parallel_size", 1), decode.get("pipeline_parallel_size", 1)),
            decode.get("instances", 1),
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: 'cluster:' needs prefill and decode pools, or a colocated one ({e})") from None
    return deployment, notes, data
