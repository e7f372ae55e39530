"""Instances killed with requests in flight: every request ends equal to its fault-free greedy output
(or with InstanceFailure when no run is left), no block stays in use, the dead instance is replaced
and the cluster serves new requests."""

import asyncio
import time

import pytest
from conftest import random_prompts, reference_greedy

from distserve import AsyncCluster, SamplingParams
from distserve.executor import InstanceFailure

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def llama(reference_model):
    return reference_model("tiny-llama")


async def _collect(cluster: AsyncCluster, prompt: list[int], progress: dict, key: int) -> list[int]:
    """The request's tokens as the client sees them, each exactly once, in order."""
    tokens: list[int] = []
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    async for output in cluster.generate(prompt, params):
        tokens += output.new_token_ids
        assert tokens == output.token_ids  # nothing repeated, nothing skipped
        progress[key] = len(tokens)
    return tokens


async def _all_blocks_free(cluster: AsyncCluster) -> None:
    deadline = time.monotonic() + 10
    while True:
        infos = await cluster.info()
        if all(i.num_free_blocks == i.num_blocks and i.num_held == i.num_pending == 0 and not i.failure
               for i in infos):  # fmt: skip
            return
        assert time.monotonic() < deadline, "blocks still in use:\n" + "\n".join(map(str, infos))
        await asyncio.sleep(0.05)


async def _wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _kill(cluster: AsyncCluster, role: str, ray) -> str:
    entry = next(s for s in cluster.orchestrator.instances if s.role == role and s.failure is None)
    ray.kill(entry.handle)
    return entry.name


# (role killed, how far the first requests have got when it dies)
STAGES = {
    "prefill-during-prefill": ("prefill", 0),  # killed as soon as the requests are sent
    "prefill-during-decode": ("prefill", 5),  # some requests decoding, some still waiting or migrating
    "decode-during-decode": ("decode", 5),
    "decode-during-migration": ("decode", 1),  # first tokens out: hand-overs and pulls under way
}


