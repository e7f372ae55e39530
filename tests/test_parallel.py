"""Instances as Ray actors with tensor and pipeline parallelism over gloo, on CPU."""

import os
import signal
import time

import pytest
from conftest import in_use, random_prompts, reference_greedy

from distserve import LLM, EngineConfig, SamplingParams
from distserve.cluster.instance import launch_instance
from distserve.core.errors import InstanceFailure
from distserve.parallel.ranks import ParallelRank, stage_layers
from distserve.parallel.tensor_parallel import _split

LENGTHS = [1, 7, 16, 33, 64, 101, 150, 200]
MAX_TOKENS = [12, 30, 5, 40, 17, 25, 9, 33]
DEADLINE_S = 180


def _launch(ray, family: str, tp: int, pp: int, name: str, **options):
    config = EngineConfig.from_flat(
        model=family, tensor_parallel_size=tp, pipeline_parallel_size=pp, **options, dtype="float32"
    )
    return launch_instance(config, name)


def _submit(ray, handle, prompts, max_tokens, **params) -> list[str]:
    """Queue greedy requests, with ids unique across instances."""
    name = ray.get(handle.ready.remote())
    return [
        ray.get(handle.add_request.remote(p, SamplingParams(max_tokens=n, temperature=0.0, **params), f"{name}-{i}"))
        for i, (p, n) in enumerate(zip(prompts, max_tokens))
    ]


def _collect(ray, handles_and_ids) -> dict[str, list[int]]:
    """Final token ids of every request (instances send each step's new tokens), polling each
    instance until all have finished."""
    wanted = {rid for _, ids in handles_and_ids for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in wanted}
    done: set[str] = set()
    deadline = time.monotonic() + DEADLINE_S
    while len(done) < len(wanted):
        assert time.monotonic() < deadline, f"{len(wanted) - len(done)} requests unfinished after {DEADLINE_S} s"
        for handle, _ in handles_and_ids:
            for delta in ray.get(handle.get_outputs.remote(0.2)):
                tokens[delta.request_id] += delta.new_token_ids
                if delta.finished:
                    done.add(delta.request_id)
    return tokens


def _stop(ray, handle) -> None:
    ray.get(handle.shutdown.remote())
    ray.kill(handle)


# qwen2-tp2xpp2, llama-tp2 and opt-tp2 are slow scenarios: qwen2-tp2 (its one KV head replicated on
# both ranks), llama-tp2xpp2-chunked16, qwen2-pp2 and the TP=3 OPT case below run the same sharding.
@pytest.mark.parametrize(
    "family, tp, pp, chunk",
    [pytest.param("tiny-qwen2", 2, 1, 0, id="qwen2-tp2"),
     pytest.param("tiny-llama", 2, 1, 0, id="llama-tp2", marks=pytest.mark.slow),
     pytest.param("tiny-qwen2", 1, 2, 0, id="qwen2-pp2"),
     pytest.param("tiny-qwen2", 2, 2, 0, id="qwen2-tp2xpp2", marks=pytest.mark.slow),
     pytest.param("tiny-opt", 2, 1, 0, id="opt-tp2", marks=pytest.mark.slow),
     pytest.param("tiny-llama", 2, 2, 16, id="llama-tp2xpp2-chunked16")],
)  # fmt: skip
def test_parallel_instance_greedy_equals_transformers(ray_cluster, reference_model, family, tp, pp, chunk):
    """Mixed lengths in a KV pool that forces preemption; tiny-qwen2 has one KV head, replicated at TP=2.
    ``chunk``: chunked prefill with that token budget, decode tokens and prompt chunks in one step."""
    ray = ray_cluster
    model = reference_model(family)
    chunking = {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk} if chunk else {}
    name = f"{family}-tp{tp}-pp{pp}-c{chunk}"
    handle = _launch(ray, family, tp, pp, name, block_size=8, num_kv_blocks=30, **chunking)
    try:
        prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=3)
        ids = _submit(ray, handle, prompts, MAX_TOKENS)
        outputs = _collect(ray, [(handle, ids)])
        for rid, prompt, n in zip(ids, prompts, MAX_TOKENS):
            assert outputs[rid] == reference_greedy(model, prompt, n), f"prompt of {len(prompt)} tokens"
        info = ray.get(handle.info.remote())
        assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (tp, pp)
        assert info.num_preemptions > 0
        assert not in_use([ray.get(handle.info.remote())])
    finally:
        _stop(ray, handle)


