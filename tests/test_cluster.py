"""The disaggregated cluster end to end: orchestrator, prefill and decode pools, KV migration."""

import asyncio
import os
import subprocess
import sys
import time

import psutil
import pytest
from conftest import (
    PROMPTS,
    SCHEMA,
    check_structured,
    in_use,
    random_prompts,
    reference_greedy,
    wait_nothing_in_use,
    wait_nothing_in_use_async,
)

from distserve import LLM, AsyncCluster, Cluster, SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.cluster.instance import IDLE_HEALTH_CHECK_S
from distserve.core.handover import Handover
from distserve.core.outputs import RequestDelta, coalesce
from distserve.entrypoints.prometheus import ServingMetrics

LENGTHS = [1, 7, 16, 33, 64, 101, 150, 200]
MAX_TOKENS = [12, 30, 5, 40, 17, 25, 9, 33]
# tiny-llama: 2 layers, 2 KV heads of 16 dims, float32
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def _migrations(cluster: Cluster) -> dict:
    """The decode instances' pull records, by the client's request id (instances know a request by
    the client's id and a suffix of its own)."""
    records = {}
    for state in cluster._async.orchestrator.instances:
        if state.role == "decode":
            pulls = cluster._run(_call(state.handle.migrations))
            records.update({request_id.rsplit("-", 1)[0]: record for request_id, record in pulls.items()})
    return records


def _check(cluster: Cluster, reference, seed: int, transport: str = "shm") -> None:
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=seed)
    outputs = cluster.generate(prompts, [_greedy(n) for n in MAX_TOKENS])
    for prompt, n, out in zip(prompts, MAX_TOKENS, outputs):
        assert out.output_token_ids == reference_greedy(reference, prompt, n), f"prompt of {len(prompt)} tokens"
        assert out.finished and out.finish_reason in ("length", "stop")
        metrics = out.metrics
        assert len(metrics.token_times) == len(out.output_token_ids)
        assert metrics.arrival_time <= metrics.prefill_start <= metrics.prefill_end <= metrics.token_times[0]
    _check_pulls(cluster, prompts, outputs, transport)


def _check_pulls(cluster: Cluster, prompts, outputs, transport: str, bytes_per_token: int = KV_BYTES_PER_TOKEN) -> None:
    """Each request's KV went to decode in one pull of its prompt's tokens, over ``transport``;
    then nothing is in use."""
    migrations = _migrations(cluster)
    for prompt, out in zip(prompts, outputs):
        if len(out.output_token_ids) > 1:  # a request that ends with its first token never migrates
            record = migrations[out.request_id]
            assert record.num_tokens == len(prompt)
            assert record.num_bytes == bytes_per_token * len(prompt)
            assert record.transport == transport
            assert out.metrics.prefill_end <= out.metrics.migration_start <= out.metrics.migration_end
    wait_nothing_in_use(cluster.info)


@pytest.fixture(scope="module")
def llama(reference_model):
    return reference_model("tiny-llama")


@pytest.mark.parametrize(
    "prefill, decode, transport",
    [
        # The decode pool reads over a group only: gloo, though both ends are on one Ray node.
        ({"instances": 2, "tensor_parallel_size": 2}, {"block_size": 16, "kv_transport": "group"}, "gloo"),
        ({"instances": 1, "pipeline_parallel_size": 2}, {"instances": 2, "tensor_parallel_size": 2}, "shm"),
    ],
    ids=["2P-tp2+1D-tp1-other-block-size-gloo", "1P-pp2+2D-tp2-shm"],
)
def test_disaggregated_greedy_equals_transformers(ray_cluster, llama, prefill, decode, transport):
    with Cluster(model="tiny-llama", block_size=8, prefill=prefill, decode=decode, dtype="float32") as cluster:
        _check(cluster, llama, seed=1, transport=transport)


