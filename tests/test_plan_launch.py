"""Plans the planner writes are plans the engine serves: one sharding rule for both, and
``distserve place --out`` followed by ``distserve launch --plan`` at TP=3, whose greedy output
equals transformers'."""

import signal

import pytest
import yaml
from conftest import random_prompts, reference_greedy
from test_launch import Launched
from test_parallel import SIX_HEADS

from distserve import Cluster, SamplingParams
from distserve.core.config import ModelConfig, ParallelConfig
from distserve.core.model_presets import MODEL_PRESETS, TINY_MODEL_PRESETS, model_shape
from distserve.entrypoints.client import Client
from distserve.entrypoints.launch import load_launch_config
from distserve.model_executor.model_loader import resolve_model
from distserve.model_executor.tiny_models import TINY_MODELS, make_tiny_model
from distserve.parallel.ranks import check_parallel_config
from placement.cli import main as place_main
from placement.hardware import cluster_from_dict
from placement.latency import InstanceModels, Parallelism
from placement.plan_file import read_plan
from placement.roofline import RooflineModel

# Room for every preset's weights at TP=1, so candidates are limited by the sharding rule alone.
ROOMY = {"gpu": {"name": "roomy", "flops": 1e15, "memory_bandwidth": 3e12, "memory_gib": 4096},
         "num_nodes": 4, "gpus_per_node": 8, "intra_node_bandwidth": 3e11, "inter_node_bandwidth": 2.5e10}  # fmt: skip


def _engine_accepts(resolved, tp: int, pp: int) -> bool:
    parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        check_parallel_config(resolved.hf_config, resolved.shape, parallel)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", [*MODEL_PRESETS, *TINY_MODELS])
def test_the_planner_picks_exactly_the_tensor_parallel_sizes_the_engine_serves(name):
    resolved = resolve_model(ModelConfig(model=name, load_format="dummy"))
    if name in TINY_MODEL_PRESETS:  # the planner's copy of a tiny model's shape is the engine's
        assert model_shape(TINY_MODEL_PRESETS[name]) == resolved.shape
    candidates = InstanceModels(resolved.shape, cluster_from_dict(ROOMY)).candidates()
    planned = {par.tp for par in candidates}
    assert planned == {tp for tp in range(1, 9) if _engine_accepts(resolved, tp, 1)}
    assert all(_engine_accepts(resolved, par.tp, par.pp) for par in candidates)
    if name == "opt-66b":  # 72 heads split over 3 ranks; the 50272-token vocabulary stays whole
        assert Parallelism(3, 1) in candidates


@pytest.mark.slow  # 45-90 s: the planner's search, then a launch
def test_the_readme_plan_passes_the_engines_checks(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    # README.md's "Capacity planning" command.
    args = ["--model", "opt-66b", "--gpu", "A100-80GB", "--nodes", "4", "--gpus-per-node", "8", "--workload", "chat",
            "--slo-ttft", "2.5", "--slo-tpot", "0.15", "--rate", "5", "--out", str(plan)]  # fmt: skip
    assert place_main([*args, "--processes", "1"]) == 0, capsys.readouterr().err
    cluster, _ = load_launch_config(plan=str(plan))
    for _, engine in cluster.instance_configs():
        resolved = resolve_model(engine.model)
        check_parallel_config(resolved.hf_config, resolved.shape, engine.parallel)


def _small_gpu_hardware(path, model_dir) -> None:
    """One node of six GPUs too small for the model's weights on one GPU, not on three: the planner
    can only pick TP=3 (TP=2 cannot share its three KV heads, TP=6 leaves no room for a pair)."""
    shape = model_shape(yaml.safe_load((model_dir / "config.json").read_text()))
    one, three = (RooflineModel(shape, cluster_from_dict(ROOMY), tp, 1).weight_bytes_per_gpu for tp in (1, 3))
    # The roofline keeps 10% of a GPU and 1 GiB for activations: what is left lies midway between the two.
    memory = int(((one + three) / 2 + (1 << 30)) / 0.9)
    gpu = {"name": "small", "flops": 1e12, "memory_bandwidth": 1e11, "memory_bytes": memory}
    hardware = {"gpu": gpu, "num_nodes": 1, "gpus_per_node": 6, "intra_node_bandwidth": 1e10,
                "inter_node_bandwidth": 1e9}  # fmt: skip
    path.write_text(yaml.safe_dump(hardware))


def _serve_with_cli(plan, prompts, reference) -> None:
    server = Launched("--plan", str(plan), "--num-kv-blocks", "64", "--dtype", "float32")
    try:
        with Client(server.grpc_address) as client:
            info = client.cluster_info()
            assert sorted(i.tensor_parallel_size for i in info.instances) == [3, 3]
            for prompt in prompts:
                served = client.complete(prompt, max_tokens=12, temperature=0.0).token_ids
                assert served == reference_greedy(reference, prompt, 12)
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=120) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()


def _serve_in_process(plan, prompts, reference) -> None:
    config, _ = load_launch_config(plan=str(plan), flags={"num_kv_blocks": 64, "dtype": "float32"})
    with Cluster(config) as cluster:
        assert sorted(i.tensor_parallel_size for i in cluster.info()) == [3, 3]
        outputs = cluster.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
        assert [o.output_token_ids for o in outputs] == [reference_greedy(reference, p, 12) for p in prompts]


# The plan read by ``distserve launch --plan`` in a process of its own is the slow variant; the
# default one reads it with the same loader and serves it from a cluster in this process.
@pytest.mark.parametrize("serve", ["cluster", pytest.param("launch", marks=pytest.mark.slow)])
def test_a_planner_written_tp3_plan_launches_and_serves_greedy_equal_to_transformers(tmp_path, capsys, request, serve):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model("tiny-llama", tmp_path / "six-heads", **SIX_HEADS["tiny-llama"])
    hardware, plan = tmp_path / "hardware.yaml", tmp_path / "plan.yaml"
    _small_gpu_hardware(hardware, model_dir)
    args = ["--model", str(model_dir), "--hardware", str(hardware), "--prompt-len", "uniform:8:64",
            "--output-len", "16", "--slo-ttft", "1", "--slo-tpot", "0.1", "--rate", "2", "--out", str(plan),
            "--processes", "1"]  # fmt: skip
    assert place_main(args) == 0, capsys.readouterr().err
    deployment, _, document = read_plan(plan)
    assert (deployment.prefill, deployment.decode) == (Parallelism(3, 1), Parallelism(3, 1))
    assert "load_format" not in document["model"]  # a directory's own weights

    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = random_prompts([5, 60], reference.config.vocab_size, seed=11)
    if serve == "cluster":
        request.getfixturevalue("ray_cluster")
        _serve_in_process(plan, prompts, reference)
    else:
        _serve_with_cli(plan, prompts, reference)
