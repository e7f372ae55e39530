"""Instances killed with requests in flight: every request ends equal to its fault-free greedy output
(or with InstanceFailure when no run is left), no block stays in use, the dead instance is replaced
and the cluster serves new requests."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import in_use, random_prompts, reference_greedy, wait_nothing_in_use_async

from distserve import AsyncCluster, SamplingParams
from distserve.core.errors import InstanceFailure

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
        assert tokens == output.output_token_ids  # nothing repeated, nothing skipped
        progress[key] = len(tokens)
    return tokens


async def _wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _healthy(cluster: AsyncCluster, role: str):
    return next(s for s in cluster.orchestrator.instances if s.role == role and s.failure is None)


def _kill(cluster: AsyncCluster, role: str, ray) -> str:
    entry = _healthy(cluster, role)
    ray.kill(entry.handle)
    return entry.name


def _process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped has too): nothing a SIGCONT could resume."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _decoding(state) -> bool:
    return len(state.samples[0].run.output_token_ids) >= 3  # tokens past the first: the decode side has it


def _not_pulled(state) -> bool:
    return state.metrics.migration_end is None  # its KV is still (only) on the prefill side


def _prefilling(state) -> bool:
    return state.prefill is not None and state.metrics.prefill_end is None


# Each stage: the role killed, and what the orchestrator's requests must show at the kill.
STAGES = {
    # Prompts still to prefill at the kill. Both prefill stages run batches of at most 512 tokens
    # (below): prefill then lasts several batches, so neither stage fits between two polls of a
    # loaded machine's event loop, as one batch and pulls through shared memory can.
    "prefill-during-prefill": ("prefill", lambda states: len(states) == 8 and any(map(_prefilling, states))),
    "prefill-during-decode": ("prefill", lambda states: any(map(_decoding, states)) and any(map(_not_pulled, states))),
    "decode-during-decode": ("decode", lambda states: sum(map(_decoding, states)) >= 2),
    # First tokens out, KV held for decode or being pulled.
    "decode-during-migration": ("decode", lambda states: any(s.decode and _not_pulled(s) for s in states)),
}


async def _kill_worker(cluster: AsyncCluster, role: str, rank: int) -> str:
    """SIGKILL one worker process of an instance: its actor stays up, its health check must notice."""
    entry = _healthy(cluster, role)
    pids = await entry.handle.worker_pids.remote()
    os.kill(pids[rank], signal.SIGKILL)
    return entry.name


async def _rerun_scenario(prompts, expected, role: str, stage, kill, **options) -> None:
    """Requests in flight when ``kill`` takes down an instance of ``role``, as soon as the requests
    are at ``stage`` (a predicate over the orchestrator's request states), all end equal to their
    greedy output; the instance is replaced, nothing stays in use and the replacement serves."""
    cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=400, **options, dtype="float32")
    try:
        tasks = [asyncio.create_task(_collect(cluster, p, {}, i)) for i, p in enumerate(prompts)]
        states = lambda: list(cluster.orchestrator.requests.values())  # noqa: E731
        await _wait_until(lambda: stage(states()))  # times out if the stage is never reached
        killed = await kill(cluster)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert results == expected
        # Requests that no longer needed the dead instance may all be done before its replacement is up.
        names = lambda: [s.name for s in cluster.orchestrator.instances]  # noqa: E731
        await _wait_until(lambda: any(name.endswith(f"{role}-r1") for name in names()), timeout=60)
        assert killed not in names()
        await wait_nothing_in_use_async(cluster)
        again = await _collect(cluster, prompts[0], {}, 0)
        assert again == expected[0]
        await wait_nothing_in_use_async(cluster)
    finally:
        await cluster.shutdown()


# decode-during-decode is a slow scenario: decode-during-migration re-runs decoding requests too.
@pytest.mark.parametrize(
    "stage", [pytest.param(s, marks=pytest.mark.slow) if s == "decode-during-decode" else s for s in STAGES]
)
def test_killed_instance_requests_rerun_to_the_same_output(ray_cluster, llama, stage):
    role, reached = STAGES[stage]
    prompts = random_prompts([40, 300, 120, 500, 80, 250, 16, 400], 1024, seed=len(stage))
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]

    async def kill(cluster):  # no await before the kill: the stage seen is the stage killed in
        return _kill(cluster, role, ray_cluster)

    options = {"max_num_batched_tokens": 512} if role == "prefill" else {}
    asyncio.run(_rerun_scenario(prompts, expected, role, reached, kill, **options))


# The decode case is a slow scenario: the prefill case runs the same fail-over path.
@pytest.mark.parametrize("role", ["prefill", pytest.param("decode", marks=pytest.mark.slow)])
def test_killed_worker_of_a_tensor_parallel_instance_fails_it_over(ray_cluster, llama, role):
    """One of the two workers of a TP=2 instance dies while requests decode: the instance fails as a
    whole (the other rank may be waiting for it in a collective), is replaced, and every request
    re-runs to its greedy output."""
    prompts = random_prompts([40, 300, 120, 250], 1024, seed=21)
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]

    async def kill(cluster):
        return await _kill_worker(cluster, role, rank=1)

    options = {role: {"tensor_parallel_size": 2}, {"prefill": "decode", "decode": "prefill"}[role]: {}}
    decoding = lambda states: sum(map(_decoding, states)) >= 2  # noqa: E731
    asyncio.run(_rerun_scenario(prompts, expected, role, decoding, kill, **options))


def test_idle_instance_with_a_dead_worker_is_noticed_and_replaced(ray_cluster, llama):
    """With no traffic, the instance's periodic health check finds a dead worker within seconds."""
    prompt = random_prompts([64], 1024, seed=4)[0]

    async def scenario():
        cluster = await AsyncCluster.start(
            model="tiny-llama",
            block_size=8,
            num_kv_blocks=200,
            prefill={},
            decode={"tensor_parallel_size": 2},
            dtype="float32",
        )
        try:
            entry = _healthy(cluster, "decode")
            await _kill_worker(cluster, "decode", rank=0)
            started = time.monotonic()
            await _wait_until(lambda: entry.failure is not None, timeout=10)
            noticed = time.monotonic() - started
            await _wait_until(lambda: entry not in cluster.orchestrator.instances, timeout=60)
            print(f"dead worker noticed in {noticed:.2f} s, replaced in {time.monotonic() - started:.2f} s")
            assert noticed < 3.0  # one idle health check (1 s) and the ping's answer
            assert await _collect(cluster, prompt, {}, 0) == reference_greedy(llama, prompt, MAX_TOKENS)
            await wait_nothing_in_use_async(cluster)
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
            replace_failed_instances=False, dtype="float32",
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
            assert not in_use([prefill])
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_replacement_that_cannot_start_fails_requests_with_a_reason(ray_cluster, tmp_path):
    """The model directory is gone when the decode instance dies: each try to start a replacement
    fails, so the requests waiting for one end with InstanceFailure (UNAVAILABLE) well before the
    replacement wait runs out, the dead instance stays in status saying why, and no block is held."""
    from distserve.cluster.failover import REPLACEMENT_ATTEMPTS
    from distserve.cluster.instance_pool import REPLACEMENT_WAIT_S
    from distserve.model_executor.tiny_models import ensure_tiny_model

    model_dir = tmp_path / "llama"
    shutil.copytree(ensure_tiny_model("tiny-llama"), model_dir)
    prompts = random_prompts([50, 60, 70], 1024, seed=8)

    async def scenario():
        cluster = await AsyncCluster.start(model=str(model_dir), block_size=8, num_kv_blocks=200, dtype="float32")
        try:
            progress: dict[int, int] = {}
            tasks = [asyncio.create_task(_collect(cluster, p, progress, i)) for i, p in enumerate(prompts)]
            await _wait_until(lambda: len(progress) == len(prompts) and min(progress.values()) >= 3)
            shutil.rmtree(model_dir)
            killed, started = _kill(cluster, "decode", ray_cluster), time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, InstanceFailure) for r in results), results
            print(f"requests failed {time.monotonic() - started:.1f} s after the kill")
            assert time.monotonic() - started < REPLACEMENT_WAIT_S / 2
            with pytest.raises(InstanceFailure, match="no decode instance"):
                await _collect(cluster, prompts[0], {}, 0)
            infos = {i.name: i for i in await cluster.info()}
            assert f"not replaced after {REPLACEMENT_ATTEMPTS} tries" in infos[killed].failure
            prefill = next(i for i in infos.values() if i.role == "prefill")
            assert not in_use([prefill])
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_a_stopped_instance_is_fenced_and_its_requests_finish_elsewhere(ray_cluster, llama):
    """SIGSTOP of the decode instance's process while requests decode, then of the prefill's while
    prompts are queued: each is fenced once it leaves its poll unanswered past ``liveness_timeout``
    (its process killed), every request ends equal to its greedy output, replacements serve, and
    the stopped process is gone, so no SIGCONT can resume it: nothing it held can reach a client or
    stay in use."""
    prompts = random_prompts([40, 300, 120, 250, 80, 16, 200, 60], 1024, seed=29)
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]
    liveness = 3.0

    async def scenario():
        cluster = await AsyncCluster.start(
            model="tiny-llama",
            block_size=8,
            num_kv_blocks=400,
            liveness_timeout=liveness,
            max_request_attempts=3,
            dtype="float32",
        )
        names = lambda: [s.name for s in cluster.orchestrator.instances]  # noqa: E731
        stages = {"decode": lambda progress: sum(n >= 3 for n in progress.values()) >= 2,
                  "prefill": lambda progress: len(progress) < 4}  # fmt: skip
        try:
            for kill, (role, batch) in enumerate((("decode", range(0, 4)), ("prefill", range(4, 8))), start=1):
                progress: dict[int, int] = {}
                tasks = [asyncio.create_task(_collect(cluster, prompts[i], progress, i)) for i in batch]
                await _wait_until(lambda: stages[role](progress))  # noqa: B023
                stopped = _healthy(cluster, role)
                _, pid = stopped.info.processes[0]
                os.kill(pid, signal.SIGSTOP)
                started = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                print(f"{role} stopped: its requests ended {time.monotonic() - started:.1f} s later")
                assert results == [expected[i] for i in batch]
                assert "liveness_timeout" in stopped.failure
                await _wait_until(lambda: any(n.endswith(f"{role}-r{kill}") for n in names()), timeout=60)  # noqa: B023
                await _wait_until(lambda: _process_gone(pid), timeout=10)  # noqa: B023
            await wait_nothing_in_use_async(cluster)
            assert await _collect(cluster, prompts[0], {}, 0) == expected[0]
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_a_stopped_worker_rank_is_fenced_though_its_instance_still_answers(ray_cluster, llama):
    """SIGSTOP of one rank's worker of a tensor-parallel decode instance while requests decode: its
    actor still answers every poll, but its step waits on the stopped rank; once the step has run
    ``liveness_timeout`` past what its tokens take, the instance is fenced (every process of it
    killed, the stopped one too), its requests end greedy-equal elsewhere and it is replaced."""
    prompts = random_prompts([40, 120, 80, 60], 1024, seed=37)
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=400, liveness_timeout=3.0,
                                           decode={"tensor_parallel_size": 2}, dtype="float32")  # fmt: skip
        try:
            progress: dict[int, int] = {}
            tasks = [asyncio.create_task(_collect(cluster, p, progress, i)) for i, p in enumerate(prompts)]
            await _wait_until(lambda: sum(n >= 3 for n in progress.values()) >= 2)
            stopped = _healthy(cluster, "decode")
            assert len(stopped.info.processes) > 1, "the instance's ranks run in processes of their own"
            _, pid = stopped.info.processes[-1]
            os.kill(pid, signal.SIGSTOP)
            assert await asyncio.wait_for(asyncio.gather(*tasks), 120) == expected
            assert "step loop is stuck" in stopped.failure and "fenced" in stopped.failure
            await _wait_until(lambda: any(s.name.endswith("decode-r1") for s in cluster.orchestrator.instances), 60)
            await _wait_until(lambda: _process_gone(pid), timeout=10)
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