def test_kv_pulled_over_shared_memory_on_one_node_is_reported_so(ray_cluster, llama):
    """1 prefill + 1 decode on CPU on one Ray node: the decode instance reads the prefill
    instance's cache in place, and says so in its pull totals and in /metrics."""
    with Cluster(model="tiny-llama", block_size=8, prefill={}, decode={}, dtype="float32") as cluster:
        _check(cluster, llama, seed=3)
        prefill, decode = cluster.info()
        totals = decode.kv_pulls_from[prefill.name]
        assert totals.transport == "shm" and totals.pulls > 0 and totals.num_bytes > 0
        metrics = ServingMetrics()
        metrics.update_instances([prefill, decode], 0, [], {})
        pulls = f'distserve_kv_pulls{{instance="{decode.name}",source="{prefill.name}",transport="shm"}}'
        assert f"{pulls} {float(totals.pulls)}" in metrics.render().decode()


@pytest.mark.parametrize("kv_transport, transport", [("auto", "shm"), ("group", "gloo")])
def test_bfloat16_kv_reaches_decode_bit_for_bit(ray_cluster, kv_transport, transport):
    """1 prefill + 1 decode in bfloat16, its KV read in place or sent over gloo, against a colocated
    bfloat16 engine on the same weights. A request run alone is the same computation in both, split
    at the hand-over: equal tokens and bit-equal logprobs, the first token's (prefill) and the
    others' (decode over the pulled KV); a value changed by one unit in the last place would move
    them by about 0.02. The pulls carry 2 bytes a value."""
    prompts = random_prompts([7, 33, 64, 150], 1024, seed=21)
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=0)
    colocated = LLM("tiny-llama", dtype="bfloat16", block_size=8)
    options = {"dtype": "bfloat16", "block_size": 8, "prefill": {}, "decode": {"kv_transport": kv_transport}}
    with Cluster(model="tiny-llama", **options) as cluster:
        outputs = []
        for prompt in prompts:
            [out], [expected] = cluster.generate([prompt], params), colocated.generate([prompt], params)
            assert out.output_token_ids == expected.output_token_ids
            assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in expected.logprobs]
            outputs.append(out)
        _check_pulls(cluster, prompts, outputs, transport, bytes_per_token=KV_BYTES_PER_TOKEN // 2)


def test_an_int8_cluster_shows_its_kv_dtype_and_pulls_the_bytes_the_planner_counts(ray_cluster):
    """1 prefill + 1 decode with int8 KV: each instance reports int8 next to its blocks (InstanceInfo,
    gRPC, /metrics), and each pull moves the codes and scales of its prompt's tokens, the bytes per
    token the planner counts for a hand-over."""
    from distserve.core.model_presets import TINY_MODEL_PRESETS, model_shape
    from distserve.entrypoints.grpc_server import instance_to_proto

    prompts = random_prompts([7, 40], 1024, seed=5)
    options = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 64, "kv_cache_dtype": "int8"}
    with Cluster(model="tiny-llama", prefill={}, decode={}, **options) as cluster:
        outputs = cluster.generate(prompts, _greedy(4))
        per_token = model_shape(TINY_MODEL_PRESETS["tiny-llama"]).kv_bytes_per_token(4, "int8")
        assert per_token == 2 * 2 * 2 * (16 + 4)  # layers, K and V, KV heads, 16 codes and a 4-byte scale
        _check_pulls(cluster, prompts, outputs, "shm", bytes_per_token=per_token)
        infos = cluster.info()
    shown = [(i.role, i.kv_cache_dtype, i.num_blocks) for i in infos]
    assert shown == [("prefill", "int8", 64), ("decode", "int8", 64)]
    assert [instance_to_proto(i).kv_cache_dtype for i in infos] == ["int8", "int8"]
    metrics = ServingMetrics()
    metrics.update_instances(infos, 0, [], {})
    text = metrics.render().decode()
    for i in infos:
        series = f'distserve_instance_kv_cache_blocks{{instance="{i.name}",kv_cache_dtype="int8",role="{i.role}"}}'
        assert f"{series} 64.0" in text


@pytest.fixture(scope="module")
def small_cluster(ray_cluster):
    """1 prefill + 1 decode, decode KV for about two of the requests at once, prefill for about four."""
    with Cluster(
        model="tiny-llama",
        block_size=8,
        prefill={"num_kv_blocks": 120, "kv_hold_fraction": 0.5},
        decode={"num_kv_blocks": 60},
        dtype="float32",
    ) as cluster:
        yield cluster


