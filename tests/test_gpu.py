"""The engine on CUDA: exact in float32, serving in bfloat16. Skipped without a GPU."""

import os

import pytest
import torch
from conftest import FAMILIES, assert_engine_idle, random_prompts, reference_greedy

from distserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [1, 9, 33, 64, 120, 200, 17, 80]


def check_greedy_on_cuda(family: str, reference_model, lengths=LENGTHS, max_tokens: int = 24, **options) -> LLM:
    """Greedy outputs of ``LLM(family, **options)`` on CUDA in float32 equal transformers'."""
    model = reference_model(family).to("cuda")
    try:
        llm = LLM(family, device="cuda", dtype="float32", block_size=8, num_kv_blocks=60, **options)
        prompts = random_prompts(lengths, model.config.vocab_size)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for prompt, out in zip(prompts, outputs):
            assert out.output_token_ids == reference_greedy(model, prompt, max_tokens)
        assert_engine_idle(llm.engine)
    finally:
        model.to("cpu")
    return llm


def decode_graphs(llm: LLM):
    return llm.engine.executor.worker.decode_graphs


@pytest.mark.parametrize(
    "options",
    [
        {"attention_backend": "sdpa"},
        {"attention_backend": "compiled"},
        {"attention_backend": "triton", "enforce_eager": True},
        {"attention_backend": "triton"},
    ],
    ids=["sdpa", "compiled", "triton-eager", "triton-graphs"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_greedy_equals_transformers_on_cuda(family, options, reference_model):
    llm = check_greedy_on_cuda(family, reference_model, **options)
    assert (decode_graphs(llm) is not None) == (options == {"attention_backend": "triton"})


def test_decode_graphs_pad_batches_between_captured_sizes(reference_model):
    """11 sequences run as the 16-row graph, then fewer as they finish: padding rows write only
    the scratch block, so outputs stay greedy-equal."""
    llm = check_greedy_on_cuda(
        "tiny-llama", reference_model, lengths=[3, 70, 12, 5, 33, 90, 1, 17, 48, 26, 8], max_num_seqs=24
    )
    assert decode_graphs(llm).sizes == [1, 2, 4, 8, 16, 24]


def test_chunked_prefill_with_the_triton_decode_on_cuda(reference_model):
    """Decode tokens and prompt chunks in one step: the decode rows through the Triton kernel."""
    options = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "attention_backend": "triton"}
    check_greedy_on_cuda("tiny-llama", reference_model, **options)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_8bit_kv_read_in_place_by_the_triton_kernel_equals_sdpa_over_it_dequantized(cache_dtype):
    """An int8 or fp8 KV cache on CUDA in float32: the Triton kernel reading codes and scales in
    place, eager and in decode graphs, gives the greedy tokens of SDPA over the same cache
    dequantized (the write and prefill are the same for both)."""
    from distserve.model_executor.triton_attention import supports_cache_dtype

    if not supports_cache_dtype(cache_dtype, torch.device("cuda")):
        pytest.skip(f"Triton reads {cache_dtype} on compute capability 8.9 and newer")
    prompts = random_prompts(LENGTHS, 1024)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", block_size=8, num_kv_blocks=200, kv_cache_dtype=cache_dtype)
    outputs = {}
    for backend, eager in (("sdpa", True), ("triton", True), ("triton", False)):
        llm = LLM("tiny-llama", attention_backend=backend, enforce_eager=eager, **options)
        assert (decode_graphs(llm) is not None) == (backend == "triton" and not eager)
        outputs[backend, eager] = [o.output_token_ids for o in llm.generate(prompts, params)]
        assert_engine_idle(llm.engine)
    assert outputs["triton", True] == outputs["sdpa", True]
    assert outputs["triton", False] == outputs["sdpa", True]


@pytest.mark.parametrize("backend", ["sdpa", "triton"], ids=["sdpa", "triton-graphs"])
def test_swapped_kv_comes_back_exact_on_cuda(reference_model, backend):
    """60 blocks for the 8 prompts: preempted sequences are swapped out to pinned host memory and
    back on the cache's swap stream, the forward passes ordered after the copies; greedy-equal,
    the copies timed on the device, nothing in use on the device or the host afterwards."""
    llm = check_greedy_on_cuda("tiny-llama", reference_model, swap_space=0.01, attention_backend=backend)
    swap = llm.engine.scheduler.swap
    assert swap.num_swap_outs > 0 and swap.num_swap_ins == swap.num_swap_outs
    assert swap.copy_seconds > 0 and swap.num_free_blocks == swap.num_blocks
    cache = llm.engine.executor.worker.kv_cache
    assert cache.host.is_pinned() and cache.swap_seconds() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_serves_and_frees_every_block(family):
    llm = LLM(family, device="cuda")  # auto: bfloat16, the Triton kernel, decode graphs
    assert llm.engine.executor.worker.dtype == torch.bfloat16
    assert decode_graphs(llm) is not None
    prompts = random_prompts(LENGTHS, 1024)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert all(len(o.output_token_ids) == 16 for o in outputs)
    assert_engine_idle(llm.engine)


def test_bfloat16_prefill_attention_runs_on_the_flash_kernel():
    """Prompts attend through SDPA's flash kernel: with only that kernel allowed, SDPA raises
    rather than fall back to its math path (float32 products of bfloat16 inputs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    llm = LLM("tiny-llama", device="cuda")
    prompts = random_prompts([5, 40, 120], 1024)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.output_token_ids) == 4 for o in outputs)
    assert_engine_idle(llm.engine)


def test_prefill_and_decode_engines_hand_over_kv_on_cuda(reference_model):
    """A prefill engine and a decode engine on the GPU, the KV moved between their CUDA caches:
    greedy output equal to transformers."""
    from test_roles import check_hand_over

    model = reference_model("tiny-llama").to("cuda")
    try:
        check_hand_over(model, device="cuda", dtype="float32")
    finally:
        model.to("cpu")


def test_instance_actor_on_cuda_equals_transformers(ray_cluster, reference_model):
    """The instance path (a Ray actor holding the GPU, its step loop, long-polled outputs) on CUDA."""
    from distserve import EngineConfig
    from distserve.cluster.instance import launch_instance
    from distserve.engine.ray_runtime import NOSET_CUDA_VISIBLE_DEVICES

    ray = ray_cluster
    model = reference_model("tiny-llama").to("cuda")
    config = EngineConfig.from_flat(model="tiny-llama", device="cuda", dtype="float32", block_size=8, num_kv_blocks=40)
    handle = launch_instance(config, "gpu-instance")
    try:
        prompts = random_prompts(LENGTHS, model.config.vocab_size)
        ids = [
            ray.get(handle.add_request.remote(p, SamplingParams(max_tokens=16, temperature=0.0), f"gpu-{i}"))
            for i, p in enumerate(prompts)
        ]
        tokens, done = {rid: [] for rid in ids}, set()
        while len(done) < len(ids):
            for delta in ray.get(handle.get_outputs.remote(5.0)):
                tokens[delta.request_id] += delta.new_token_ids
                if delta.finished:
                    done.add(delta.request_id)
        for rid, prompt in zip(ids, prompts):
            assert tokens[rid] == reference_greedy(model, prompt, 16)
        info = ray.get(handle.info.remote())
        assert info.num_free_blocks == info.num_blocks
        # Every kernel loaded at start, and the one-GPU option Ray was started with kept beside it.
        env = ray.get(handle.__ray_call__.remote(lambda _: dict(os.environ)))
        assert env["CUDA_MODULE_LOADING"] == os.environ.get("CUDA_MODULE_LOADING", "EAGER")
        assert env.get(NOSET_CUDA_VISIBLE_DEVICES) == os.environ.get(NOSET_CUDA_VISIBLE_DEVICES)
    finally:
        ray.kill(handle)
        model.to("cpu")


# Two instances on the one GPU (conftest's Ray cluster lets them share it), each sized by blocks,
# not by the GPU's free memory, which the first would take.
ON_ONE_GPU = dict(model="tiny-llama", device="cuda", dtype="float32", block_size=8, num_kv_blocks=200)


def test_disaggregated_cluster_on_one_gpu_equals_transformers(ray_cluster, reference_model):
    """A prefill and a decode instance, each a Ray actor with a CUDA context of its own: the decode
    instance pulls the KV out of the prefill instance's cache over CUDA IPC."""
    from test_cluster import _check

    from distserve import Cluster

    model = reference_model("tiny-llama").to("cuda")
    try:
        with Cluster(prefill={}, decode={}, **ON_ONE_GPU) as cluster:
            _check(cluster, model, seed=1, transport="ipc")
    finally:
        model.to("cpu")


def test_roles_change_under_load_on_one_gpu(ray_cluster, reference_model):
    """Every direction of role change with requests queued, held, arriving and decoding, on CUDA:
    decode steps as CUDA graphs and chunked prefill through the Triton kernel across the changes."""
    from test_role_change import check_roles_change_under_load

    model = reference_model("tiny-llama").to("cuda")
    try:
        check_roles_change_under_load(model, **{k: v for k, v in ON_ONE_GPU.items() if k != "model"})
    finally:
        model.to("cpu")