# A cluster whose orchestrator's loop is held while its requests decode, in a process of its own on
# the session's Ray, so that the test can stop that process: it prints "holding" before each hold
# (its first a sleep on the loop; the test stops the process for its second), waits until no block
# is in use, and prints a JSON line.
_HELD_LOOP_SCRIPT = """
import asyncio, json, sys, time
from distserve import AsyncCluster, SamplingParams

prompts, max_tokens, hold = json.loads(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

async def collect(cluster, prompt, progress, key):
    tokens = []
    async for output in cluster.generate(prompt, params):
        tokens += output.new_token_ids
        progress[key] = len(tokens)
    return tokens

async def main():
    cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=400, liveness_timeout=2.0,
                                       dtype="float32")
    instances = lambda: [[s.name, s.failure] for s in cluster.orchestrator.instances]
    started, waves = instances(), []
    try:
        for wave in ("sleep", "stop"):
            progress = {}
            tasks = [asyncio.create_task(collect(cluster, p, progress, i)) for i, p in enumerate(prompts)]
            while sum(n >= 3 for n in progress.values()) < 2:
                await asyncio.sleep(0.005)
            print("holding", flush=True)
            if wave == "sleep":
                time.sleep(hold)
            waves.append(await asyncio.wait_for(asyncio.gather(*tasks), 120))
        deadline = time.monotonic() + 10
        while (in_use := [i.num_blocks - i.num_free_blocks for i in await cluster.info()]) != [0, 0]:
            assert time.monotonic() < deadline, in_use
            await asyncio.sleep(0.02)
        print(json.dumps({"waves": waves, "started": started, "now": instances(),
                          "largest_lag": cluster.orchestrator.loop_lag.largest}), flush=True)
    finally:
        await cluster.shutdown()

asyncio.run(main())
"""