def test_small_decode_pool_throttles_prefill_and_loses_nothing(small_cluster, llama):
    prompts = random_prompts([150, 180, 200, 170, 160, 190, 140, 175], 1024, seed=2)
    outputs = small_cluster.generate(prompts, _greedy(20))
    for prompt, out in zip(prompts, outputs):
        assert out.output_token_ids == reference_greedy(llama, prompt, 20)
    prefill, decode = small_cluster.info()
    assert prefill.num_throttled_steps > 0  # held KV reached its limit: prefill waited for decode
    # Decode's 60 blocks of 8 tokens hold at most three of these (141+ tokens each): the rest waited.
    assert decode.num_admission_waits > 0
    wait_nothing_in_use(small_cluster.info)


def test_an_instance_reports_the_steps_it_ran_since_a_count(small_cluster):
    # New prompts (nothing cached): the prefill instance computes each prompt token once, in prompt
    # steps, and the decode instance each output token after the first, in decode steps; the steps
    # each instance reports since its count before the requests add up to exactly that.
    instances = small_cluster._async.orchestrator.instances
    before = [small_cluster._run(_call(s.handle.recent_steps, 1 << 62)) for s in instances]
    assert all(steps == [] for _, steps in before)
    prompts = random_prompts([40, 70, 25], 1024, seed=31)
    outputs = small_cluster.generate(prompts, _greedy(10))
    after = [small_cluster._run(_call(s.handle.recent_steps, n)) for s, (n, _) in zip(instances, before)]
    steps = {}
    for state, (count_before, _), (count, mine) in zip(instances, before, after):
        assert len(mine) == count - count_before > 0
        assert all(step.total > 0 and step.batch_size >= 1 for step in mine)
        steps[state.role] = mine
    assert all(step.is_prefill for step in steps["prefill"])
    assert sum(step.num_tokens for step in steps["prefill"]) == sum(map(len, prompts))
    assert not any(step.is_prefill for step in steps["decode"])
    assert sum(step.num_tokens for step in steps["decode"]) == sum(len(o.output_token_ids) - 1 for o in outputs)


def test_cancellation_at_every_stage_frees_every_block(small_cluster):
    """Requests left at random points: before their first token (queued or prefilling), right after
    it (waiting for decode room or migrating, behind two long requests that fill decode), or while
    decoding. Every block on both instances is free afterwards and the cluster still serves."""
    cluster = small_cluster
    params = SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True)

    async def leave_after(prompt, first_token_only: bool, delay: float) -> list:
        seen = []

        async def consume():
            async for out in cluster._async.generate(prompt, params):
                seen.append(out)
                if first_token_only:
                    return

        try:
            await asyncio.wait_for(consume(), delay)  # cancelled at the deadline, output or not
        except TimeoutError:
            pass
        return seen

    async def scenario():
        blockers = [asyncio.create_task(leave_after([7] * 200, False, 60)) for _ in range(2)]
        await asyncio.sleep(0.2)
        prompts = random_prompts([190, 120, 60, 150] * 4, 1024, seed=4)
        delays = [0.001, 0.005, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5] * 2
        left = [asyncio.create_task(leave_after(p, i % 3 == 0, d)) for i, (p, d) in enumerate(zip(prompts, delays))]
        return await asyncio.gather(*left), await asyncio.gather(*blockers)

    left, blockers = cluster._run(scenario())
    assert all(len(b[-1].output_token_ids) == 250 for b in blockers)
    cancelled = [seen for seen in left if not seen or not seen[-1].finished]
    stages = {min(len(seen), 2) for seen in cancelled}  # 0: no token yet, 1: first token only, 2: decoding
    assert stages == {0, 1, 2}, stages
    wait_nothing_in_use(cluster.info)
    assert len(cluster.generate("after", _greedy(4))[0].output_token_ids) >= 1


