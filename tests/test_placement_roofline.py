import dataclasses
import subprocess
import sys

import pytest

from distserve.core.model_presets import MODEL_PRESETS, ModelShape, model_shape
from placement.hardware import GPUS, ClusterSpec, GPUSpec, cluster_from_dict, load_hardware
from placement.roofline import Efficiency, RooflineModel, kv_transfer_time

GIB = 1 << 30
A100 = GPUS["A100-80GB"]
LLAMA7B = model_shape(MODEL_PRESETS["llama-2-7b"])


def a100_node(num_nodes: int = 1) -> ClusterSpec:
    return cluster_from_dict({"gpu": "A100-80GB", "num_nodes": num_nodes, "gpus_per_node": 8})


def test_decode_batch_one_reads_the_weights_once():
    roofline = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=1)
    # About 13.5 GB of fp16 weights (less the embedding table, of which decode reads one row) at 80% of 2.039 TB/s.
    assert roofline.decode_time(1, 16) == pytest.approx(13.5e9 / (2.039e12 * 0.8), rel=0.03)


def test_prefill_2048_tokens_is_compute_bound():
    roofline = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=1)
    # 6.48e9 parameters in the decoder layers (6.74e9 with embedding and LM head, which prefill barely uses).
    linear = 2 * 32 * (4 * 4096**2 + 3 * 4096 * 11008) * 2048
    attention = 32 * 2 * 2048**2 * 4096  # causal QK^T + AV over 32 layers
    assert roofline.prefill_time([2048]) == pytest.approx((linear + attention) / (312e12 * 0.6), rel=0.01)
    assert roofline.prefill_time([2048]) == pytest.approx(2 * 6.7e9 * 2048 / (312e12 * 0.6), rel=0.03)


def test_tensor_parallel_halves_compute_but_pays_for_all_reduces():
    one = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=1).prefill_time([2048])
    two = RooflineModel(LLAMA7B, a100_node(), tp=2, pp=1).prefill_time([2048])
    assert one / 2 < two < one


def test_pipeline_stage_time_bounds_throughput_and_latency_adds_sends():
    one = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=1)
    two = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=2)
    assert two.prefill_stage_time([1024]) < one.prefill_time([1024]) < two.prefill_time([1024])
    assert two.decode_stage_time(8, 4096) < two.decode_time(8, 4096)


def test_decode_grows_with_batch_and_context():
    roofline = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=1)
    # Memory-bound until the batch passes the ridge point (about 115 tokens on an A100), compute-bound beyond.
    assert roofline.decode_time(1, 512) <= roofline.decode_time(64, 512) < roofline.decode_time(512, 512)
    assert roofline.decode_time(8, 512) < roofline.decode_time(8, 8192) < roofline.decode_time(8, 65536)


def test_opt_175b_needs_eight_a100s():
    opt = model_shape(MODEL_PRESETS["opt-175b"])
    assert not RooflineModel(opt, a100_node(), tp=1, pp=1).fits
    eight = RooflineModel(opt, a100_node(), tp=8, pp=1)
    assert eight.fits
    assert 8 * eight.weight_bytes_per_gpu == pytest.approx(350e9, rel=0.01)


TINY = ModelShape(
    num_layers=4,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=100,
    max_position_embeddings=256,
    gated_mlp=True,
    model_type="llama",
)
TINY_GPU = GPUSpec("tiny", flops=1e12, memory_bandwidth=1e11, memory_bytes=1_000_000)


def tiny_cluster() -> ClusterSpec:
    return ClusterSpec(TINY_GPU, num_nodes=1, gpus_per_node=8, intra_node_bandwidth=1e10, inter_node_bandwidth=1e9)


def test_kv_capacity_exact_for_a_tiny_model():
    roofline = RooflineModel(TINY, tiny_cluster(), tp=1, pp=1)
    # Per layer: q,o 2*64*64 + k,v 2*64*2*16 + gated MLP 3*64*128 = 36864 params; embedding and LM head 6400 each.
    weights = (4 * 36864 + 2 * 6400) * 2
    assert roofline.weight_bytes_per_gpu == weights
    kv_per_token = 4 * 2 * 2 * 16 * 2
    assert TINY.kv_bytes_per_token(2) == kv_per_token
    assert roofline.kv_capacity_tokens(1.0, 0) == (1_000_000 - weights) // kv_per_token
    assert roofline.kv_capacity_tokens(0.5, 10_000) == (500_000 - 10_000 - weights) // kv_per_token


