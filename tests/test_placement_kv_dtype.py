"""The planner's KV cache dtype: an 8-bit cache holds, a decode step reads and a hand-over moves the
bytes of the engine's layout (a byte a value and a float32 scale per token, KV head and K/V), and a
plan carries it to the cluster it launches."""

import dataclasses
import math

import pytest
import torch

from distserve.core.kv_cache_dtype import KV_CACHE_DTYPES
from distserve.core.model_presets import MODEL_PRESETS, TINY_MODEL_PRESETS, model_shape
from distserve.kv_transfer.plan import KVCacheShape
from placement.cli import build_problem, main
from placement.fitted import FittedLatency
from placement.hardware import ClusterSpec, cluster_from_dict
from placement.latency import InstanceModels, Parallelism
from placement.plan_file import read_plan
from placement.roofline import RooflineModel, kv_transfer_time
from placement.simulator import SimRequest, simulate

LLAMA7B = model_shape(MODEL_PRESETS["llama-2-7b"])  # 32 layers, 32 KV heads of 128 dims
A100 = cluster_from_dict({"gpu": "A100-80GB", "num_nodes": 1, "gpus_per_node": 8})
# One token's K (or V) of one KV head at head size 128: 128 bfloat16 values, or 128 codes and a scale.
BF16_HEAD, INT8_HEAD = 256, 132


@pytest.mark.parametrize("cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["llama-2-7b", "tiny-llama"])
def test_the_planner_counts_the_bytes_of_the_engines_blocks(name, dtype, cache_dtype):
    shape = model_shape(MODEL_PRESETS.get(name) or TINY_MODEL_PRESETS[name])
    geometry = KVCacheShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, 16, dtype, cache_dtype)
    assert shape.kv_bytes_per_token(dtype.itemsize, cache_dtype) * 16 == geometry.bytes_per_block


def test_an_int8_cache_holds_the_layouts_share_more_tokens_per_rank():
    auto, int8 = (RooflineModel(LLAMA7B, A100, tp=2, pp=1, kv_cache_dtype=d) for d in ("auto", "int8"))
    assert int8.weight_bytes_per_gpu == auto.weight_bytes_per_gpu  # the weights keep their 2 bytes
    free = A100.gpu.memory_bytes * 0.9 - (1 << 30) - auto.weight_bytes_per_gpu
    heads = 32 * 2 * 16  # layers x K and V x KV heads per rank at TP 2
    assert auto.kv_capacity_tokens() == math.floor(free / (heads * BF16_HEAD))
    assert int8.kv_capacity_tokens() == math.floor(free / (heads * INT8_HEAD))
    assert int8.kv_capacity_tokens() / auto.kv_capacity_tokens() == pytest.approx(BF16_HEAD / INT8_HEAD, rel=1e-5)


def test_a_decode_step_reads_and_a_hand_over_moves_the_int8_caches_bytes():
    auto, int8 = (RooflineModel(LLAMA7B, A100, tp=1, pp=1, kv_cache_dtype=d) for d in ("auto", "int8"))
    # At these contexts a step is memory-bound: each more token of context costs its KV's bytes read.
    extra = {r.kv_cache_dtype: r.decode_time(8, 200_000) - r.decode_time(8, 100_000) for r in (auto, int8)}
    assert extra["int8"] / extra["auto"] == pytest.approx(INT8_HEAD / BF16_HEAD, rel=1e-9)
    assert int8.decode_time(8, 1000) < auto.decode_time(8, 1000)

    assert LLAMA7B.kv_bytes_per_token(2, "int8") == 32 * 2 * 32 * INT8_HEAD
    assert kv_transfer_time(LLAMA7B, 2048, 25e9, 2, "int8") == 2048 * 32 * 2 * 32 * INT8_HEAD / 25e9
    models = InstanceModels(LLAMA7B, A100, kv_cache_dtype="int8")
    network = A100.inter_node_bandwidth * models.efficiency.communication
    assert models.transfer_time(same_node=False)(2048) == pytest.approx(2048 * 32 * 2 * 32 * INT8_HEAD / network)


def test_a_cache_dtype_the_model_cannot_use_is_refused():
    odd = dataclasses.replace(LLAMA7B, head_dim=130)
    InstanceModels(odd, A100)  # the model's own dtype takes any head size
    makers = (lambda: InstanceModels(odd, A100, kv_cache_dtype="int8"),
              lambda: RooflineModel(odd, A100, 1, 1, kv_cache_dtype="int8"))  # fmt: skip
    for make in makers:
        with pytest.raises(ValueError, match="an int8 KV cache needs a head size that is a multiple of 4, not 130"):
            make()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, got 'int4'"):
        RooflineModel(LLAMA7B, A100, 1, 1, kv_cache_dtype="int4")