def test_colocated_cluster_is_the_same_api(ray_cluster, llama):
    with Cluster(model="tiny-llama", block_size=8, colocated={"instances": 2}, dtype="float32") as cluster:
        prompts = random_prompts(LENGTHS, 1024, seed=5)
        outputs = cluster.generate(prompts, [_greedy(n) for n in MAX_TOKENS])
        for prompt, n, out in zip(prompts, MAX_TOKENS, outputs):
            assert out.output_token_ids == reference_greedy(llama, prompt, n)
            assert out.metrics.migration_start is None
        # Prefix-aware dispatch: X goes to the second instance (the first is busy with Y); a later
        # prompt starting with X's 64 tokens follows it there and finds them cached.
        y, x, suffix = random_prompts([80, 64, 10], 1024, seed=6)
        cluster.generate([y, x], _greedy(4))
        again = cluster.generate([x + suffix], _greedy(4))[0]
        assert again.num_cached_tokens == 64
        wait_nothing_in_use(cluster.info)


def test_chunked_colocated_cluster_equals_transformers_and_frees_prompts_left_half_way(ray_cluster, llama):
    """Chunked prefill through the orchestrator: greedy output unchanged, a prompt's prefill spans
    steps, and requests cancelled while their prompts are half computed leave no block in use."""
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}
    with Cluster(model="tiny-llama", block_size=8, colocated={"instances": 2}, **chunked, dtype="float32") as cluster:
        prompts = random_prompts(LENGTHS, 1024, seed=7)
        outputs = cluster.generate(prompts, [_greedy(n) for n in MAX_TOKENS])
        for prompt, n, out in zip(prompts, MAX_TOKENS, outputs):
            assert out.output_token_ids == reference_greedy(llama, prompt, n)
        longest = outputs[LENGTHS.index(200)].metrics
        assert longest.prefill_batch_tokens <= 16 < 200  # its last chunk's step, not the whole prompt
        # Structured outputs beside chunked prompts: every document complete and valid.
        structured = [
            SamplingParams(max_tokens=300, temperature=1.0, seed=s, structured_outputs={"json": SCHEMA})
            for s in range(4)
        ]
        for out in cluster.generate(PROMPTS, structured):
            assert out.finish_reason == "stop", out.text
            check_structured("json", out.text)
        # Its 13 chunk steps follow one another: a step that samples nothing is no reason to idle.
        assert longest.prefill_end - longest.prefill_start < 13 * IDLE_HEALTH_CHECK_S / 2

        async def leave_after(prompt, delay: float) -> list:
            seen = []

            async def consume():
                async for out in cluster._async.generate(prompt, _greedy(50)):
                    seen.append(out)

            try:
                await asyncio.wait_for(consume(), delay)
            except TimeoutError:
                pass
            return seen

        async def scenario():
            prompts = random_prompts([200, 180, 150, 120] * 2, 1024, seed=8)
            return await asyncio.gather(*(leave_after(p, 0.01 * (i + 1)) for i, p in enumerate(prompts)))

        left = cluster._run(scenario())
        assert any(not seen for seen in left)  # some left before their prompts were through
        wait_nothing_in_use(cluster.info)


def test_text_matches_the_offline_engine(small_cluster):
    prompts = ["The cache block", "Hello world, the server", "A"]
    offline = LLM("tiny-llama", dtype="float32").generate(prompts, _greedy(24))
    served = small_cluster.generate(prompts, _greedy(24))
    assert [o.text for o in served] == [o.text for o in offline]
    assert [o.output_token_ids for o in served] == [o.output_token_ids for o in offline]


def test_bad_requests_are_refused_before_any_instance(small_cluster):
    with pytest.raises(ValueError, match="the prompt is empty"):
        small_cluster.generate("", _greedy(4))
    with pytest.raises(ValueError, match="token ids must be in"):
        small_cluster.generate([5, 99999], _greedy(4))


def test_async_cluster_streams(ray_cluster):
    async def main():
        cluster = await AsyncCluster.start(
            model="tiny-llama", prefill={}, decode={}, stream_interval=0, dtype="float32"
        )
        try:
            chunks = [out async for out in cluster.generate("Hello", _greedy(6))]
            # The first token (the prefill instance's) comes alone; decode tokens come as the steps
            # give them, though a poll that finds several waiting (a loaded machine) brings them at once.
            lengths = [len(c.output_token_ids) for c in chunks]
            assert lengths[0] == 1 and lengths[-1] == 6 and lengths == sorted(set(lengths)), lengths
            assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        finally:
            await cluster.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("pools", [{"colocated": {}}, {"prefill": {}, "decode": {}}], ids=["colocated", "1P+1D"])