def test_a_held_serving_loop_fences_no_instance(ray_cluster, llama):
    """The orchestrator's loop held 3.5 s while requests decode, past the 3 s an instance has to
    answer its poll (the poll's own second and ``liveness_timeout`` 2 s): by a sleep on it, then by
    SIGSTOP of its whole process (the instances' answers are then read only after the loop has run
    again, past their deadlines). No instance is fenced or replaced, every stream ends equal to its
    greedy output and no block is in use afterwards: the deadline counts only the time the loop ran."""
    prompts = random_prompts([40, 120, 80, 60], 1024, seed=41)
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]
    hold = 3.5
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    args = [sys.executable, "-c", _HELD_LOOP_SCRIPT, json.dumps(prompts), str(MAX_TOKENS), str(hold)]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env) as script:
        try:
            for wave in ("sleep", "stop"):
                assert script.stdout.readline() == "holding\n", f"the script ended before its {wave} wave"
                if wave == "stop":
                    script.send_signal(signal.SIGSTOP)
                    time.sleep(hold)
                    script.send_signal(signal.SIGCONT)
            result = json.loads(script.stdout.readline())
        finally:
            script.send_signal(signal.SIGCONT)  # never left stopped, whatever failed
            script.wait(timeout=60)
    assert result["waves"] == [expected, expected]
    assert result["now"] == result["started"]  # no instance fenced or replaced: the same, none failed
    assert result["largest_lag"] > hold - 0.5