def test_two_instances_at_once(ray_cluster, reference_model):
    """Instances of two models in one Ray cluster, serving at the same time; a third under a name in
    use is refused. One rank each: test_cluster's 1P-pp2+2D-tp2 runs three multi-rank groups at once."""
    ray = ray_cluster
    llama, qwen = reference_model("tiny-llama"), reference_model("tiny-qwen2")
    a = _launch(ray, "tiny-llama", 1, 1, "two-a")
    b = _launch(ray, "tiny-qwen2", 1, 1, "two-b")
    try:
        prompts_a = random_prompts(LENGTHS[:5], 1024, seed=4)
        prompts_b = random_prompts(LENGTHS[3:], 1024, seed=5)
        ids_a = _submit(ray, a, prompts_a, MAX_TOKENS[:5])
        ids_b = _submit(ray, b, prompts_b, MAX_TOKENS[3:])
        outputs = _collect(ray, [(a, ids_a), (b, ids_b)])
        for model, ids, prompts, lengths in (
            (llama, ids_a, prompts_a, MAX_TOKENS[:5]),
            (qwen, ids_b, prompts_b, MAX_TOKENS[3:]),
        ):
            for rid, prompt, n in zip(ids, prompts, lengths):
                assert outputs[rid] == reference_greedy(model, prompt, n)
        assert not in_use([ray.get(a.info.remote())])
        assert not in_use([ray.get(b.info.remote())])
        with pytest.raises(ValueError, match="already exists"):
            _launch(ray, "tiny-llama", 1, 1, "two-a")
    finally:
        _stop(ray, a)
        _stop(ray, b)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# The idle case is a slow scenario: test_faults replaces an idle instance whose worker died.
@pytest.mark.parametrize(
    "busy", [pytest.param(True, id="while-decoding"), pytest.param(False, id="while-idle", marks=pytest.mark.slow)]
)
def test_dead_worker_fails_the_instance_promptly(ray_cluster, busy):
    ray = ray_cluster
    handle = _launch(ray, "tiny-llama", 2, 1, f"dies-{busy}")
    try:
        pids = ray.get(handle.worker_pids.remote())
        if busy:
            _submit(ray, handle, random_prompts([50, 60], 1024), [1000, 1000], ignore_eos=True)
            while not ray.get(handle.get_outputs.remote(5.0)):
                pass
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(InstanceFailure, match="worker rank 1"):
            while time.monotonic() - killed < 30:
                ray.get(handle.get_outputs.remote(1.0))
        assert time.monotonic() - killed < 10
        assert "rank 1" in ray.get(handle.info.remote()).failure
        # The surviving rank, possibly blocked in a collective, is stopped rather than left to hang.
        while _alive(pids[0]) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert not _alive(pids[0])
        with pytest.raises(InstanceFailure):
            ray.get(handle.add_request.remote([1, 2, 3], SamplingParams()))
    finally:
        ray.kill(handle)


