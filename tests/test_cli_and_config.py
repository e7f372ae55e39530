"""The command line, YAML config, model presets and dummy loading."""

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distserve import LLM, SamplingParams
from distserve.cli import main
from distserve.core.config import SECTIONS, CacheConfig, EngineConfig, ModelConfig
from distserve.model_executor.model_loader import resolve_model
from placement import MODEL_PRESETS, model_shape


def test_generate_streams_the_greedy_text(capsys):
    assert main(["generate", "--model", "tiny-opt", "--max-tokens", "10", "--temperature", "0", "The cache block"]) == 0
    printed = capsys.readouterr().out
    expected = LLM("tiny-opt").generate("The cache block", SamplingParams(max_tokens=10, temperature=0))[0]
    assert printed == expected.text + "\n"


def test_generate_with_a_config_file(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("model:\n  model: tiny-qwen2\ncache:\n  block_size: 4\n  num_kv_blocks: 64\n")
    assert main(["generate", "--config", str(config), "--max-tokens", "3", "--temperature", "0", "a", "b"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- ") == 2


def test_cli_errors_exit_2_with_a_sentence(capsys):
    assert main(["generate", "--model", "nope", "x"]) == 2
    assert "distserve: error: unknown model 'nope'" in capsys.readouterr().err
    assert main(["generate", "--top-p", "2", "x"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "generate", "--max-tokens", "4", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_make_model_writes_a_hugging_face_directory(tmp_path, capsys):
    out = tmp_path / "llama"
    assert main(["make-model", "tiny-llama", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama" and len(tokenizer) == model.config.vocab_size
    # Deterministic: the same recipe gives the same weights as the cached copy (as loaded: unpacked).
    cached = LLM("tiny-llama", dtype="float32", cpu_packed_linear=False).engine.executor.worker.model
    assert torch.equal(model.lm_head.weight, cached.lm_head.weight)


def test_every_flag_is_a_config_key_and_back(tmp_path):
    keys = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(keys) == len(set(keys))
    config = EngineConfig.from_flat(model="tiny-gpt2", block_size=8, policy="sjf", enable_prefix_caching=False)
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config.to_dict()))
    assert EngineConfig.from_yaml(path) == config
    assert EngineConfig.from_yaml(path, block_size=32).cache.block_size == 32
    path.write_text("cache:\n  policy: sjf\n")
    with pytest.raises(ValueError, match="'policy' is not a key of section 'cache'"):
        EngineConfig.from_yaml(path)


def test_launch_port_is_the_http_port_as_in_vllm(capsys):
    from distserve.cli import build_parser
    from distserve.entrypoints.launch import SERVER_FIELDS, load_launch_config

    for flag in ("--port", "--http-port"):
        args = build_parser().parse_args(["launch", flag, "9000"])
        _, server = load_launch_config(flags={k: v for k, v in vars(args).items() if k in SERVER_FIELDS})
        assert server.http_port == 9000 and server.grpc_port == 50051
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--help"])
    assert exit_info.value.code == 0
    assert "--http-port HTTP_PORT, --port HTTP_PORT" in capsys.readouterr().out


def test_model_names_match_in_any_case():
    assert resolve_model(ModelConfig(model="Tiny-Llama")).model_dir == resolve_model(ModelConfig()).model_dir
    preset = resolve_model(ModelConfig(model="Llama-2-7B", load_format="dummy"))
    assert preset.hf_config.num_hidden_layers == MODEL_PRESETS["llama-2-7b"]["num_hidden_layers"]


@pytest.mark.parametrize(
    "name, billions",
    [
        ("llama-2-7b", 6.74),
        ("llama-2-13b", 13.0),
        ("llama-2-70b", 69.0),
        ("llama-3-8b", 8.03),
        ("mistral-7b", 7.24),
        ("qwen2.5-7b", 7.6),
        ("opt-13b", 12.9),
        ("opt-66b", 66.0),
        ("opt-175b", 175.0),
    ],
)
def test_presets_have_the_published_sizes(name, billions):
    shape = model_shape(MODEL_PRESETS[name])
    assert shape.num_params / 1e9 == pytest.approx(billions, rel=0.03)
    resolved = resolve_model(ModelConfig(model=name, load_format="dummy"))
    assert resolved.hf_config.model_type == MODEL_PRESETS[name]["model_type"]
    assert resolved.max_model_len == MODEL_PRESETS[name]["max_position_embeddings"]


def test_dummy_weights_have_the_real_shape_and_serve():
    real = LLM("tiny-llama", cpu_packed_linear=False).engine.executor.worker.model
    dummy_llm = LLM("tiny-llama", load_format="dummy", seed=3, cpu_packed_linear=False)
    dummy = dummy_llm.engine.executor.worker.model
    assert {k: v.shape for k, v in real.state_dict().items()} == {k: v.shape for k, v in dummy.state_dict().items()}
    assert not torch.equal(real.lm_head.weight, dummy.lm_head.weight)
    assert len(dummy_llm.generate("x", SamplingParams(max_tokens=5, ignore_eos=True))[0].output_token_ids) == 5


def test_kv_cache_sizing():
    from distserve.core.config import CacheConfig
    from distserve.kv_transfer.plan import KVCacheShape
    from distserve.model_executor.kv_cache import CPU_KV_CACHE_LIMIT_BYTES, determine_num_blocks

    shape = KVCacheShape(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype=torch.float16)
    cpu = torch.device("cpu")
    assert determine_num_blocks(CacheConfig(num_kv_blocks=7), shape, cpu, 10**9) == 7
    # Capped by what the engine can fill ...
    assert determine_num_blocks(CacheConfig(), shape, cpu, 100) == 7
    # ... and on CPU by the limit, whatever the machine has free.
    assert determine_num_blocks(CacheConfig(), shape, cpu, 10**9) * shape.bytes_per_block <= CPU_KV_CACHE_LIMIT_BYTES
    assert shape.bytes_per_block == 32 * 2 * 16 * 32 * 128 * 2
    # Llama-2-7B in fp16 keeps half a MiB of KV per token.
    assert model_shape(MODEL_PRESETS["llama-2-7b"]).kv_bytes_per_token(2) == 2**19


def test_cluster_yaml_pools(tmp_path):
    from distserve import ClusterConfig

    path = tmp_path / "cluster.yaml"
    path.write_text(
        "model: {model: tiny-llama}\ncache: {block_size: 8}\n"
        "cluster:\n  name: demo\n  prefill: {instances: 2, tensor_parallel_size: 2}\n  decode: {max_num_seqs: 64}\n"
    )
    config = ClusterConfig.from_yaml(path)
    names = [name for name, _ in config.instance_configs()]
    assert names == ["demo-prefill-0", "demo-prefill-1", "demo-decode-0"]
    prefill, decode = config.instance_configs()[0][1], config.instance_configs()[2][1]
    assert (prefill.scheduler.role, prefill.parallel.tensor_parallel_size, prefill.cache.block_size) == (
        "prefill",
        2,
        8,
    )
    assert (decode.scheduler.role, decode.scheduler.max_num_seqs, decode.parallel.tensor_parallel_size) == (
        "decode",
        64,
        1,
    )
    for text, message in [
        ("cluster: {colocated: {}, decode: {}}", "a prefill and a decode pool"),
        ("cluster: {prefill: {instances: 0}, decode: {}}", "at least one instance"),
        ("cluster: {prefill: {block_sise: 8}, decode: {}}", "unknown option"),
        ("cluster: {prefill: {role: decode}, decode: {}}", "leave 'role' out"),
        ("cluster: {router: {}}", "role must be one of"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            ClusterConfig.from_yaml(path)


def test_generate_refuses_a_one_phase_role(capsys):
    assert main(["generate", "--role", "decode", "x"]) == 2
    assert "needs a disaggregated cluster" in capsys.readouterr().err


def test_setting_one_pool_keeps_the_other_pools_defaults():
    """``--decode-instances 2`` or ``Cluster(decode={...})`` alone: the prefill pool stays (1 instance)."""
    from distserve.cli import build_parser
    from distserve.cluster.api import make_cluster_config
    from distserve.entrypoints.launch import load_launch_config

    def shape(config):
        return [(str(pool.role), pool.instances) for pool in config.pools]

    assert shape(make_cluster_config(model="tiny-llama", decode={"instances": 2})) == [("prefill", 1), ("decode", 2)]
    assert shape(make_cluster_config(model="tiny-llama", prefill={"instances": 3})) == [("prefill", 3), ("decode", 1)]
    assert shape(make_cluster_config(model="tiny-llama", colocated={"instances": 2})) == [("colocated", 2)]
    args = vars(build_parser().parse_args(["launch", "--decode-instances", "2"]))
    cluster, _ = load_launch_config(flags={k: v for k, v in args.items() if k.startswith("decode_")})
    assert shape(cluster) == [("prefill", 1), ("decode", 2)]


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"distserve {version('distserve')}"


def _subparsers(parser):
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_flag_has_help_and_refused_flags_are_not_listed():
    from distserve.cli import build_parser

    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if action.option_strings and "--role" not in action.option_strings:
                assert action.help and action.help.strip(), f"distserve {name} {action.option_strings[0]}: no help"
        listed = re.search(r"--role(?![-\w])", sub.format_help())  # --role-control is another flag
        assert not listed, f"distserve {name} lists --role, which it refuses"
    assert main(["launch", "--role", "decode"]) == 2  # still refused with a sentence, not silently taken


def test_unknown_flags_name_the_closest_known_one(capsys):
    for argv, hint in [
        (["launch", "--tensor-paralel-size", "2"], "--tensor-paralel-size (did you mean --tensor-parallel-size?)"),
        (["serve", "--max-num-batch-tokens", "8"], "(did you mean --max-num-batched-tokens?)"),
        (["generate", "--temprature", "0", "hi"], "--temprature (did you mean --temperature?)"),
        (["place", "simulate", "--plan", "p.yaml", "--ratess", "1"], "--ratess (did you mean --rates?)"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert hint in capsys.readouterr().err


def test_vllm_spellings():
    """``distserve launch MODEL`` / ``serve``, ``-tp``/``-pp``, ``generate MODEL PROMPT``."""
    from distserve.cli import build_parser

    args = build_parser().parse_args(["serve", "tiny-qwen2", "-tp", "2", "-pp", "1", "--gpu-memory-utilization", "0.5"])
    assert (args.model_tag, args.tensor_parallel_size, args.pipeline_parallel_size) == ("tiny-qwen2", 2, 1)
    assert args.gpu_memory_utilization == 0.5
    assert main(["launch", "tiny-qwen2", "--model", "tiny-opt"]) == 2  # two different models


def test_generate_takes_a_positional_model(capsys):
    options = ["--max-tokens", "6", "--temperature", "0"]
    assert main(["generate", "tiny-opt", *options, "The cache block", "Hello"]) == 0
    positional = capsys.readouterr().out
    assert main(["generate", "--model", "tiny-opt", *options, "The cache block", "Hello"]) == 0
    assert positional == capsys.readouterr().out
    assert "--- 'The cache block'" in positional and "tiny-opt" not in positional


def test_gpu_memory_utilization_is_a_share_of_total_memory_less_what_the_process_uses():
    from distserve.model_executor.kv_cache import kv_cache_budget, memory_in_use, total_device_memory

    cpu = torch.device("cpu")
    config = CacheConfig(gpu_memory_utilization=0.5)
    budget = kv_cache_budget(config, cpu)
    expected = total_device_memory(cpu) // 2 - memory_in_use(cpu)
    assert abs(budget - expected) < 64 * 2**20  # the process's size moves a little between the two reads
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=1.5)