def test_stream_interval_batches_decode_tokens_but_not_the_first_or_the_end(ray_cluster, llama, pools):
    """With an interval longer than the whole request, its decode tokens come together at its end
    (a decode instance's first tokens also at once when it has sent nothing for an interval),
    while its first token comes alone and at once: the interval delays neither."""
    prompt = random_prompts([20], 1024, seed=9)[0]

    async def main():
        cluster = await AsyncCluster.start(
            model="tiny-llama", block_size=8, stream_interval=1.0, **pools, dtype="float32"
        )
        try:
            for _ in range(2):  # the second run starts inside the interval begun by the first's end
                start = time.time()
                chunks, arrivals = [], []
                async for out in cluster.generate(prompt, _greedy(24)):
                    chunks.append(out)
                    arrivals.append(time.time())
                assert chunks[-1].output_token_ids == reference_greedy(llama, prompt, 24)
                sizes = [len(c.new_token_ids) for c in chunks]
                assert sizes[0] == 1 and len(sizes) <= 3 and chunks[-1].finished, sizes
                assert arrivals[0] - start < 0.5
                # The end came before the interval begun by the first token was up (the 23 steps
                # take ~0.2 s, ~0.6 s on a loaded machine): it did not wait for the interval either.
                assert arrivals[-1] - arrivals[0] < 0.95
        finally:
            await cluster.shutdown()

    asyncio.run(main())


def test_coalesce_joins_a_runs_plain_steps_and_keeps_ends_hand_overs_and_failures_apart():
    def delta(rid, tokens, finished=False, reason=None, handover=None, attempt=0, first=False):
        return RequestDelta(rid, attempt, tokens, "".join(map(str, tokens)), finished, reason, 0, handover, first=first)

    handover = Handover("b", 0, "p0", None, [3], [7], SamplingParams(), 0, [0], 16, 1, 1)
    deltas = [
        delta("a", [1], first=True), delta("b", [7], handover=handover), delta("a", [2]), delta("c", [5]),
        delta("a", [3], finished=True, reason="length"), delta("a", [4]), delta("c", [6], attempt=1),
        delta("c", [8], finished=True, reason="requeue"), delta("b", [9]),
    ]  # fmt: skip
    joined = coalesce(deltas)
    assert [(d.request_id, d.attempt, d.new_token_ids, d.new_text, d.finished, d.first) for d in joined] == [
        ("a", 0, [1, 2, 3], "123", True, True),  # up to its end
        ("b", 0, [7], "7", False, False),  # a hand-over stays alone
        ("c", 0, [5], "5", False, False),
        ("a", 0, [4], "4", False, False),  # nothing joins a run's end
        ("c", 1, [6], "6", False, False),  # another run of c
        ("c", 0, [8], "8", True, False),  # a failure that gives the run up stays apart
        ("b", 0, [9], "9", False, False),
    ]
    assert joined[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [-0.1, 2, True, "5ms"])
def test_stream_interval_is_checked(bad):
    with pytest.raises(ValueError, match="stream_interval must be between 0 and 1 second"):
        make_cluster_config(model="tiny-llama", stream_interval=bad, dtype="float32")


@pytest.mark.parametrize("bad", [0, True, 1.5])
def test_a_pool_s_instances_are_checked(bad):
    with pytest.raises(ValueError, match="the prefill pool needs at least one instance"):
        make_cluster_config(model="tiny-llama", prefill={"instances": bad}, decode={}, dtype="float32")


@pytest.mark.parametrize(
    "options, got",
    [
        ({"prefill": {"kv_cache_dtype": "int8"}, "decode": {}}, "prefill int8 and decode auto"),
        ({"kv_cache_dtype": "int8", "prefill": {}, "decode": {"kv_cache_dtype": "fp8"}}, "prefill int8 and decode fp8"),
    ],
)
def test_pools_with_different_kv_cache_dtypes_are_refused(options, got):
    with pytest.raises(ValueError) as refused:
        make_cluster_config(model="tiny-llama", dtype="float32", **options)
    assert str(refused.value) == (
        f"a hand-over copies KV blocks as they are: every pool must use the same cache.kv_cache_dtype, got {got}"
    )
    for same in ({"kv_cache_dtype": "int8", "prefill": {}, "decode": {}},
                 {"prefill": {"kv_cache_dtype": "fp8"}, "decode": {"kv_cache_dtype": "fp8"}},
                 {"colocated": {"kv_cache_dtype": "int8", "instances": 2}}):  # fmt: skip
        make_cluster_config(model="tiny-llama", dtype="float32", **same)


