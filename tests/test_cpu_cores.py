import asyncio
import os

import pytest

from distserve import AsyncCluster, SamplingParams
from distserve.cluster.config import ClusterConfig
from distserve.cluster.core_plan import plan_cores
from distserve.core.config import EngineConfig
from distserve.core.cpu_cores import format_cores, parse_cores


def cluster(pools: dict, **engine) -> ClusterConfig:
    return ClusterConfig.from_pools(EngineConfig.from_flat(**engine), pools)


def cores_of(config: ClusterConfig) -> dict[str, tuple[str, int | None]]:
    """(cpu_cores, cpu_threads) of each instance, by its role and index."""
    return {
        name.split("-", 2)[-1]: (engine.parallel.cpu_cores, engine.parallel.cpu_threads)
        for name, engine in config.instance_configs()
    }


def test_core_lists_read_and_written():
    assert parse_cores("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cores(" 5 ") == [5]
    assert format_cores([8, 0, 1, 2, 3]) == "0-3,8"
    assert format_cores([1, 3]) == "1,3"
    for bad, says in [("a", "not a core number"), ("3-1", "not a range"), ("0-2,1", "twice"), ("-1", "not a")]:
        with pytest.raises(ValueError, match=says):
            parse_cores(bad)


def test_auto_gives_every_worker_cores_of_its_own_and_the_rest_to_the_servers():
    # Two cores, one colocated instance: both cores, the servers share them.
    plan = plan_cores(cluster({"colocated": {"instances": 1}}), [0, 1])
    assert cores_of(plan.config) == {"colocated-0": ("0-1", None)} and plan.serving is None
    # One thread asked for: the highest core, the other one kept for the serving processes.
    plan = plan_cores(cluster({"colocated": {"instances": 1}}, cpu_threads=1), [0, 1])
    assert cores_of(plan.config) == {"colocated-0": ("1", 1)} and plan.serving == [0]
    # 1 prefill + 1 decode: a core each.
    plan = plan_cores(cluster({}), [0, 1])
    assert cores_of(plan.config) == {"prefill-0": ("0", None), "decode-0": ("1", None)}
    # Eight cores, two prefill instances sharing what the 2-thread decode instance leaves.
    plan = plan_cores(cluster({"prefill": {"instances": 2}, "decode": {"cpu_threads": 2}}), list(range(8)))
    assert cores_of(plan.config) == {"prefill-0": ("0-2", None), "prefill-1": ("3-5", None), "decode-0": ("6-7", 2)}
    assert plan.serving is None
    # A tensor-parallel instance's list is split among its two workers.
    plan = plan_cores(cluster({"colocated": {"instances": 1}}, tensor_parallel_size=2, cpu_threads=1), [0, 1, 2, 3])
    engine = plan.config.instance_configs()[0][1]
    assert engine.parallel.rank_cores(0) == [2] and engine.parallel.rank_cores(1) == [3] and plan.serving == [0, 1]


def test_auto_binds_nothing_when_the_workers_outnumber_the_cores_or_run_on_a_gpu():
    plan = plan_cores(cluster({"prefill": {"instances": 2}, "decode": {}}), [0, 1])
    assert set(cores_of(plan.config).values()) == {("none", None)} and plan.oversubscribed
    assert "outnumber the cores" in "\n".join(plan.describe())
    plan = plan_cores(cluster({}), [0, 1], cpu=False)
    assert set(cores_of(plan.config).values()) == {("none", None)} and not plan.oversubscribed


def test_a_pools_own_list_is_kept_split_among_its_instances_and_not_given_to_another_pool():
    config = cluster({"prefill": {"instances": 2, "cpu_cores": "4-7"}, "decode": {}})
    plan = plan_cores(config, list(range(8)))
    assert cores_of(plan.config) == {"prefill-0": ("4-5", None), "prefill-1": ("6-7", None), "decode-0": ("0-3", None)}
    with pytest.raises(ValueError, match="the prefill pool: cpu_cores '4' has fewer cores than the pool's 2"):
        cluster({"prefill": {"instances": 2, "cpu_cores": "4"}, "decode": {}})
    with pytest.raises(ValueError, match="fewer cores than the 2 workers"):
        EngineConfig.from_flat(cpu_cores="3", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="'x' in cpu cores"):
        EngineConfig.from_flat(cpu_cores="x")


def _thread_affinities(pid: int) -> set[frozenset[int]]:
    """The core sets of every thread of process ``pid``."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(frozenset(os.sched_getaffinity(int(task))))
        except ProcessLookupError:
            pass
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_cluster_binds_every_thread_of_each_instance_to_its_own_cores(ray_cluster):
    """1 prefill + 1 decode under ``auto``: each instance's process, all its threads (the OpenMP
    pool that ran the steps included), on cores of its own, and requests still served."""
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2

    async def scenario() -> dict[str, set[frozenset[int]]]:
        async with AsyncCluster(model="tiny-llama", num_kv_blocks=64) as c:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

            async def tokens(prompt: list[int]) -> int:
                return sum([len(out.new_token_ids) async for out in c.generate(prompt, params)])

            assert await asyncio.gather(*(tokens([5 + i, 6, 7]) for i in range(3))) == [8, 8, 8]
            found = {}
            for state in c.orchestrator.instances:
                (pid,) = await state.handle.worker_pids.remote()
                found[str(state.role)] = _thread_affinities(pid)
            return found

    found = asyncio.run(scenario())
    assert found == {"prefill": {frozenset(cores[:half])}, "decode": {frozenset(cores[half : 2 * half])}}


def test_binding_to_cores_the_machine_lacks_is_refused_with_a_sentence():
    from distserve.core.cpu_cores import bind_process

    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"cannot bind to cpu cores 4096-4097 .*: the machine has \d+ cores"):
        bind_process([4096, 4097])
    assert os.sched_getaffinity(0) == before


def test_an_engine_alone_stays_unbound_under_auto():
    """An engine alone (``LLM``) leaves its process where it was under ``auto``."""
    from distserve import LLM

    before = os.sched_getaffinity(0)
    LLM(model="tiny-llama", num_kv_blocks=16)
    assert os.sched_getaffinity(0) == before
