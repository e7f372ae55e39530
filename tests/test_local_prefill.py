"""Per-request disaggregation (``cluster.local_prefill``): the rule, its config, the simulator's
model of it, and a cluster whose decode instance prefills the prompts the rule keeps local."""

import asyncio
import dataclasses
from fractions import Fraction

import pytest
from conftest import random_prompts, reference_greedy, wait_nothing_in_use_async

from distserve import AsyncCluster, SamplingParams
from distserve.cluster.config import ClusterConfig
from distserve.core.local_prefill import LocalPrefillConfig, prefill_locally
from distserve.entrypoints.launch import load_launch_config
from placement.engine_sim import simulate_blocks
from placement.sim_specs import DecodeInstanceSpec, PrefillInstanceSpec, SimRequest

ON = LocalPrefillConfig("on", 100)
AUTO = LocalPrefillConfig("auto", 100)


@pytest.mark.parametrize(
    "config, to_compute, decode_queued, prefill_queued, local",
    [
        (LocalPrefillConfig(), 10, 0, 1000, False),  # off: always disaggregated
        (ON, 100, 0, 100, True),
        (ON, 101, 0, 5000, False),  # too long, however long the prefill queue
        (ON, 50, 500, 50, True),  # on ignores the queues
        (AUTO, 50, 0, 50, True),  # an idle prefill instance is no faster
        (AUTO, 50, 60, 5000, False),  # the decode instance has enough prompts to prefill already
        (AUTO, 50, 50, 5000, True),
        (AUTO, 50, 10, 55, False),  # the prefill instance would reach the first token sooner
        (AUTO, 101, 0, 5000, False),
    ],
)
def test_the_rule(config, to_compute, decode_queued, prefill_queued, local):
    assert prefill_locally(config, to_compute, decode_queued, prefill_queued) is local


def test_config_takes_a_mode_or_a_mapping_and_refuses_what_is_not():
    engine = {"model": {"model": "tiny-llama"}}
    config = ClusterConfig.from_dict({**engine, "cluster": {"local_prefill": "auto"}})
    assert config.local_prefill == LocalPrefillConfig("auto")
    config = ClusterConfig.from_dict({**engine, "cluster": {"local_prefill": {"mode": "on", "max_tokens": 64}}})
    assert config.local_prefill == LocalPrefillConfig("on", 64)
    assert ClusterConfig.from_dict(engine).local_prefill.mode == "off"
    with pytest.raises(ValueError, match="local_prefill.mode must be one of off, on, auto, got 'always'"):
        ClusterConfig.from_dict({**engine, "cluster": {"local_prefill": "always"}})
    with pytest.raises(ValueError, match="unknown local_prefill option"):
        ClusterConfig.from_dict({**engine, "cluster": {"local_prefill": {"mode": "on", "tokens": 5}}})
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        LocalPrefillConfig("on", 0)


def test_launch_flags_override_the_config_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("model: {model: tiny-llama}\ncluster: {local_prefill: on}\n")
    cluster, _ = load_launch_config(str(path), flags={"local_prefill_max_tokens": 64})
    assert cluster.local_prefill == LocalPrefillConfig("on", 64)
    cluster, _ = load_launch_config(str(path), flags={"local_prefill": "auto"})
    assert cluster.local_prefill == LocalPrefillConfig("auto")


def test_the_simulator_prefills_short_prompts_on_the_decode_instance():
    """1P+1D, ``on`` at 50 tokens: the 20-token prompt runs on decode-0 (its prefill batch there,
    1.2 s, then its steps), no hand-over, no pull; the 80-token one is disaggregated as always."""
    batch_time = lambda lens: 1 + Fraction(1, 100) * sum(lens)  # noqa: E731
    prefill = PrefillInstanceSpec(1, batch_time, None, 4096, 10_000, 16)
    decode = DecodeInstanceSpec(1, lambda batch, context: Fraction(1, 10), None, 256, 10_000, 16)
    requests = [SimRequest(Fraction(0), 20, 3), SimRequest(Fraction(0), 80, 3)]
    rule = LocalPrefillConfig("on", 50)
    short, long = (r.timeline for r in simulate_blocks(requests, prefill, decode, lambda n: Fraction(1, 2),
                                                        local_prefill=rule))  # fmt: skip
    assert short.local_prefill and short.prefill_instance == short.decode_instance == "decode-0"
    assert short.handover is None and short.migration_start is None
    assert (short.prefill_start, short.prefill_end) == (0, Fraction(6, 5))
    assert short.token_times == [Fraction(6, 5), Fraction(13, 10), Fraction(14, 10)]
    assert not long.local_prefill and long.prefill_instance == "prefill-0" and long.decode_instance == "decode-0"
    assert long.migration_end == long.prefill_end + Fraction(1, 2)
    chunked = dataclasses.replace(decode, max_batch_tokens=8, chunked_prefill=True)
    short = simulate_blocks(requests, prefill, chunked, lambda n: Fraction(1, 2), local_prefill=rule)[0].timeline
    assert short.local_prefill and short.prefill_end == Fraction(108 + 108 + 104, 100)  # chunks of 8, 8 and 4
    off = simulate_blocks(requests, prefill, decode, lambda n: Fraction(1, 2))
    assert not any(r.timeline.local_prefill for r in off) and all(r.timeline.handover is not None for r in off)


async def _final(cluster, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async for output in cluster.generate(prompt, params):
        last = output
    return last


def test_a_decode_instance_prefills_what_the_rule_keeps_local(ray_cluster, reference_model):
    """1P+1D. ``on`` at 24 tokens: the short prompts are prefilled and decoded on the decode
    instance (no pull), the long ones disaggregated; every output greedy-equal. Then ``auto``:
    a conversation's second turn, whose history the decode instance holds in its prefix cache
    (its prompt pulled there, its answer decoded there), is prefilled there from the cached
    blocks, greedy-equal too; nothing is in use afterwards."""
    llama = reference_model("tiny-llama")
    short, long = random_prompts([8, 12, 20], 1024, seed=5), random_prompts([40, 70], 1024, seed=6)
    max_tokens = 16

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=128,
                                           local_prefill={"mode": "on", "max_tokens": 24}, dtype="float32")  # fmt: skip
        try:
            prompts = short + long
            outputs = await asyncio.gather(*(_final(cluster, p, max_tokens) for p in prompts))
            assert [o.output_token_ids for o in outputs] == [reference_greedy(llama, p, max_tokens) for p in prompts]
            decode = next(i for i in await cluster.info() if i.role == "decode")
            assert [o.metrics.local_prefill for o in outputs] == [True] * 3 + [False] * 2
            assert {o.metrics.prefill_instance for o in outputs[:3]} == {decode.name}
            assert all(o.metrics.migration_start is None for o in outputs[:3])
            assert decode.num_kv_pulls == 2

            cluster.orchestrator.config.local_prefill = LocalPrefillConfig("auto", 24)
            first = random_prompts([48], 1024, seed=7)[0]  # too long to stay local
            turn1 = await _final(cluster, first, max_tokens)
            assert not turn1.metrics.local_prefill
            second = first + turn1.output_token_ids + random_prompts([6], 1024, seed=8)[0]
            turn2 = await _final(cluster, second, max_tokens)  # 70 tokens, 56 of them cached on decode
            assert turn2.metrics.local_prefill and turn2.num_cached_tokens == 56
            assert turn2.output_token_ids == reference_greedy(llama, second, max_tokens)
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())