def test_offline_llm_with_dummy_weights_is_the_same_model_at_any_layout(ray_cluster):
    """Dummy weights are drawn per full tensor, so TP=2 serves exactly the TP=1 model."""
    prompts = random_prompts([5, 40, 90], 1024, seed=6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = LLM("tiny-llama", load_format="dummy", seed=7, dtype="float32").generate(prompts, params)
    sharded_llm = LLM("tiny-llama", load_format="dummy", seed=7, tensor_parallel_size=2, dtype="float32")
    try:
        sharded = sharded_llm.generate(prompts, params)
    finally:
        sharded_llm.shutdown()
    assert [o.output_token_ids for o in sharded] == [o.output_token_ids for o in single]


@pytest.mark.parametrize(
    "family, tp, pp, message",
    [
        ("tiny-gpt2", 2, 1, "not available for model family 'gpt2'"),
        ("tiny-llama", 3, 1, "4 attention heads, which 3 tensor parallel ranks cannot share"),
        ("tiny-qwen2", 1, 3, "3 pipeline stages need at least 3 decoder layers"),
    ],
)
def test_unsupported_layouts_are_refused_before_any_worker_starts(family, tp, pp, message):
    config = EngineConfig.from_flat(model=family, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    with pytest.raises(ValueError, match=message):
        launch_instance(config, "never-started")
    with pytest.raises(ValueError, match=message):
        LLM(config=config)


def test_rank_layout():
    ranks = [ParallelRank(tp_size=2, pp_size=2, rank=r) for r in range(4)]
    assert [(r.pp_rank, r.tp_rank) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.is_driver for r in ranks] == [False, False, True, False]
    assert ranks[1].peer_in_stage(1) == 3
    assert [stage_layers(10, 3, s) for s in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]


def test_head_split():
    # 8 query heads over 4 ranks: 2 each; 2 KV heads over 4 ranks: ranks 0-1 share head 0, ranks 2-3 head 1.
    assert [_split(8, 4, r, "q", replicable=True) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [_split(2, 4, r, "kv", replicable=True) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="cannot be split"):
        _split(6, 4, 0, "mlp", replicable=False)


def test_cli_generate_with_tensor_parallelism(ray_cluster, capsys):
    from distserve.cli import main

    argv = ["generate", "--model", "tiny-llama", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "Hello"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """tiny-llama with its LM head tied to the embeddings, as Llama-3.2 and OPT checkpoints are."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distserve.model_executor.tiny_models import ensure_tiny_model

    source = ensure_tiny_model("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(source, tie_word_embeddings=True)
    with torch.no_grad():
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    out = tmp_path_factory.mktemp("tied") / "tied-llama"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tied_embeddings_load_into_every_shard(ray_cluster, tied_llama, tp, pp):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tied_llama).eval()
    assert reference.config.tie_word_embeddings
    prompts = random_prompts([3, 30, 80], reference.config.vocab_size, seed=8)
    _assert_greedy_at_layout(tied_llama, reference, prompts, 10, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def _assert_greedy_at_layout(model_dir, reference, prompts, max_tokens: int, **layout) -> None:
    """The model served at ``layout`` (TP/PP sizes) gives transformers' greedy tokens."""
    llm = LLM(str(model_dir), **layout, dtype="float32")
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs):
        assert out.output_token_ids == reference_greedy(reference, prompt, max_tokens)


# tiny-llama and tiny-opt widened to six heads (three KV heads for Llama), so three ranks split their
# heads and MLPs while the vocabulary of 1024 does not divide: each rank keeps the embedding and LM head
# whole, as it does OPT-66B's 50272 at TP=3. The OPT one ties them, as OPT's checkpoints do.
SIX_HEADS = {
    "tiny-llama": {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 192},
    "tiny-opt": {"hidden_size": 96, "num_attention_heads": 6, "ffn_dim": 192, "word_embed_proj_dim": 96,
                 "tie_word_embeddings": True},
}  # fmt: skip


# The Llama case is a slow scenario: the OPT one splits the same way and ties its embeddings too.
@pytest.mark.parametrize("family", [pytest.param("tiny-llama", marks=pytest.mark.slow), "tiny-opt"])
def test_tp3_keeps_an_uneven_vocabulary_whole_and_equals_transformers(ray_cluster, tmp_path, family):
    from transformers import AutoModelForCausalLM

    from distserve.model_executor.tiny_models import make_tiny_model

    path = make_tiny_model(family, tmp_path / family, **SIX_HEADS[family])
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    assert reference.config.vocab_size % 3
    prompts = random_prompts([2, 45, 120], reference.config.vocab_size, seed=9)
    _assert_greedy_at_layout(path, reference, prompts, 16, tensor_parallel_size=3)


def test_every_family_the_rule_allows_has_a_plan():
    """The families ModelShape.tensor_parallel_problem lets through are the ones shard_model has a plan for."""
    from transformers import AutoConfig

    from distserve.core.model_presets import TENSOR_PARALLEL_FAMILIES
    from distserve.parallel.tensor_parallel import OWN_TP_PLANS

    for family in TENSOR_PARALLEL_FAMILIES:
        assert AutoConfig.for_model(family).base_model_tp_plan or family in OWN_TP_PLANS, family