def test_kv_heads_are_replicated_when_fewer_than_tp():
    roofline = RooflineModel(TINY, tiny_cluster(), tp=4, pp=2)
    assert roofline.kv_heads_per_rank == 1
    assert roofline.stage_layers == [2, 2]
    # Stage 0: two layers of (2*64*64/4 + 2*64*1*16 + 3*64*128/4) params and a quarter of the embedding.
    weights = (2 * (2048 + 2048 + 6144) + 1600) * 2
    assert roofline.weight_bytes_per_gpu == weights
    per_token = 2 * 2 * 1 * 16 * 2  # two layers, K and V, one head per rank
    assert roofline.kv_capacity_tokens(1.0, 0) == (1_000_000 - weights) // per_token


def test_weights_that_do_not_fit_give_no_capacity():
    small = GPUSpec("small", flops=1e12, memory_bandwidth=1e11, memory_bytes=100_000)
    cluster = ClusterSpec(small, num_nodes=1, gpus_per_node=1, intra_node_bandwidth=1e10, inter_node_bandwidth=1e9)
    roofline = RooflineModel(TINY, cluster, tp=1, pp=1)
    assert roofline.kv_capacity_tokens(1.0, 0) <= 0
    assert not roofline.fits


def test_kv_transfer_time():
    assert kv_transfer_time(TINY, 1000, 1e9) == pytest.approx(1000 * 512 / 1e9)
    # Llama-2-7B keeps 512 KiB of fp16 KV per token: 2048 tokens over 25 GB/s take about 43 ms.
    assert kv_transfer_time(LLAMA7B, 2048, 25e9) == pytest.approx(2048 * 524288 / 25e9)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        kv_transfer_time(TINY, 10, 0)


def test_efficiency_override_scales_compute_bound_time():
    base = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=1)
    faster = RooflineModel(LLAMA7B, a100_node(), tp=1, pp=1, efficiency=Efficiency(compute=0.9))
    assert faster.prefill_time([4096]) == pytest.approx(base.prefill_time([4096]) * 0.6 / 0.9, rel=0.01)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tp": 3, "pp": 1}, "4 attention heads, which 3 tensor parallel ranks cannot share"),
        ({"tp": 1, "pp": 5}, "num_layers"),
        ({"tp": 0, "pp": 1}, "tp"),
        ({"tp": 4, "pp": 4}, "gpus_per_node"),
    ],
)
def test_bad_parallelism_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RooflineModel(TINY, tiny_cluster(), **kwargs)


def test_the_sharding_rule_of_the_engine():
    """What the engine refuses is no candidate; an uneven vocabulary is kept whole on every rank."""
    assert TINY.tensor_parallel_problem(1) is None and TINY.tensor_parallel_problem(4) is None
    three_kv_heads = dataclasses.replace(TINY, num_heads=6, num_kv_heads=3)
    assert "3 KV heads: 2 tensor parallel ranks need a divisor" in three_kv_heads.tensor_parallel_problem(2)
    assert "MLP of 13824 features" in model_shape(MODEL_PRESETS["llama-2-13b"]).tensor_parallel_problem(5)
    gpt2 = dataclasses.replace(TINY, model_type="gpt2")
    assert "not available for model family 'gpt2'" in gpt2.tensor_parallel_problem(2)
    assert gpt2.tensor_parallel_problem(2, has_plan=True) is None  # the engine's knowledge of the family wins
    assert gpt2.tensor_parallel_problem(1) is None
    opt66 = model_shape(MODEL_PRESETS["opt-66b"])
    assert opt66.tensor_parallel_problem(3) is None and not opt66.splits_vocab(3) and opt66.splits_vocab(4)
    # At TP=3 each rank holds a third of the layers but the whole 50272 x 9216 embedding (tied LM head
    # counted as a second table, as the engine keeps it).
    at3, at4 = (RooflineModel(opt66, a100_node(), tp=tp, pp=1) for tp in (3, 4))
    vocab_table = 50272 * 9216 * 2
    layers = 64 * at3._layer_params_per_rank * 2
    assert at3.weight_bytes_per_gpu == pytest.approx(layers + 2 * vocab_table)
    assert at4.weight_bytes_per_gpu == pytest.approx(64 * at4._layer_params_per_rank * 2 + 2 * vocab_table / 4)