def test_sampled_requests_rerun_to_the_same_tokens(ray_cluster):
    """A request sampled at temperature > 0 without a seed gets one at admission, so a re-run after
    its decode instance dies continues the very stream the client was reading."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    prompt = random_prompts([64], 1024, seed=3)[0]

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=200, dtype="float32")
        try:
            seen: list[int] = []
            async for output in cluster.generate(prompt, params):
                seen += output.new_token_ids
                assert seen == output.output_token_ids
                if len(seen) == 10:
                    _kill(cluster, "decode", ray_cluster)
            assert len(seen) == MAX_TOKENS
            orchestrator = cluster.orchestrator
            assert not orchestrator.requests
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_overload_completes_every_request_and_leaks_nothing(ray_cluster, llama):
    """120 requests at once against KV pools sized for about a tenth of them: all complete, each equal
    to its greedy output, and every block is free afterwards."""
    prompts = random_prompts([16 + (i * 7) % 48 for i in range(120)], 1024, seed=11)
    max_tokens = 16
    expected = [reference_greedy(llama, p, max_tokens) for p in prompts]
    # A request needs 7 blocks on average (ceil((40 + 16) / 8)), 10 at most: 84 blocks hold about 12.
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def final(cluster, prompt):
        async for output in cluster.generate(prompt, params):
            last = output
        return last.output_token_ids

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=84, dtype="float32")
        try:
            results = await asyncio.wait_for(asyncio.gather(*(final(cluster, p) for p in prompts)), 600)
            assert results == expected
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


def test_kv_held_past_its_deadline_is_freed_and_a_late_pull_refused(ray_cluster):
    """A prefill instance whose prefilled request no decode instance pulls frees its blocks at
    ``kv_hold_timeout`` and reports the request failed; a pull that comes later is refused, so
    decode never uses KV from blocks that may have been reused."""
    from distserve import EngineConfig
    from distserve.cluster.instance import launch_instance

    config = EngineConfig.from_flat(
        model="tiny-llama", role="prefill", block_size=8, num_kv_blocks=32, kv_hold_timeout=0.5, dtype="float32"
    )
    prefill = launch_instance(config, "hold-deadline-prefill")
    try:
        ray = ray_cluster
        ray.get(prefill.add_request.remote(list(range(3, 43)), SamplingParams(max_tokens=8), "held"))
        outputs, started = [], time.monotonic()
        while not any(o.finished for o in outputs):
            assert time.monotonic() - started < 10
            outputs += ray.get(prefill.get_outputs.remote(0.5))
        assert outputs[0].handover is not None  # the first token, with the hand-over
        assert [o.finish_reason for o in outputs if o.finished] == ["error"]
        assert 0.5 <= time.monotonic() - started < 3.0
        info = ray.get(prefill.info.remote())
        assert not in_use([info])
        assert ray.get(prefill.release_kv.remote("held", 0)) is False
    finally:
        ray_cluster.kill(prefill)


def test_cancellation_at_every_stage_frees_blocks_within_a_second(ray_cluster):
    """Clients leaving at every stage (queued for prefill, prefilling, holding KV for decode,
    migrating, decoding): one second after the last leaves, no block is in use on either side."""
    prompts = random_prompts([300, 500, 120, 450, 60, 380, 250, 480] * 3, 1024, seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def stage(cluster, request_id: str) -> str:
        [metrics] = [s.metrics for s in cluster.orchestrator.requests.values() if s.client_id == request_id]
        if metrics.prefill_end is None:
            return "queued or prefilling"
        return "KV held or migrating" if metrics.migration_end is None else "decoding"

    async def leave_after(cluster, i: int, prompt, chunks: int) -> str:
        """The client leaves after ``chunks`` outputs; the stage its request was at then."""
        request_id = f"leaves-{i}"
        stream = cluster.generate(prompt, params, request_id=request_id)
        if chunks == 0:  # gone before any token
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            left_at = stage(cluster, request_id)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
            return left_at
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == chunks:  # 1: KV held or migrating; 2: just handed over; 10: decoding
                left_at = stage(cluster, request_id)
                await stream.aclose()
                return left_at
        return "finished"  # its outputs came batched into fewer chunks than it waited for

    async def scenario():
        cluster = await AsyncCluster.start(model="tiny-llama", block_size=8, num_kv_blocks=600, dtype="float32")
        try:
            chunks = [0, 1, 2, 10]
            left_at = await asyncio.gather(*(leave_after(cluster, i, p, chunks[i % 4]) for i, p in enumerate(prompts)))
            await wait_nothing_in_use_async(cluster, timeout=1.0)  # within a second of the last one leaving
            stages = set(left_at) - {"finished"}
            assert stages == {"queued or prefilling", "KV held or migrating", "decoding"}, left_at
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow  # a second replacement runs the first's path again: a slow scenario
def test_a_replacement_killed_in_turn_is_replaced_again(ray_cluster, llama):
    """The decode instance is killed while requests decode, then its replacement is killed as well
    under new requests: each kill re-runs what was in flight to its greedy output, a second
    replacement comes up, and afterwards no block is in use (the fast path of the slow
    ``test_repeated_kills_under_a_steady_load``)."""
    prompts = random_prompts([40, 300, 120, 250, 80, 16, 200, 60], 1024, seed=19)
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]

    async def scenario():
        cluster = await AsyncCluster.start(
            model="tiny-llama", block_size=8, num_kv_blocks=400, max_request_attempts=3, dtype="float32"
        )
        names = lambda: [s.name for s in cluster.orchestrator.instances]  # noqa: E731
        try:
            for kill, batch in enumerate((range(0, 4), range(4, 8)), start=1):
                progress: dict[int, int] = {}
                tasks = [asyncio.create_task(_collect(cluster, prompts[i], progress, i)) for i in batch]
                await _wait_until(lambda: sum(n >= 3 for n in progress.values()) >= 2)  # noqa: B023
                killed = _kill(cluster, "decode", ray_cluster)
                assert await asyncio.wait_for(asyncio.gather(*tasks), 120) == [expected[i] for i in batch]
                await _wait_until(lambda: any(n.endswith(f"decode-r{kill}") for n in names()), timeout=60)  # noqa: B023
                assert killed not in names()
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow
def test_repeated_kills_under_a_steady_load(ray_cluster, llama):
    """Requests keep arriving while the prefill and the decode instance are each killed twice, one
    after the other (each kill once the previous replacement is up): every request ends equal to its
    greedy output, and afterwards no block is in use."""
    prompts = random_prompts([16 + (i * 37) % 400 for i in range(60)], 1024, seed=13)
    expected = [reference_greedy(llama, p, MAX_TOKENS) for p in prompts]

    async def scenario():
        cluster = await AsyncCluster.start(
            model="tiny-llama", block_size=8, num_kv_blocks=400, max_request_attempts=5, dtype="float32"
        )
        try:
            progress: dict[int, int] = {}

            async def arrive(i, prompt):
                await asyncio.sleep(0.5 * i)
                return await _collect(cluster, prompt, progress, i)

            tasks = [asyncio.create_task(arrive(i, p)) for i, p in enumerate(prompts)]
            names = lambda: [s.name for s in cluster.orchestrator.instances]  # noqa: E731
            for kill, role in enumerate(["prefill", "decode", "prefill", "decode"], start=1):
                await asyncio.sleep(2.0)
                _kill(cluster, role, ray_cluster)
                replacement = f"-r{kill}"
                await _wait_until(lambda: any(n.endswith(replacement) for n in names()), timeout=60)  # noqa: B023
            assert await asyncio.wait_for(asyncio.gather(*tasks), 300) == expected
            await wait_nothing_in_use_async(cluster)
        finally:
            await cluster.shutdown()

    asyncio.run(scenario())


# Distinct prompts, output tokens, KV blocks, streams a wave, requests admitted at once, and the MiB
# the process may grow from the second wave to the third. At full scale it is a slow scenario.
QUEUE_SCALES = {"quarter": (20, 4, 40, 400, 60, 32), "full": (50, 8, 200, 1500, 300, 64)}


@pytest.mark.parametrize("scale", ["quarter", pytest.param("full", marks=pytest.mark.slow)])
def test_above_capacity_the_queue_refuses_at_once_and_memory_stays_bounded(ray_cluster, llama, scale):
    """Waves of concurrent gRPC streams (400; full: 1500) against a server admitting a few (60;
    300) with KV for a tenth of those: the rest get RESOURCE_EXHAUSTED at once, every admitted
    stream equals its greedy output, nothing is left in use, and the process does not grow from
    one wave to the next."""
    import grpc
    import psutil

    from distserve.cluster.api import make_cluster_config
    from distserve.entrypoints.client import AsyncClient
    from distserve.entrypoints.server import BackgroundServer
    from distserve.entrypoints.server_config import ServerConfig

    num_prompts, max_tokens, num_blocks, streams, admitting, growth_mib = QUEUE_SCALES[scale]
    prompts = random_prompts([16 + (i * 7) % 48 for i in range(num_prompts)], 1024, seed=17)
    expected = [reference_greedy(llama, p, max_tokens) for p in prompts]
    config = make_cluster_config(
        model="tiny-llama", block_size=8, num_kv_blocks=num_blocks, prefill={}, decode={}, dtype="float32"
    )

    async def wave(address) -> tuple[int, int]:
        async def one(i):
            try:
                completion = await client.complete(prompts[i % num_prompts], max_tokens=max_tokens, temperature=0)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                return False
            assert completion.token_ids == expected[i % num_prompts]
            return True

        async with AsyncClient(address) as client:
            admitted = await asyncio.gather(*(one(i) for i in range(streams)))
        return sum(admitted), len(admitted) - sum(admitted)

    process = psutil.Process()
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0, max_pending_requests=admitting)) as server:
        rss = []
        for _ in range(3):
            admitted, refused = asyncio.run(wave(server.grpc_address))
            print(f"admitted {admitted}, refused {refused}, rss {process.memory_info().rss / 2**20:.0f} MiB")
            assert admitted >= admitting and refused > 0
            assert not in_use(server.info()) and server.frontend.num_pending == 0
            rss.append(process.memory_info().rss)
        assert rss[2] - rss[1] < growth_mib * 2**20, [r / 2**20 for r in rss]