def test_the_simulator_admits_the_decode_batches_an_int8_cache_holds():
    """A decode instance whose KV holds four requests in bfloat16 holds eight in int8: 30 requests at
    once decode in batches of that many, and end sooner."""
    weights = RooflineModel(LLAMA7B, A100, 1, 1).weight_bytes_per_gpu
    need = 512 + 64  # a request's tokens, reserved whole on admission
    memory = (weights + (1 << 30) + 4.2 * need * LLAMA7B.kv_bytes_per_token()) / 0.9
    cluster = ClusterSpec(dataclasses.replace(A100.gpu, memory_bytes=int(memory)), 1, 8, 300e9, 25e9)
    requests = [SimRequest(0.0, 512, 64) for _ in range(30)]
    last, par = {}, Parallelism(1, 1)
    for cache_dtype, batch in (("auto", 4), ("int8", 8)):
        models = InstanceModels(LLAMA7B, cluster, kv_cache_dtype=cache_dtype)
        assert models.decode_spec(par).kv_capacity_tokens // need == batch
        results = simulate(requests, models.prefill_spec(par), models.decode_spec(par), models.transfer_time(True),
                           trace=True)  # fmt: skip
        assert max(size for r in results for _, _, size in r.timeline.steps) == batch
        last[cache_dtype] = max(r.finish for r in results)
    assert last["int8"] < last["auto"]


SEARCH = ["--no-colocated", "--affinity", "high", "--model", "opt-13b", "--gpus-per-node", "4", "--slo-ttft",
          "0.25", "--slo-tpot", "0.1", "--num-requests", "200", "--processes", "1"]  # fmt: skip


def test_a_plan_for_an_int8_cache_holds_more_moves_less_and_launches_with_it(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    assert main([*SEARCH, "--kv-cache-dtype", "int8", "--out", str(plan)]) == 0, capsys.readouterr().err
    assert "opt-13b on 1 x 4 A100-80GB, KV cache int8;" in capsys.readouterr().out
    deployment, notes, document = read_plan(plan)
    assert notes["kv_cache_dtype"] == "int8" and document["cache"] == {"kv_cache_dtype": "int8"}

    # OPT-13B's head size is 128: the plan's instances hold 256/132 = 1.94 times the tokens of a
    # bfloat16 cache per rank (less the floor), and a hand-over moves 132/256 of the bytes.
    int8 = build_problem(notes).models
    older = {key: value for key, value in notes.items() if key != "kv_cache_dtype"}  # a plan from before
    auto = build_problem(older).models
    assert (int8.kv_cache_dtype, auto.kv_cache_dtype) == ("int8", "auto")
    for par in (deployment.prefill, deployment.decode):
        ratio = int8.kv_capacity_tokens(par) / auto.kv_capacity_tokens(par)
        assert ratio == pytest.approx(BF16_HEAD / INT8_HEAD, rel=1e-4)
        assert int8.decode_spec(par).kv_capacity_tokens == int8.kv_capacity_tokens(par)
    for same_node in (True, False):
        moved = int8.transfer_time(same_node)(750) / auto.transfer_time(same_node)(750)
        assert moved == pytest.approx(INT8_HEAD / BF16_HEAD)

    from distserve.entrypoints.launch import load_launch_config

    cluster, _ = load_launch_config(plan=str(plan))
    assert {engine.cache.kv_cache_dtype for _, engine in cluster.instance_configs()} == {"int8"}
    assert main(["simulate", "--plan", str(plan), "--rate", "1"]) == 0


def test_a_profile_of_another_kv_cache_dtype_is_warned_of(tmp_path, capsys):
    def profile(meta: dict) -> str:
        path = tmp_path / f"{len(meta)}.json"
        meta = {"device": "NVIDIA A100-SXM4-80GB", "model": "llama-3-8b", **meta}
        FittedLatency((0.01, 1e-5, 0.0), (0.005, 1e-4, 1e-7), meta).save(path)
        return str(path)

    base = ["--model", "llama-3-8b", "--slo-ttft", "1", "--slo-tpot", "0.1", "--num-requests", "200",
            "--processes", "1", "--gpus-per-node", "2", "--no-colocated"]  # fmt: skip
    for meta, asked, warned in (({}, "int8", "auto"), ({"kv_cache_dtype": "int8"}, "auto", "int8")):
        path = profile(meta)
        assert main([*base, "--profile", path, "--kv-cache-dtype", asked]) == 0
        assert (f"distserve place: warning: {path} was measured with kv_cache_dtype {warned}, not {asked}: its "
                "latencies will not be this cluster's") in capsys.readouterr().err  # fmt: skip
    assert main([*base, "--profile", profile({"kv_cache_dtype": "int8"}), "--kv-cache-dtype", "int8"]) == 0
    assert "warning" not in capsys.readouterr().err