def test_cross_node_instances_use_the_network():
    opt = model_shape(MODEL_PRESETS["opt-175b"])
    with pytest.raises(ValueError, match="cross_node"):
        RooflineModel(opt, a100_node(num_nodes=2), tp=3, pp=3)
    spanning = RooflineModel(opt, a100_node(num_nodes=2), tp=3, pp=3, cross_node=True)
    fast_network = cluster_from_dict(
        {"gpu": "A100-80GB", "num_nodes": 2, "gpus_per_node": 8, "inter_node_bandwidth": 300e9}
    )
    # The stages send their hidden states over the 25 GB/s network instead of NVLink.
    fast = RooflineModel(opt, fast_network, tp=3, pp=3, cross_node=True)
    slow_time, fast_time = spanning.prefill_time([2048]), fast.prefill_time([2048])
    assert slow_time - fast_time == pytest.approx(2 * 2048 * 12288 * 2 * (1 / 25e9 - 1 / 300e9) / 0.7)


def test_bad_batch_inputs_raise():
    roofline = RooflineModel(TINY, tiny_cluster(), tp=1, pp=1)
    with pytest.raises(ValueError, match="lengths"):
        roofline.prefill_time([])
    with pytest.raises(ValueError, match="batch_size"):
        roofline.decode_time(0, 10)
    with pytest.raises(ValueError, match="total_context"):
        roofline.decode_time(1, -1)
    with pytest.raises(ValueError, match="communication"):
        Efficiency(communication=1.5)


def test_gpu_presets():
    assert set(GPUS) >= {"A100-40GB", "A100-80GB", "H100-80GB", "H200", "L40S"}
    assert GPUS["H200"].memory_bandwidth == 4.8e12
    assert GPUS["H100-80GB"].flops == 989e12
    assert a100_node(4).num_gpus == 32


def test_yaml_overrides(tmp_path):
    path = tmp_path / "hw.yaml"
    # PyYAML reads 50e9 without a dot as a string: the loader accepts it anyway.
    path.write_text(
        "gpu: H100-80GB\ngpu_overrides: {flops: 500e12, memory_gib: 94}\nnum_nodes: 2\ngpus_per_node: 8\n"
        "inter_node_bandwidth: 100e9\n"
    )
    cluster = load_hardware(path)
    assert cluster.gpu.flops == 500e12
    assert cluster.gpu.memory_bytes == 94 * GIB
    assert cluster.gpu.memory_bandwidth == 3.35e12
    assert cluster.intra_node_bandwidth == 450e9  # from the H100 node preset
    assert cluster.inter_node_bandwidth == 100e9


def test_custom_gpu_needs_its_links():
    gpu = {"name": "X1", "flops": 1e15, "memory_bandwidth": 5e12, "memory_gib": 192}
    with pytest.raises(ValueError, match="intra_node_bandwidth"):
        cluster_from_dict({"gpu": gpu, "num_nodes": 1, "gpus_per_node": 8})
    cluster = cluster_from_dict(
        {"gpu": gpu, "num_nodes": 1, "gpus_per_node": 8, "intra_node_bandwidth": 9e11, "inter_node_bandwidth": 1e11}
    )
    assert cluster.gpu == GPUSpec("X1", 1e15, 5e12, 192 * GIB)


def test_gpu_names_match_in_any_case():
    cluster = cluster_from_dict({"gpu": "h100-80gb", "num_nodes": 1, "gpus_per_node": 8})
    assert cluster == cluster_from_dict({"gpu": "H100-80GB", "num_nodes": 1, "gpus_per_node": 8})
    assert cluster.gpu.name == "H100-80GB"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"gpu": "A100-80GB", "num_nodes": 1, "gpus_per_node": 8, "nvlink": 1}, "nvlink"),
        ({"gpu": "A100-80GB", "num_nodes": 1, "gpus_per_node": 8, "gpu_overrides": {"tflops": 1}}, "tflops"),
        ({"gpu": "B300", "num_nodes": 1, "gpus_per_node": 8}, "B300"),
        ({"gpu": "A100-80GB", "num_nodes": 0, "gpus_per_node": 8}, "num_nodes"),
        ({"gpu": "A100-80GB", "num_nodes": 1}, "gpus_per_node"),
        ({"gpu": "A100-80GB", "num_nodes": 1, "gpus_per_node": 8, "intra_node_bandwidth": "fast"}, "intra_node"),
        ({"gpu": "A100-80GB", "num_nodes": 1, "gpus_per_node": 8, "gpu_overrides": {"flops": -1}}, "flops"),
        ({"gpu": {"name": "X", "flops": 1e15}, "num_nodes": 1, "gpus_per_node": 8}, "memory_bandwidth"),
    ],
)
def test_bad_hardware_names_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        cluster_from_dict(data)


def test_placement_imports_no_heavy_packages():
    code = (
        "import sys, placement, placement.hardware, placement.roofline\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