@pytest.mark.parametrize("bad", [0, True, 1.5])
def test_max_request_attempts_is_checked(bad):
    with pytest.raises(ValueError, match="max_request_attempts must be a positive integer"):
        make_cluster_config(model="tiny-llama", max_request_attempts=bad, dtype="float32")


def test_async_cluster_made_directly_serves_inside_async_with(ray_cluster):
    """``AsyncCluster(model=...)`` takes Cluster's arguments, starts on ``async with`` and stops on
    leaving it; used outside that span, it says so."""

    async def main():
        cluster = AsyncCluster(model="tiny-llama", block_size=8, num_kv_blocks=64, dtype="float32")
        with pytest.raises(RuntimeError, match="^this AsyncCluster is not started: use 'async with"):
            cluster.generate("Hello")
        async with cluster as running:
            assert running is cluster
            out = [o async for o in cluster.generate("Hello", _greedy(3))][-1]
            handles = [s.handle for s in cluster.orchestrator.instances]
        with pytest.raises(RuntimeError, match="^this AsyncCluster is shut down: make a new one$"):
            await cluster.info()
        # On a cluster, start() means that cluster: one shut down refuses rather than start another.
        with pytest.raises(RuntimeError, match="^this AsyncCluster is shut down: a cluster starts once$"):
            await cluster.start()
        return out, handles

    out, handles = asyncio.run(main())
    assert out.finished and len(out.output_token_ids) == 3
    assert handles
    for handle in handles:  # every instance's actor is gone (ray.kill takes effect asynchronously)
        deadline = time.monotonic() + 30
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray_cluster.get(handle.info.remote(), timeout=30)
                time.sleep(0.1)


def test_a_pull_that_fails_ends_the_request_with_an_error(ray_cluster):
    """A hand-over naming a prefill instance that is gone: decode frees what it allocated and
    reports the request as failed, not as cancelled."""
    from distserve import EngineConfig
    from distserve.cluster.instance import launch_instance
    from distserve.core.handover import Handover

    ray = ray_cluster
    config = EngineConfig.from_flat(model="tiny-llama", role="decode", block_size=8, num_kv_blocks=16, dtype="float32")
    decode = launch_instance(config, "orphan-decode")
    try:
        handover = Handover("orphan", 0, "no-such-instance", None, [5] * 40, [6], _greedy(8), 0, [0] * 5, 8, 40, 0)
        ray.get(decode.add_handover.remote(handover))
        outputs = []
        deadline = time.monotonic() + 10
        while not any(o.finished for o in outputs):
            assert time.monotonic() < deadline
            outputs += ray.get(decode.get_outputs.remote(0.5))
        assert [o.finish_reason for o in outputs if o.finished] == ["error"]
        info = ray.get(decode.info.remote())
        assert not in_use([info])
    finally:
        ray.kill(decode)


async def _call(method, *args):
    return await method.remote(*args)


def test_model_actors_on_cuda_load_every_kernel_at_start_unless_told_otherwise(ray_cluster, monkeypatch):
    """A CUDA actor's process starts with CUDA_MODULE_LOADING=EAGER (a lazily loaded kernel's first
    launch stalls its step), or with the mode the environment Ray is started from names; a CPU
    actor keeps Ray's default options."""
    from distserve.engine.ray_runtime import cuda_actor_options

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def module_loading():
        return os.environ.get("CUDA_MODULE_LOADING")

    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    assert cuda_actor_options("cpu") == {}
    assert ray.get(module_loading.options(**cuda_actor_options("cuda")).remote(), timeout=120) == "EAGER"
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    assert ray.get(module_loading.options(**cuda_actor_options("cuda")).remote(), timeout=120) == "LAZY"