@pytest.mark.parametrize("stage", STAGES)
def test_killed_instance_requests_rerun_to_the_same_output(ray_cluster, llama, stage):
    role, reached = STAGES[stage]
    prompts = random_prompts([40, 300, 120, 500, 80, 250, 16, 400], 1024, seed=len(stage))
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=400)
        try:
            progress: dict[int, int] = {}
            tasks = [asyncio.create_task(_collect(cluster, p, progress, i)) for i, p in enumerate(prompts)]
            await _wait_until(lambda: sum(n >= reached for n in progress.values()) >= 2 if reached else True)
            killed = _kill(cluster, role, ray_cluster)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert results == expected
            # Requests that no longer needed the dead instance may all be done before its replacement is up.
            names = lambda: [s.name for s in cluster.orchestrator.instances]  # noqa: E731
            await _wait_until(lambda: any(name.endswith(f"{role}-r1") for name in names()), timeout=60)
            assert killed not in names()
            await _all_blocks_free(cluster)
            # The replacement serves.
            again = await _collect(cluster, prompts[0], {}, 0)
            assert again == expected[0]
            await _all_blocks_free(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_without_reruns_a_lost_instance_fails_its_requests(ray_cluster, llama):
    """max_request_attempts=1 and no replacement: requests that needed the dead decode instance end
    with InstanceFailure naming it, the prefill side frees every block, and new requests are refused."""
    prompts = random_prompts([50, 60, 70], 1024, seed=9)

    async def scenario():
        cluster = await AsyncCluster.start(
            model="tiny-llama", block_size=8, num_kv_blocks=200, max_request_attempts=1,
            replace_failed_instances=False,
        )  # fmt: skip
        try:
            progress: dict[int, int] = {}
            tasks = [asyncio.create_task(_collect(cluster, p, progress, i)) for i, p in enumerate(prompts)]
            await _wait_until(lambda: len(progress) == len(prompts) and min(progress.values()) >= 3)
            killed = _kill(cluster, "decode", ray_cluster)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, InstanceFailure) and killed in str(r) for r in results), results
            with pytest.raises(InstanceFailure, match="no decode instance"):
                await _collect(cluster, prompts[0], {}, 0)
            prefill = next(i for i in await cluster.info() if i.role == "prefill")
            assert prefill.num_free_blocks == prefill.num_blocks and prefill.num_held == 0
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_sampled_requests_rerun_to_the_same_tokens(ray_cluster):
    """A request sampled at temperature > 0 without a seed gets one at admission, so a re-run after
    its decode instance dies continues the very stream the client was reading."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    prompt = random_prompts([64], 1024, seed=3)[0]

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=200)
        try:
            seen: list[int] = []
            async for output in cluster.generate(prompt, params):
                seen += output.new_token_ids
                assert seen == output.token_ids
                if len(seen) == 10:
                    _kill(cluster, "decode", ray_cluster)
            assert len(seen) == MAX_TOKENS
            orchestrator = cluster.orchestrator
            assert not orchestrator.requests
            await _all_blocks_free(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_overload_completes_every_request_and_leaks_nothing(ray_cluster, llama):
    """500 requests at once against KV pools sized for about a tenth of them: all complete, each equal
    to its greedy output, and every block is free afterwards."""
    prompts = random_prompts([16 + (i * 7) % 48 for i in range(500)], 1024, seed=11)
    max_tokens = 16
    expected = [reference_greedy(llama, p, max_tokens) for p in prompts]
    # A request needs 7 blocks on average (ceil((40 + 16) / 8)), 10 at most: 350 blocks hold about 50.
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def final(cluster, prompt):
        async for output in cluster.generate(prompt, params):
            last = output
        return last.token_ids

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=350)
        try:
            results = await asyncio.wait_for(asyncio.gather(*(final(cluster, p) for p in prompts)), 600)
            assert results == expected
            await _all_blocks_free(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_kv_held_past_its_deadline_is_freed_and_a_late_pull_refused(ray_cluster):
    """A prefill instance whose prefilled request no decode instance pulls frees its blocks at
    ``kv_hold_timeout`` and reports the request failed; a pull that comes later is refused, so
    decode never uses KV from blocks that may have been reused."""
    from distserve import EngineConfig
    from distserve.instance import launch_instance

    config = EngineConfig.from_flat(
        model="tiny-llama", scheduler="prefill", block_size=8, num_kv_blocks=32, kv_hold_timeout=0.5
    )
    prefill = launch_instance(config, "hold-deadline-prefill")
    try:
        ray = ray_cluster
        ray.get(prefill.add_request.remote(list(range(3, 43)), SamplingParams(max_tokens=8), "held"))
        outputs, started = [], time.monotonic()
        while not any(o.finished for o in outputs):
            assert time.monotonic() - started < 10
            outputs += ray.get(prefill.get_outputs.remote(0.5))
        assert outputs[0].prefilled is not None  # the first token, with the hand-over
        assert [o.finish_reason for o in outputs if o.finished] == ["error"]
        assert 0.5 <= time.monotonic() - started < 3.0
        info = ray.get(prefill.info.remote())
        assert info.num_free_blocks == info.num_blocks and info.num_held == 0
        assert ray.get(prefill.release.remote("held")) is False
    finally:
        ray_cluster.kill(prefill)


def test_cancellation_at_every_stage_frees_blocks_within_a_second(ray_cluster):
    """Clients leaving at every stage (queued for prefill, prefilling, holding KV for decode,
    migrating, decoding): one second after the last leaves, no block is in use on either side."""
    prompts = random_prompts([300, 500, 120, 450, 60, 380, 250, 480] * 3, 1024, seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def leave_after(cluster, prompt, chunks: int) -> None:
        if chunks == 0:  # gone before any token: queued or prefilling
            stream = cluster.generate(prompt, params)
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
            return
        seen = 0
        async for _ in cluster.generate(prompt, params):
            seen += 1
            if seen == chunks:  # 1: KV held or migrating; 2: just handed over; 10: decoding
                return

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=600)
        try:
            stages = [0, 1, 2, 10]
            await asyncio.gather(*(leave_after(cluster, p, stages[i % 4]) for i, p in enumerate(prompts)))
            left = time.monotonic()
            while True:
                infos = await cluster.info()
                if all(i.num_free_blocks == i.num_blocks and i.num_held == i.num_pending == 0 for i in infos):
                    break
                assert time.monotonic() - left < 1.0, "blocks still in use:\n" + "\n".join(map(str, infos))
                await asyncio.sleep(0.01)
            assert not cluster.orchestrator.requests
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())