def test_orchestrator_turns_an_error_finish_into_a_failure():
    """An output that ends with "error" reaches the client as InstanceFailure, not as a result, once
    the request has no run left."""
    from distserve import ClusterConfig, EngineConfig, Role
    from distserve.cluster.orchestrator import Orchestrator
    from distserve.cluster.request_table import RequestState
    from distserve.cluster.routing import InstanceState
    from distserve.core.errors import InstanceFailure
    from distserve.core.outputs import RequestDelta

    async def route() -> RequestState:
        orchestrator = Orchestrator(ClusterConfig(max_request_attempts=1))
        decode = InstanceState("decode-0", Role.DECODE, handle=None, info=None, config=EngineConfig())
        state = orchestrator.requests["r"] = RequestState("r", None, [5, 6, 7], SamplingParams(max_tokens=4))
        failed = RequestDelta("r", 0, [], "", True, "error", 0)
        orchestrator._route(decode, failed)
        await asyncio.gather(*orchestrator._background)
        assert not orchestrator.requests
        return state

    state = asyncio.run(route())
    item = state.queue.get_nowait()
    assert isinstance(item, InstanceFailure) and "failed on decode-0" in str(item)
    assert state.queue.empty()


# Two clusters one after the other, in a process of their own (the test session's Ray would hide a
# Ray that dies with the first cluster): the second reuses the Ray the first started.
_SCRIPT_START = """
import asyncio
from concurrent.futures import ThreadPoolExecutor

import psutil
import ray

from distserve import AsyncCluster, Cluster, SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0)
ray_nodes = []

def check(out):
    assert len(out.output_token_ids) == 3 and out.finished
    ray_nodes.append(ray.get_runtime_context().get_node_id())
"""
_SCRIPT_END = """
assert len(ray_nodes) == 2 and ray_nodes[0] == ray_nodes[1], ray_nodes
print("ray pids", *[p.pid for p in psutil.Process().children()])
"""
_TWO_CLUSTERS = {
    "Cluster": """
for _ in range(2):
    with Cluster(model="tiny-llama", block_size=8, num_kv_blocks=64) as cluster:
        [out] = cluster.generate([5, 6, 7], PARAMS)
    check(out)
""",
    "asyncio.run-on-threads": """
async def generate_once():
    cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=64)
    try:
        return [out async for out in cluster.generate([5, 6, 7], PARAMS)][-1]
    finally:
        await cluster.shutdown()

for _ in range(2):  # each loop on a thread of its own, which ends with it
    with ThreadPoolExecutor(1) as thread:
        check(thread.submit(asyncio.run, generate_once()).result())
""",
}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Slow scenarios: a process starting and stopping clusters twice, Ray included.
@pytest.mark.parametrize(
    "clusters",
    [pytest.param(code, id=name, marks=[pytest.mark.slow]) for name, code in _TWO_CLUSTERS.items()],
)
def test_clusters_one_after_another_reuse_the_ray_they_start(clusters):
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    script = _SCRIPT_START + clusters + _SCRIPT_END
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ray_pids = [int(pid) for pid in result.stdout.split("ray pids", 1)[1].split()]
    assert ray_pids, "no local Ray was started"
    deadline = time.monotonic() + 10
    while any(map(_alive, ray_pids)):  # Ray's atexit hook stops them with the process
        assert time.monotonic() < deadline, f"Ray processes outlived the script: {list(filter(_alive, ray_pids))}"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "policy, tight, order",
    [
        # a slow scenario: the 0.001 case below orders deadline-first the same way
        pytest.param("deadline", 5.0, ["tight", "cluster", "loose"], marks=pytest.mark.slow),
        ("fcfs", 5.0, ["loose", "cluster", "tight"]),
        ("deadline", 0.001, ["tight", "cluster", "loose"]),
        ("deadline-feasible", 0.001, ["cluster", "loose", "tight"]),
    ],
)
def test_the_orchestrator_gives_each_run_its_ttft_deadline(ray_cluster, llama, policy, tight, order):
    """Three prompts wait for the blocks a long request holds (each needs more than are free): one
    with a loose TTFT SLO of its own, one with none (the cluster's, tighter), one with a tight one,
    arriving in that order. The deadline policy prefills them by arrival plus SLO, fcfs by arrival;
    the feasible deadline policy runs one whose deadline passed while it waited after the others.
    Outputs stay greedy."""
    from distserve.core.slo import RequestSLO

    # 100 blocks of 8 tokens: the long request's 600 + 200 tokens fill them all; the others need 26.
    long_prompt, *prompts = random_prompts([600, 208, 208, 208], 1024, seed=11)
    slos = {"loose": RequestSLO(ttft=60.0), "cluster": None, "tight": RequestSLO(ttft=tight)}

    async def main():
        cluster = await AsyncCluster.start(
            model="tiny-llama", block_size=8, num_kv_blocks=100, max_num_batched_tokens=256, policy=policy,
            colocated={}, role_control={"slo_ttft": 30.0, "slo_tpot": 1.0}, stream_interval=0, dtype="float32",
        )  # fmt: skip

        async def run(prompt, n, slo=None, started=None):
            async for output in cluster.generate(prompt, _greedy(n), slo=slo):
                if started is not None:
                    started.set()
                last = output
            return last

        try:
            started = asyncio.Event()
            blocker = asyncio.create_task(run(long_prompt, 200, started=started))
            await started.wait()  # decoding: what it holds grows to every block until it ends
            waiting = []
            for prompt, slo in zip(prompts, slos.values()):
                waiting.append(asyncio.create_task(run(prompt, 4, slo)))
                await asyncio.sleep(0.05)
            long_out, *outs = await asyncio.gather(blocker, *waiting)
            assert long_out.metrics.token_times[-1] < min(o.metrics.token_times[0] for o in outs)  # they waited
            for prompt, out in zip(prompts, outs):
                assert out.output_token_ids == reference_greedy(llama, prompt, 4)
            first_tokens = sorted(zip(slos, outs), key=lambda named: named[1].metrics.token_times[0])
            assert [name for name, _ in first_tokens] == order
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize(
    "own, cluster_tpot, cut",
    [(1e-6, None, True), (None, 1e-6, True), (100.0, 1e-6, False)],
    ids=["own", "cluster", "own-loose"],
)
def test_the_orchestrator_gives_each_run_its_tpot_slo(ray_cluster, llama, own, cluster_tpot, cut):
    """With ``tpot_aware_chunking``, a 200-token prompt that arrives while a request decodes runs
    in one-block chunks when the decoding request's TPOT SLO (its own, else the cluster's) is one
    no step fits, and in one step under a loose SLO of its own (the budget is 256 tokens): its last
    chunk's batch holds 8 prompt tokens and the decoding one's token, or all 200. Outputs stay
    greedy."""
    from distserve.core.slo import RequestSLO

    decoding, prompt = random_prompts([100, 200], 1024, seed=12)

    async def main():
        cluster = await AsyncCluster.start(
            model="tiny-llama", block_size=8, max_num_batched_tokens=256, enable_chunked_prefill=True,
            tpot_aware_chunking=True, colocated={}, role_control={"slo_tpot": cluster_tpot}, stream_interval=0,
            dtype="float32",
        )  # fmt: skip
        try:
            tokens = asyncio.Event()
            slo = RequestSLO(tpot=own) if own else None

            async def decode():
                async for output in cluster.generate(decoding, _greedy(600), slo=slo):
                    if len(output.output_token_ids) >= 10:  # its prefill and decode steps have run
                        tokens.set()
                return output

            first = asyncio.create_task(decode())
            await tokens.wait()
            # One slow step among the first few can hide the slope (the line stays unknown a while).
            instance = cluster.orchestrator.instances[0].handle
            while await instance.step_line.remote() is None and not first.done():
                await asyncio.sleep(0.01)
            second = [output async for output in cluster.generate(prompt, _greedy(4))][-1]
            first = await first
            assert first.metrics.token_times[-1] > second.metrics.token_times[0]  # it ran beside the decoding one
            assert second.metrics.prefill_batch_tokens == (9 if cut else 201)
            assert first.output_token_ids == reference_greedy(llama, decoding, 600)
            assert second.output_token_ids == reference_greedy(llama, prompt, 4)
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(main())
