"""Instances change role while serving: every direction under load, with requests held for decode,
arriving at decode or decoding at the time of the change; outputs stay greedy-equal to
transformers and nothing stays in use. Then the refusals, the gRPC call and CLI, and the
controller's decisions."""

import asyncio
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from conftest import in_use, random_prompts, reference_greedy, wait_nothing_in_use, wait_nothing_in_use_async

from distserve import AsyncCluster, SamplingParams
from distserve.cluster.api import make_cluster_config
from distserve.cluster.config import ClusterConfig
from distserve.cluster.layout_forecast import ChunkedPrefill
from distserve.cluster.role_control.attainment import Attainment, Share, attainment, miss_margin
from distserve.cluster.role_control.config import RoleControlConfig
from distserve.cluster.role_control.controller import RoleController
from distserve.cluster.role_control.load import Load
from distserve.cluster.role_control.policy import propose
from distserve.cluster.role_control.request_records import Arrival, FinishedRequest, InFlight
from distserve.cluster.routing import spread_prompts
from distserve.core.errors import RequestError
from distserve.core.role import Role
from distserve.core.slo import RequestSLO
from distserve.entrypoints.client import CallError, Client
from distserve.entrypoints.prometheus import ServingMetrics
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig
from distserve.scheduling.step_time import StepCost

P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED
# From 1 prefill + 1 decode through every direction a role can change in: P->C and D->C, C->P and
# C->D, P->D and D->P (a swap), D->C with P->D, then C->P.
LAYOUTS = [(C, C), (P, D), (D, P), (C, D), (P, D)]


@pytest.fixture(scope="module")
def llama(reference_model):
    return reference_model("tiny-llama")


async def _final(cluster: AsyncCluster, prompt: list[int], max_tokens: int, slo: RequestSLO | None = None) -> list[int]:
    async for output in cluster.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), slo=slo):
        last = output
    assert last.finished and last.finish_reason == "length"
    return last.output_token_ids


async def _until(cluster: AsyncCluster, condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition(await cluster.info()):
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


def check_roles_change_under_load(llama, **engine_options) -> None:
    """From 1 prefill + 1 decode through every direction (``LAYOUTS``), each change made while
    requests are queued, held for decode, arriving there and decoding: outputs greedy-equal to
    ``llama`` (on the instances' device) and nothing in use afterwards."""
    waves = [random_prompts([40, 9, 120, 64, 17, 88], llama.config.vocab_size, seed=s) for s in range(len(LAYOUTS))]
    max_tokens = [30, 48, 24, 40, 36, 28]

    async def main() -> tuple[list[list[list[int]]], list]:
        # Decode admits 2 requests at a time, so hand-overs wait there and prefill holds their KV.
        options = dict(
            model="tiny-llama",
            enable_chunked_prefill=True,
            max_num_batched_tokens=48,
            **engine_options,
            dtype="float32",
        )
        async with AsyncCluster(prefill={}, decode={"max_num_seqs": 2}, **options) as cluster:
            names = [i.name for i in await cluster.info()]
            tasks, busy = [], []
            for wave, layout in zip(waves, LAYOUTS):
                tasks += [asyncio.create_task(_final(cluster, p, n)) for p, n in zip(wave, max_tokens)]
                # Change while requests are queued, held or arriving at decode, and decoding.
                await _until(cluster, lambda infos: sum(i.num_running for i in infos) >= 1)
                busy.append(sum(i.num_held + i.num_pending for i in await cluster.info()))
                records = await cluster.set_roles(dict(zip(names, layout)))
                assert all(r.error is None for r in records)
                assert [i.role for i in await cluster.info()] == list(layout)
            outputs = await asyncio.gather(*tasks)
            await wait_nothing_in_use_async(cluster)
            assert any(busy), "no change found a request held for decode or arriving there"
            return outputs, cluster.role_changes

    outputs, history = asyncio.run(main())
    prompts = [p for wave in waves for p in wave]
    for prompt, n, tokens in zip(prompts, max_tokens * len(LAYOUTS), outputs):
        assert tokens == reference_greedy(llama, prompt, n), f"prompt of {len(prompt)} tokens"
    directions = {(r.old_role, r.new_role) for r in history}
    assert directions == {(P, C), (D, C), (C, P), (C, D), (P, D), (D, P)}
    assert all(r.seconds < 10 and r.reason == "operator" for r in history)


def test_roles_change_under_load_in_every_direction(ray_cluster, llama):
    check_roles_change_under_load(llama)


def test_a_change_that_adds_an_instance_taking_prompts_spreads_the_queue_over_it(ray_cluster, llama):
    """1 prefill + 1 decode with prompts queued at prefill becomes 2 colocated: some of the queued
    prompts move to the former decode instance and are prefilled there. Outputs stay greedy-equal
    and nothing stays in use."""
    prompts = random_prompts([200] * 8, llama.config.vocab_size, seed=21)

    async def run(cluster: AsyncCluster, prompt: list[int]):
        async for output in cluster.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)):
            last = output
        return last

    async def main() -> tuple[list[str], list[int], list]:
        # One prompt at a time in chunks of 16 tokens: the others queue at prefill.
        options = dict(model="tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=16, dtype="float32")
        async with AsyncCluster(prefill={"max_num_seqs": 1}, decode={}, **options) as cluster:
            names = [i.name for i in await cluster.info()]
            tasks = [asyncio.create_task(run(cluster, p)) for p in prompts]
            await _until(cluster, lambda infos: infos[0].num_waiting >= 4)
            queued = (await cluster.info())[0].num_waiting
            await cluster.set_roles({name: C for name in names})
            outputs = await asyncio.gather(*tasks)
            await wait_nothing_in_use_async(cluster)
            return names, queued, outputs

    names, queued, outputs = asyncio.run(main())
    prefilled = [o.metrics.prefill_instance for o in outputs]
    assert prefilled.count(names[1]) >= 1, f"{queued} queued at the change, all prefilled where they were"
    for prompt, output in zip(prompts, outputs):
        assert output.output_token_ids == reference_greedy(llama, prompt, 8)


def test_queued_prompts_are_spread_newest_first_until_the_queues_hold_about_as_many_tokens():
    queues = {"p": [("a", 100), ("b", 100), ("c", 100), ("d", 100), ("e", 50)], "new": [], "x": [("f", 100)]}
    assert spread_prompts(queues) == [("e", "p", "new"), ("d", "p", "new"), ("c", "p", "x")]
    assert len(queues["p"]) == 5  # the caller's queues are left as they were
    assert spread_prompts({"p": [("a", 100)], "new": []}) == []  # a lone prompt is served where it is
    assert spread_prompts({"p": [("a", 100), ("b", 100)], "new": [("c", 100)]}) == []
    assert spread_prompts({}) == []


def test_the_adaptive_controller_colocates_a_cluster_whose_prefill_misses_ttft(ray_cluster, llama):
    # No TTFT can be met and every TPOT is: too little prefill. Roles fixed, nothing changes; handed
    # to the controller, it colocates the 1 prefill + 1 decode instances while requests keep coming
    # and come out greedy-equal; taken back with roles set by hand, they stay as set.
    control = {"mode": "fixed", "slo_ttft": 1e-6, "slo_tpot": 10.0, "interval": 0.1, "window": 1.0,
               "min_requests": 4, "patience": 2, "min_dwell": 0.0}  # fmt: skip
    prompts = random_prompts([30, 12, 50, 21] * 6, llama.config.vocab_size, seed=7)

    async def waves(cluster: AsyncCluster, until_a_change: bool) -> list[list[int]]:
        outputs = []
        for wave in range(0, len(prompts), 4):
            outputs += await asyncio.gather(*(_final(cluster, p, 6) for p in prompts[wave : wave + 4]))
            if until_a_change and cluster.role_changes:
                break
            await asyncio.sleep(0.3)  # decisions come every 0.1 s
        return outputs

    async def main() -> tuple[list[list[int]], list]:
        async with AsyncCluster(
            model="tiny-llama", prefill={}, decode={}, role_control=control, dtype="float32"
        ) as cluster:
            names = [i.name for i in await cluster.info()]
            outputs = await waves(cluster, until_a_change=False)
            assert cluster.role_changes == [] and [i.role for i in await cluster.info()] == [P, D]
            assert await cluster.set_roles({}, role_control="adaptive") == []
            outputs += await waves(cluster, until_a_change=True)
            assert [i.role for i in await cluster.info()] == [C, C]
            outputs += await asyncio.gather(*(_final(cluster, p, 6) for p in prompts[:4]))  # served colocated
            changes = await cluster.set_roles(dict(zip(names, (P, D))), role_control="fixed")
            assert [r.reason for r in changes] == ["operator", "operator"]
            outputs += await waves(cluster, until_a_change=False)
            assert [i.role for i in await cluster.info()] == [P, D] and len(cluster.role_changes) == 4
            await wait_nothing_in_use_async(cluster)
            return outputs, cluster.role_changes[:2]

    outputs, history = asyncio.run(main())
    assert {(r.old_role, r.new_role) for r in history} == {(P, C), (D, C)}
    assert all(r.reason.startswith("TTFT attainment 0%, TPOT 100%") for r in history)
    assert all(r.reason.endswith("too little prefill, colocating") for r in history)
    adaptive = len(outputs) - 4 - 2 * len(prompts)
    sent = prompts + prompts[:adaptive] + prompts[:4] + prompts
    assert len(sent) == len(outputs)
    for prompt, tokens in zip(sent, outputs):
        assert tokens == reference_greedy(llama, prompt, 6)


def test_arrivals_of_a_remembered_load_change_roles_without_waiting_for_a_tick(ray_cluster, llama):
    # Memory says colocated serves these requests and 1 prefill + 1 decode does not. The controller's
    # tick is a minute away: the arrivals themselves bring the change, once three have come.
    control = {"mode": "adaptive", "slo_ttft": 10.0, "slo_tpot": 10.0, "interval": 60.0, "min_requests": 3,
               "min_dwell": 0.0}  # fmt: skip
    prompts = random_prompts([30] * 6, llama.config.vocab_size, seed=11)

    async def main() -> tuple[list[list[int]], list, list[float]]:
        async with AsyncCluster(
            model="tiny-llama", prefill={}, decode={}, role_control=control, dtype="float32"
        ) as cluster:
            controller = cluster.orchestrator.controller
            load, before = Load(tokens_ratio=5.0, rate=4.0), controller.last_change - 1.0  # 30 tokens in, 6 out
            controller.remember({"a": P, "b": D}, load, met=2, num_requests=20, now=before)
            controller.remember({"a": C, "b": C}, load, met=20, num_requests=20, now=before)
            tasks, sent = [], []
            for prompt in prompts:  # 4 a second
                tasks.append(asyncio.create_task(_final(cluster, prompt, 6)))
                sent.append(time.time())
                await asyncio.sleep(0.25)
            outputs = await asyncio.gather(*tasks)
            assert [i.role for i in await cluster.info()] == [C, C]
            await wait_nothing_in_use_async(cluster)
            return outputs, cluster.role_changes, sent

    outputs, history, sent = asyncio.run(main())
    assert {(r.old_role, r.new_role) for r in history} == {(P, C), (D, C)}
    assert all(r.started < sent[2] + 5.0 for r in history)  # on the third arrival, not a minute on
    assert all(
        r.reason == "arriving load like one under which 10% of 20 requests met both SLOs in this layout"
        " and 100% of 20 in colocated+colocated"
        for r in history
    )
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == reference_greedy(llama, prompt, 6)


# Prompts of 64 tokens or more: wherever one lands it runs chunk steps beside decode steps, steps
# of sizes far enough apart for the instance to fit its line.
FORECAST_WARMUP = [240, 200, 150, 230, 210, 170, 250, 190]


def _forecasting_cluster(**control) -> AsyncCluster:
    """Two instances, chunked prefill of 256 tokens a step, and SLOs no colocated step meets: a TPOT
    of 0.1 ms, a decode-only step least badly. A tick is a minute away and a window needs 50
    requests: only memory or the forecast can move roles."""
    control = {"mode": "fixed", "slo_ttft": 100.0, "slo_tpot": 1e-4, "interval": 60.0, "min_requests": 50,
               "min_dwell": 0.0, **control}  # fmt: skip
    return AsyncCluster(model="tiny-llama", prefill={}, decode={}, enable_chunked_prefill=True,
                        max_num_batched_tokens=256, role_control=control, dtype="float32")  # fmt: skip


async def _colocated_with_step_lines(cluster: AsyncCluster, warmup: list[list[int]]) -> tuple[list, list]:
    """Both instances colocated by hand, each with its step-time line from ``warmup`` (their outputs
    and the lines), then roles handed to the controller. The tiny model's steps cost little more per
    token than their fixed cost: only steps of 150-250 prompt tokens against decode steps of a few
    tokens say the slope over a busy machine's noise of several milliseconds a step (chunks of 32
    did not, on CI). Should it still drown (the line is then left unknown), the warmup runs again,
    up to twice more, until both instances know theirs; the outputs are its first run's."""
    await cluster.set_roles({i.name: C for i in await cluster.info()})

    async def serve_and_read_lines() -> tuple[list, list]:
        outputs = await asyncio.gather(*(_final(cluster, p, 8) for p in warmup))
        return outputs, [await s.handle.step_line.remote() for s in cluster.orchestrator.instances]

    outputs, lines = await serve_and_read_lines()
    for _ in range(2):
        if None not in lines:
            break
        again, lines = await serve_and_read_lines()
        assert again == outputs  # served again, from cached prefixes: the same tokens
    assert cluster.role_changes[-1].reason == "operator"
    await cluster.set_roles({}, role_control="adaptive")
    return outputs, lines


def test_a_new_kind_of_request_moves_roles_by_the_forecast_from_the_instances_step_times(ray_cluster, llama):
    # Colocated instances under SLOs no colocated step meets, memory empty: only the forecast, from
    # the step times the instances measured while roles were fixed, can move them, and it does on
    # the third arrival.
    warmup = random_prompts(FORECAST_WARMUP, llama.config.vocab_size, seed=17)
    prompts = random_prompts([30, 50, 20, 40], llama.config.vocab_size, seed=19)

    async def main() -> tuple[list[list[int]], list, list[float], list]:
        async with _forecasting_cluster() as cluster:
            outputs, lines = await _colocated_with_step_lines(cluster, warmup)
            tasks, sent = [], []
            for prompt in prompts:
                tasks.append(asyncio.create_task(_final(cluster, prompt, 8)))
                sent.append(time.time())
                await asyncio.sleep(0.2)
            outputs += await asyncio.gather(*tasks)
            await wait_nothing_in_use_async(cluster)
            return outputs, cluster.role_changes[2:], sent, lines

    outputs, history, sent, lines = asyncio.run(main())
    assert all(fixed >= 0 and per_token > 0 for fixed, per_token in lines)
    assert sorted((r.old_role, r.new_role) for r in history) == [(C, D), (C, P)]
    assert all(sent[2] <= r.started < sent[2] + 5.0 for r in history)  # on the third arrival
    assert all(r.reason.startswith("arriving requests (") and r.reason.endswith("disaggregated") for r in history), (
        history[0].reason
    )
    for prompt, tokens in zip(warmup + prompts, outputs):
        assert tokens == reference_greedy(llama, prompt, 8)


def test_with_one_mix_arrival_the_forecast_moves_roles_on_the_first_request_of_a_new_kind(ray_cluster, llama):
    # Three requests whose own SLOs colocation meets (the forecast keeps the layout), then one of the
    # cluster's SLOs, which it does not: with the mix of one arrival (and an arrival window too short
    # to hold two), that one moves the roles, before a second of its kind comes.
    warmup = random_prompts(FORECAST_WARMUP, llama.config.vocab_size, seed=17)
    loose = random_prompts([30, 50, 20], llama.config.vocab_size, seed=19)
    tight = random_prompts([40], llama.config.vocab_size, seed=23)

    async def main() -> tuple[list[list[int]], list, float]:
        async with _forecasting_cluster(mix_arrivals=1, arrival_window=0.05) as cluster:
            outputs, _ = await _colocated_with_step_lines(cluster, warmup)
            tasks = []
            for prompt in loose:
                tasks.append(asyncio.create_task(_final(cluster, prompt, 8, RequestSLO(100.0, 10.0))))
                await asyncio.sleep(0.2)
            outputs += await asyncio.gather(*tasks)
            assert len(cluster.role_changes) == 2  # the operator's only: the loose kind is served colocated
            sent = time.time()
            outputs.append(await _final(cluster, tight[0], 8))
            await _until(cluster, lambda infos: [i.role for i in infos] in ([P, D], [D, P]), timeout=10.0)
            await wait_nothing_in_use_async(cluster)
            return outputs, cluster.role_changes[2:], sent

    outputs, history, sent = asyncio.run(main())
    assert sorted((r.old_role, r.new_role) for r in history) == [(C, D), (C, P)]
    assert all(sent <= r.started < sent + 5.0 for r in history)
    assert all(r.reason.startswith("arriving requests (40 prompt tokens") for r in history), history[0].reason
    for prompt, tokens in zip(warmup + loose + tight, outputs):
        assert tokens == reference_greedy(llama, prompt, 8)


def test_a_layout_an_operator_leaves_is_remembered_by_what_it_served(ray_cluster, llama):
    # Roles stay with the controller (adaptive), which has nothing to judge by: a window needs 50
    # requests and memory is empty. An operator changes roles twice; each layout left is remembered
    # by the requests it served, so the controller can move back to it when that load returns.
    control = {"mode": "adaptive", "slo_ttft": 10.0, "slo_tpot": 10.0, "interval": 60.0, "min_requests": 50,
               "min_dwell": 0.0}  # fmt: skip
    prompts = random_prompts([30] * 9, llama.config.vocab_size, seed=13)

    async def main() -> tuple[list[list[int]], list]:
        async with AsyncCluster(
            model="tiny-llama", prefill={}, decode={}, role_control=control, dtype="float32"
        ) as cluster:
            controller, names = cluster.orchestrator.controller, [i.name for i in await cluster.info()]
            outputs = await asyncio.gather(*(_final(cluster, p, 6) for p in prompts[:6]))
            await cluster.set_roles({name: C for name in names})
            outputs += await asyncio.gather(*(_final(cluster, p, 6) for p in prompts[6:]))
            await cluster.set_roles(dict(zip(names, (P, D))))
            assert [r.reason for r in cluster.role_changes] == ["operator"] * 4
            await wait_nothing_in_use_async(cluster)
            return outputs, controller.outcomes

    outputs, outcomes = asyncio.run(main())
    assert [(o.layout, o.met, o.num_requests) for o in outcomes] == [((D, P), 6, 6), ((C, C), 3, 3)]
    assert outcomes[0].load.tokens_ratio == pytest.approx(30 / 6)
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == reference_greedy(llama, prompt, 6)


def test_role_changes_that_could_not_serve_are_refused_and_change_nothing(ray_cluster):
    async def main() -> None:
        async with AsyncCluster(model="tiny-llama", prefill={}, decode={}, dtype="float32") as cluster:
            names = [i.name for i in await cluster.info()]
            refusals = [
                ({names[0]: "decode"}, "no instance would take new prompts"),
                ({names[1]: "colocated"}, "prefill instances need a decode instance"),
                ({"nope": "decode"}, "no instance is named 'nope'"),
                ({names[0]: "encoder"}, "role must be one of prefill, decode, colocated"),
            ]
            for roles, message in refusals:
                with pytest.raises(RequestError, match=message):
                    await cluster.set_roles(roles)
            assert [i.role for i in await cluster.info()] == [P, D] and cluster.role_changes == []
            assert await cluster.set_roles({names[0]: "prefill"}) == []  # already its role
            (output,) = [o async for o in cluster.generate([5, 6, 7], SamplingParams(max_tokens=4))][-1:]
            assert output.finished

    asyncio.run(main())


def test_set_roles_over_grpc_and_the_cli(ray_cluster, llama):
    config = make_cluster_config(model="tiny-llama", prefill={}, decode={}, dtype="float32")
    admin = "sk-roles-admin"  # role changes need it (tests/test_tenants.py has the refusals)
    with BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0, admin_key=admin)) as server:
        with Client(server.grpc_address, admin_key=admin) as client:
            names = [i.name for i in client.cluster_info().instances]
            with pytest.raises(CallError) as refusal:
                client.set_roles({names[1]: "prefill"})
            assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prefill instances need a decode instance" in refusal.value.details()
            for roles, control, message in [
                ({}, None, "name an instance or a role control mode"),
                ({}, "adaptive", "adaptive role control needs both SLOs"),
                ({names[0]: "colocated"}, "sometimes", "role_control.mode must be one of fixed, adaptive"),
            ]:
                with pytest.raises(CallError) as refusal:
                    client.set_roles(roles, role_control=control)
                assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert message in refusal.value.details()
            assert client.cluster_info().role_control == "fixed" and not client.cluster_info().role_changes
            cli = [sys.executable, "-m", "distserve.cli", "roles", "--server", server.grpc_address]
            cli += ["--admin-key", admin]
            done = subprocess.run([*cli, f"{names[0]}=colocated", f"{names[1]}=colocated"],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert f"{names[0]}: prefill -> colocated" in done.stdout
            assert f"{names[1]}: decode -> colocated" in done.stdout
            bad = subprocess.run([*cli, f"{names[0]}=encoder"], capture_output=True, text=True, timeout=60)
            assert bad.returncode == 2 and "is not INSTANCE=ROLE" in bad.stderr
            refused = subprocess.run([*cli, "--control", "adaptive"], capture_output=True, text=True, timeout=60)
            assert refused.returncode == 1 and "adaptive role control needs both SLOs" in refused.stderr
            info = client.cluster_info()
            assert [i.role for i in info.instances] == [3, 3] and info.role_control == "fixed"
            assert [c.reason for c in info.role_changes] == ["operator", "operator"]
            prompt = random_prompts([30], llama.config.vocab_size, seed=3)[0]
            completion = client.complete(prompt, max_tokens=12, temperature=0)
            assert completion.token_ids == reference_greedy(llama, prompt, 12)
            listing = subprocess.run(cli, capture_output=True, text=True, timeout=60)
            assert listing.returncode == 0 and "role control: fixed" in listing.stdout
            assert f"{names[0]}: colocated" in listing.stdout
            metrics = urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10).read().decode()
            series = f'distserve_role_changes_total{{instance="{names[0]}",new_role="colocated",old_role="prefill"}}'
            assert f"{series} 1.0" in metrics
            wait_nothing_in_use(lambda: client.cluster_info().instances)
            assert not in_use(client.cluster_info().instances)


# The controller's decisions -----------------------------------------------------------------------


def _seen(ttft: float, tpot: float, both: float | None = None, levels: tuple[float, float] | None = None) -> Attainment:
    """A window's attainment; ``levels``: its TTFT and TPOT quantiles as fractions of the SLOs, by
    default over the SLO where missed, else TTFT at 70% and TPOT at 40% (decode steps with room)."""
    levels = levels or (1.2 if ttft < 0.9 else 0.7, 1.2 if tpot < 0.9 else 0.4)
    return Attainment(ttft, tpot, min(ttft, tpot) if both is None else both, 50, *levels, num_decoded=50)


def test_the_controller_moves_capacity_to_the_phase_that_misses_its_slo():
    pd = {"a": P, "b": D}
    cc = {"a": C, "b": C}
    assert propose(pd, _seen(0.5, 1.0), 0.9)[0] == cc  # TTFT missed, TPOT held with room: colocate
    assert propose(cc, _seen(1.0, 0.4), 0.9)[0] == {"a": D, "b": P}  # the busier instance keeps decoding
    assert propose(pd, _seen(1.0, 0.4), 0.9) is None  # no prefill to spare
    # TTFT near its SLO, not yet missed, and room in decode steps: colocate before a window misses.
    assert propose(pd, _seen(0.92, 1.0, levels=(0.95, 0.4)), 0.9)[0] == cc
    assert propose(pd, _seen(0.92, 1.0, levels=(0.8, 0.4)), 0.9) is None  # not near
    # TPOT held but near its SLO: prompt chunks in decode steps would trade one miss for another.
    assert propose(pd, _seen(0.5, 1.0, levels=(1.3, 0.8)), 0.9) is None
    assert propose(pd, _seen(0.92, 1.0, levels=(0.95, 0.8)), 0.9) is None
    # Colocated, TTFT missed while TPOT holds near its SLO: prompts wait behind decoding in mixed steps.
    roles, why = propose(cc, _seen(0.5, 1.0, levels=(1.3, 0.8)), 0.9)
    assert roles == {"a": D, "b": P} and why.endswith("prompts wait behind decoding, disaggregating")
    # Unless a forecast for the load ranks all colocated above disaggregated.
    assert propose(cc, _seen(0.5, 1.0, levels=(1.3, 0.8)), 0.9, disaggregated_better=False) is None
    assert propose(cc, _seen(0.5, 1.0, levels=(1.3, 0.8)), 0.9, disaggregated_better=True)[0] == {"a": D, "b": P}
    assert propose(cc, _seen(0.5, 1.0), 0.9) is None  # with room: prefill is short, which halving it would not mend
    for layout in (pd, cc):
        assert propose(layout, _seen(0.95, 0.95, levels=(0.7, 0.7)), 0.9) is None  # both met
        # under 90%, within 50 requests' noise (7 points)
        assert propose(layout, _seen(0.85, 0.84, levels=(1.05, 1.05)), 0.9) is None
    assert propose(pd, _seen(0.5, 0.5), 0.9)[0] == cc  # both missed: the other layout is tried
    assert propose(cc, _seen(0.5, 0.5), 0.9)[0] == {"a": D, "b": P}
    four = {"a": P, "b": P, "c": D, "d": D}
    assert propose(four, _seen(0.5, 1.0), 0.9)[0] == {"a": P, "b": P, "c": D, "d": P}
    assert propose(four, _seen(1.0, 0.5), 0.9)[0] == {"a": P, "b": D, "c": D, "d": D}
    roles, why = propose(pd, _seen(0.5, 1.0), 0.9)
    assert why == (
        "TTFT attainment 50%, TPOT 100% over 50 requests (quantiles at 120% and 40% of the SLOs): "
        "too little prefill, colocating"
    )


def test_a_window_s_attainment_and_quantiles_judge_each_request_by_its_own_slos():
    requests = [FinishedRequest(0.0, 600, 60, finished=1.0, ttft=0.01 * i, tpot=0.001 * i) for i in range(1, 11)]
    requests.append(FinishedRequest(0.0, 40, 1, finished=1.0, ttft=0.05, tpot=None, slo=RequestSLO(ttft=0.025)))
    seen = attainment(requests, slo_ttft=0.08, slo_tpot=0.01, target=0.9)
    assert (seen.ttft, seen.tpot, seen.num_requests) == (8 / 11, 1.0, 11)
    assert seen.both == 8 / 11
    # TTFT over its SLO, request by request: 0.125 ... 1.25 and 2.0 (its own SLO); the 10th of 11.
    assert seen.ttft_level == pytest.approx(1.25)
    assert seen.tpot_level == pytest.approx(0.9)  # 9 of the 10 decoded within 0.9 of the SLO


def test_the_controller_does_not_go_back_to_a_layout_that_did_worse_under_this_load():
    controller = RoleController(None, RoleControlConfig("adaptive", 0.1, 0.01, memory=60))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    busy, other = Load(tokens_ratio=5.0, rate=20.0), Load(tokens_ratio=0.2, rate=20.0)
    # Overloaded as prefill + decode: both missed, colocated is tried...
    controller.remember(pd, busy, met=25, num_requests=50, now=0.0)
    assert controller.consider(pd, _seen(0.6, 0.7, 0.5), busy, now=0.0)[0] == cc
    # ...and does worse under the same load: back to prefill + decode...
    controller.remember(cc, busy, met=10, num_requests=50, now=5.0)
    assert controller.consider(cc, _seen(0.4, 0.3, 0.2), busy, now=5.0)[0] == {"a": D, "b": P}
    # ...where both still miss, but colocated is not tried again while the load stays alike.
    assert controller.consider(pd, _seen(0.6, 0.7, 0.5), Load(6.0, 24.0), now=10.0) is None
    # A different load (prompts short against outputs) or an old measurement: tried again.
    assert controller.consider(pd, _seen(0.6, 0.7, 0.5), other, now=15.0)[0] == cc
    assert controller.consider(pd, _seen(0.6, 0.7, 0.5), busy, now=100.0)[0] == cc
    # A layout that did better under this load is moved to.
    controller.remember(cc, busy, met=48, num_requests=50, now=101.0)
    assert controller.consider(pd, _seen(0.5, 1.0, 0.5), busy, now=102.0)[0] == cc
    # Not for a window's dip, when memory holds this layout to do better than the proposed one...
    controller.remember(pd, busy, met=40, num_requests=50, now=103.0)
    assert controller.consider(cc, _seen(0.7, 1.0, 0.7, (1.2, 0.8)), busy, now=104.0) is None
    # ...or to meet the target under this load, though the other layout is not known under it.
    controller.remember(cc, other, met=460, num_requests=500, now=105.0)
    assert controller.consider(cc, _seen(0.7, 1.0, 0.7, (1.2, 0.8)), other, now=106.0) is None
    # What it met at a lower rate does not hold it at a higher one.
    heavier = Load(other.tokens_ratio, 1.2 * other.rate)
    assert controller.consider(cc, _seen(0.7, 1.0, 0.7, (1.2, 0.8)), heavier, now=106.0)[0] == {"a": D, "b": P}
    controller.remember(cc, other, met=30, num_requests=100, now=107.0)  # 82% of 600 now: the layout fails it
    assert controller.consider(cc, _seen(0.7, 1.0, 0.7, (1.2, 0.8)), other, now=108.0)[0] == {"a": D, "b": P}


def test_the_controller_counts_each_verdict_and_the_metrics_show_them():
    controller = RoleController(None, RoleControlConfig("adaptive", 0.1, 0.01, memory=60))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    long, short = Load(tokens_ratio=10.0, rate=20.0), Load(tokens_ratio=0.3, rate=20.0)
    missing_ttft = _seen(0.7, 1.0, 0.7)
    assert controller.consider(pd, missing_ttft, long, now=0.0)[0] == cc  # nothing known: proposed
    controller.remember(cc, long, met=30, num_requests=60, now=1.0)
    assert controller.consider(pd, missing_ttft, long, now=2.0) is None  # colocated did worse
    controller.remember(pd, long, met=57, num_requests=60, now=3.0)
    assert controller.consider(pd, missing_ttft, long, now=4.0) is None  # a dip: memory holds it
    controller.remember(cc, short, met=30, num_requests=60, now=5.0)
    controller.remember(pd, short, met=58, num_requests=60, now=6.0)
    assert controller.recall(cc, short, now=7.0)[0] == {"a": D, "b": P}
    controller.settled_at = 0.0  # a whole window since the layout settled
    assert controller.propose_now(cc, [], now=7.0) is None  # no arrivals seen: nothing recalled
    assert controller.verdicts == {"proposed": 1, "proposed layout did no better": 1, "held by memory": 1}

    metrics = ServingMetrics()
    metrics.update_instances([], 0, [], dict(controller.verdicts))
    controller.verdicts["held by memory"] += 2
    controller.verdicts["recalled"] += 1
    metrics.update_instances([], 0, [], dict(controller.verdicts))  # counts, not added twice
    text = metrics.render().decode()
    assert 'distserve_role_controller_verdicts_total{verdict="held by memory"} 3.0' in text
    assert 'distserve_role_controller_verdicts_total{verdict="proposed"} 1.0' in text
    assert 'distserve_role_controller_verdicts_total{verdict="recalled"} 1.0' in text


def test_the_controller_follows_the_arriving_load_to_the_layout_that_did_best_under_it():
    controller = RoleController(None, RoleControlConfig("adaptive", 0.1, 0.01, memory=60))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    long, short = Load(tokens_ratio=10.0, rate=20.0), Load(tokens_ratio=0.3, rate=20.0)
    assert controller.recall(pd, long, now=0.0) is None  # nothing known
    controller.remember(pd, long, met=12, num_requests=20, now=0.0)
    assert controller.recall(pd, long, now=1.0) is None  # no other layout known under it
    controller.remember(cc, long, met=20, num_requests=24, now=5.0)
    controller.remember(cc, long, met=23, num_requests=24, now=6.0)  # the requests of each record add up
    controller.remember(cc, short, met=10, num_requests=20, now=15.0)
    controller.remember(pd, short, met=37, num_requests=40, now=25.0)
    # What colocated met at 20 req/s says nothing of 24...
    assert controller.recall(pd, Load(12.0, 24.0), now=30.0) is None
    # ...but long prompts arriving again at 18: back to colocated at once, before any has finished...
    roles, why = controller.recall(pd, Load(12.0, 18.0), now=30.0)
    assert roles == cc
    assert why == (
        "arriving load like one under which 60% of 20 requests met both SLOs in this layout"
        " and 90% of 48 in colocated+colocated"
    )
    # ...and short ones: the busier instance ("b", listed first) decodes.
    assert controller.recall({"b": C, "a": C}, short, now=31.0)[0] == {"b": D, "a": P}
    assert controller.recall(cc, long, now=31.0) is None  # the current layout met it
    assert controller.recall(pd, Load(2.0, 20.0), now=31.0) is None  # a load not seen before
    assert controller.recall(pd, long, now=61.0) is None  # forgotten
    controller.remember(pd, long, met=44, num_requests=60, now=70.0)
    controller.remember(cc, long, met=23, num_requests=30, now=75.0)
    assert controller.recall(pd, long, now=80.0) is None  # 73% against 77%: within the noise


def test_a_kind_of_request_memory_knows_nothing_of_is_met_at_once_by_the_forecast_layout():
    # The 58M Llama's step times on one thread; requests of 1024 prompt tokens and 64 out at 0.67 req/s.
    forecast_from = (StepCost(0.060, 0.00125), ChunkedPrefill(256, 16, tpot_aware=True))
    controller = RoleController(None, RoleControlConfig("adaptive", slo_ttft=3.34, slo_tpot=0.262, memory=600))
    dp, cc = {"a": D, "b": P}, {"a": C, "b": C}
    now = controller.last_change + 60.0
    for i in range(8):  # TTFT-tight (the cluster's SLOs)
        controller.observe_arrival(Arrival(now + 1.5 * i, 1024, 64))
    now += 1.5 * 7
    assert controller.forecast_due(now)
    # At the most the 7 arrivals of the last 10 s say (0.67 req/s measured, 1.62 times that at most).
    assert controller.demand(now, controller.arriving(now)).rate == pytest.approx(6 / 9 * (1 + 1.645 / 7**0.5))
    assert controller.propose_now(dp, [], now, tick=False, forecast_from=forecast_from) == (
        cc,
        "arriving requests (1024 prompt tokens, SLOs 3.34 s and 262 ms, up to 1.08 req/s) forecast over capacity"
        " (145% busy) in this layout and over capacity (103% busy) colocated",
        True,  # no patience: not a window's evidence
    )
    assert not controller.forecast_due(now)  # once for each kind: then windows judge
    for i in range(3):  # TPOT-tight requests come instead: none is forecast for while the mix blends the kinds
        controller.observe_arrival(Arrival(now + 1.5 * (i + 1), 1024, 64, RequestSLO(12.5, 0.0645)))
        assert controller.forecast_due(now + 1.5 * (i + 1)) == (i == 2)
    now += 4.5
    roles, why, _ = controller.propose_now(cc, [], now, tick=False, forecast_from=forecast_from)
    assert roles == dp
    assert why.endswith("forecast over capacity (289% busy) in this layout and over capacity (145% busy) disaggregated")
    assert controller.propose_now(dp, [], now, forecast_from=forecast_from) is None  # colocated is worse for them
    assert controller.verdicts == {"forecast": 2}

    # What was measured wins: this layout met the TTFT-tight kind at this rate.
    controller = RoleController(None, RoleControlConfig("adaptive", slo_ttft=3.34, slo_tpot=0.262, memory=600))
    now = controller.last_change + 60.0
    for i in range(4):
        controller.observe_arrival(Arrival(now + 1.5 * i, 1024, 64))
    now += 4.5
    controller.remember(dp, controller.arriving(now), met=38, num_requests=40, now=now - 30)
    assert controller.propose_now(dp, [], now, tick=False, forecast_from=forecast_from) is None
    assert controller.verdicts == {"forecast overruled by memory": 1}
    assert not controller.forecast_due(now)


def test_a_layout_that_served_nothing_like_the_arriving_load_gives_way_to_one_that_surely_met_it():
    controller = RoleController(None, RoleControlConfig("adaptive", 0.1, 0.01, memory=60))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    load = Load(tokens_ratio=10.0, rate=2.0)
    controller.remember(cc, load, met=20, num_requests=20, now=0.0)
    assert controller.recall(pd, load, now=1.0) is None  # 20 of 20 met: not surely 90%
    controller.remember(cc, load, met=20, num_requests=20, now=2.0)
    roles, why = controller.recall(pd, load, now=3.0)
    assert roles == cc
    assert why == "arriving load like one under which none served in this layout and 100% of 40 in colocated+colocated"
    assert controller.recall(pd, Load(10.0, 3.5), now=3.0) is None  # met at a lower rate only
    # Met at a rate far above the arriving one (a few seconds' rate dips at a change of workload).
    assert controller.recall(pd, Load(10.0, 1.0, arrivals=8), now=3.0)[0] == cc
    controller.remember(pd, Load(10.0, 1.0), met=5, num_requests=17, now=4.0)
    assert controller.recall(pd, Load(10.0, 0.7, arrivals=8), now=5.0)[0] == cc
    assert Share(40, 40).surely_at_least(0.9) and not Share(39, 40).surely_at_least(0.9)


def test_a_layout_that_fell_short_under_a_lighter_load_gives_way_when_none_was_seen_at_this_rate():
    controller = RoleController(None, RoleControlConfig("adaptive", 0.1, 0.01, memory=60))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    controller.remember(cc, Load(10.0, 1.2), met=38, num_requests=40, now=0.0)
    controller.remember(pd, Load(10.0, 0.7), met=15, num_requests=24, now=1.0)  # 62% at 0.7 req/s
    arriving = Load(10.0, 1.2, arrivals=10)  # nothing of prefill + decode at a rate like it
    roles, why = controller.recall(pd, arriving, now=2.0)
    assert roles == cc
    assert why.startswith("arriving load like one under which 62% of 24 requests met both SLOs in this layout")
    # What it met under a lighter load says nothing of this one, and one just above the arriving
    # rate's noise is not lighter.
    assert controller.recall(pd, Load(10.0, 0.3, arrivals=10), now=2.0) is None
    controller.remember(pd, Load(10.0, 0.7), met=80, num_requests=80, now=3.0)
    assert controller.recall(pd, arriving, now=4.0) is None  # 95 of 104 met under 0.7: not short


def test_a_layout_just_moved_to_is_judged_by_what_it_did_before_the_change():
    controller = RoleController(None, RoleControlConfig("adaptive", 0.1, 0.01, window=3.0, min_requests=4))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    controller.remember(cc, Load(10.0, 12.0), met=90, num_requests=100, now=1000.0)
    controller.layout_changed(1010.0)  # to prefill + decode, whose first requests wait behind a backlog
    controller.remember(pd, Load(10.0, 8.0), met=5, num_requests=20, now=1012.0)
    for i in range(25):
        controller.observe_arrival(Arrival(1012.0 + 0.1 * i, prompt_len=600, max_tokens=60))
    assert controller.propose_now(pd, [], 1012.9) is None  # not back on those alone
    controller.settled_at = 1011.0
    roles, _, from_memory = controller.propose_now(pd, [], 1014.5)  # a whole window since it settled
    assert roles == cc and from_memory


def test_a_share_is_clearly_above_another_only_beyond_both_samples_noise():
    assert Share(48, 50).clearly_above(Share(25, 50))
    assert not Share(46, 50).clearly_above(Share(44, 50))
    # All of a few requests met: not certain, so not clearly above a large sample a little lower.
    assert not Share(8, 8).clearly_above(Share(905, 1005))
    assert Share(60, 60).clearly_above(Share(905, 1005))


def test_each_finished_request_is_remembered_once_under_the_layout_that_served_it():
    config = RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, window=10.0, min_requests=4)
    controller = RoleController(None, config)
    start = controller.last_change
    pd = {"a": P, "b": D}
    for i in range(6):  # 2 of 6 miss their TTFT
        ttft = 0.5 if i < 2 else 0.05
        controller.observe(FinishedRequest(start + i, 600, 60, finished=start + i + 1, ttft=ttft, tpot=0.005))
    for now in (start + 7, start + 7.5):  # the second record finds nothing new
        controller.record(pd, controller.window(now), now)
    assert [(o.met, o.num_requests) for o in controller.outcomes] == [(4, 6)]
    assert controller.remembered(tuple(sorted((P, D))), Load(10.0, 1.0), start + 8) == Share(4, 6)


def test_finished_requests_are_remembered_under_their_own_mix_at_the_window_s_rate():
    config = RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, window=10.0, min_requests=4)
    controller = RoleController(None, config)
    start = controller.last_change
    pd = {"a": P, "b": D}
    for i in range(6):  # long prompts, then short ones while the long ones are still in the window
        controller.observe(FinishedRequest(start + i, 600, 60, finished=start + i + 1, ttft=0.05, tpot=0.005))
    controller.record(pd, controller.window(start + 7), start + 7)
    for i in range(6, 9):
        controller.observe(FinishedRequest(start + i, 40, 128, finished=start + i + 1, ttft=0.05, tpot=0.005))
    controller.record(pd, controller.window(start + 10), start + 10)
    (long, short) = (o.load for o in controller.outcomes)
    assert (long.tokens_ratio, short.tokens_ratio) == (pytest.approx(10.0), pytest.approx(40 / 128))
    assert (short.rate, short.arrivals) == (1.0, 9)  # 9 requests arriving over 8 s: the window's


def test_finished_requests_wait_for_a_window_that_says_its_rate_and_each_kind_is_remembered_apart():
    config = RoleControlConfig("adaptive", slo_ttft=1.0, slo_tpot=0.1, window=10.0, min_requests=4)
    controller = RoleController(None, config)
    start = controller.last_change
    pd = {"a": P, "b": D}
    for i in range(3):  # summaries: TTFT tight, TPOT loose (the cluster's SLOs); all met
        controller.observe(FinishedRequest(start + i, 600, 60, finished=start + i + 1, ttft=0.5, tpot=0.05))
    controller.record(pd, controller.window(start + 4), start + 4)
    assert not controller.outcomes  # three requests in the window: too few to say a rate, kept
    for i in range(3, 6):  # chats of the same lengths, TPOT tight: one of three missed it
        slo = RequestSLO(ttft=10.0, tpot=0.02)
        tpot = 0.03 if i == 3 else 0.01
        controller.observe(FinishedRequest(start + i, 600, 60, slo, finished=start + i + 1, ttft=5.0, tpot=tpot))
    controller.record(pd, controller.window(start + 7), start + 7)
    (summaries, chats) = controller.outcomes
    assert (summaries.met, summaries.num_requests, chats.met, chats.num_requests) == (3, 3, 2, 3)
    assert (summaries.load.slo_ratio, chats.load.slo_ratio) == (1.0, pytest.approx(0.02))
    assert summaries.load.rate == chats.load.rate == 1.0  # the window's: 6 arrivals over 5 s


def test_what_was_met_at_a_rate_just_under_a_noisy_measurement_counts_as_at_its_rate():
    assert Load(10.0, 2.0, arrivals=16).lowest_rate == pytest.approx(2.0 * (1 - 1.645 / 4))  # 1 / sqrt(16)
    assert Load(10.0, 2.0, arrivals=400).lowest_rate == pytest.approx(2.0 * (1 - 1.645 / 20))
    assert Load(10.0, 2.0, arrivals=2).lowest_rate == 0.0
    assert Load(10.0, 2.0).lowest_rate == 2.0  # a rate given, not measured
    controller = RoleController(None, RoleControlConfig("adaptive", 0.1, 0.01, memory=60))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    controller.remember(cc, Load(10.0, 1.6), met=36, num_requests=40, now=0.0)
    controller.remember(pd, Load(10.0, 1.9), met=4, num_requests=10, now=1.0)
    # 1.9 req/s from the last 16 arrivals may be 1.6: colocated met it there.
    assert controller.recall(pd, Load(10.0, 1.9, arrivals=16), now=2.0)[0] == cc
    # From 400 arrivals it may not: nothing is known of colocated at 1.9 req/s.
    assert controller.recall(pd, Load(10.0, 1.9, arrivals=400), now=2.0) is None


def _in_flight(arrival: float, prefilled: bool) -> InFlight:
    """A request in flight that arrived at ``arrival``, with its first token or still waiting for it."""
    return InFlight(Arrival(arrival, 100, 10), arrival + 0.1 if prefilled else None)


def test_requests_count_for_a_layout_once_the_work_and_the_queue_from_its_change_are_done():
    controller = RoleController(None, RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, min_requests=1))
    controller.last_change, controller.settled_at, controller._previous_done_at = 100.0, None, None  # a change at t=100
    for arrival in (99.0, 101.0, 103.0):
        controller.observe(FinishedRequest(arrival, 600, 60, finished=104.0, ttft=0.05, tpot=0.005))
    # A request from before the change is in flight.
    controller.settle([_in_flight(99.5, True), _in_flight(102.0, False)], now=104.0)
    assert controller.settled_at is None and controller.window(104.5) == []
    # The previous layout's work is done at t=105, but a request that queued during the change
    # still waits for its first token...
    controller.settle([_in_flight(102.0, False), _in_flight(104.8, False)], now=105.0)
    assert controller.settled_at is None
    # ...until it has it (one that arrived after t=105 may still wait).
    controller.settle([_in_flight(102.0, True), _in_flight(105.2, False)], now=105.5)
    assert controller.settled_at == 105.5
    assert [r.arrival for r in controller.window(105.5)] == []  # what arrived before t=105.5 waited behind it
    controller.observe(FinishedRequest(105.6, 600, 60, finished=106.0, ttft=0.05, tpot=0.005))
    assert [r.arrival for r in controller.window(106.5)] == [105.6]


def test_a_window_proposes_a_change_only_once_it_is_whole_after_the_layout_settled():
    config = RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, window=3.0, min_requests=4)
    controller = RoleController(None, config)
    controller.settled_at = settled = 1000.0
    cc = {"a": C, "b": C}
    for i in range(8):  # every prompt missed its TTFT, TPOT held near its SLO
        controller.observe(FinishedRequest(settled + 0.1 * i, 600, 60, finished=settled + 1, ttft=0.5, tpot=0.008))
    assert controller.propose_now(cc, controller.window(settled + 2.0), settled + 2.0) is None
    roles, _, from_memory = controller.propose_now(cc, controller.window(settled + 3.0), settled + 3.0)
    assert roles == {"a": D, "b": P} and not from_memory


def test_a_light_load_s_window_reaches_back_to_the_fewest_requests_a_decision_rests_on():
    config = RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, window=10.0, min_requests=8)
    controller = RoleController(None, config)
    controller.settled_at = settled = 1000.0
    pd = {"a": P, "b": D}
    for i in range(12):  # one every 2 s: five in any 10 s; every prompt missed its TTFT, TPOT held
        arrival = settled + 2 * i
        controller.observe(FinishedRequest(arrival, 600, 60, finished=arrival + 1, ttft=0.5, tpot=0.002))
    now = settled + 24.0
    window = controller.window(now)
    assert [r.arrival - settled for r in window] == [2 * i for i in range(4, 12)]  # the last 8, over 15 s
    roles, _, _ = controller.propose_now(pd, window, now)
    assert roles == {"a": C, "b": C}  # too little prefill: colocating
    assert Load.of(window).rate == pytest.approx(0.5)
    assert controller.window(settled + 33.5) == []  # none finished in the last 10 s: a load gone quiet


def test_a_window_that_holds_the_kind_that_came_before_is_judged_by_the_kind_arriving():
    config = RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, window=3.0, min_requests=4)
    controller = RoleController(None, config)
    controller.settled_at = settled = 1000.0
    pd, now = {"a": P, "b": D}, settled + 4.0
    for i in range(24):  # chat requests, all met, decoding near its TPOT SLO (no room for chunks)
        controller.observe(FinishedRequest(settled + 0.05 * i, 40, 128, finished=now - 1, ttft=0.05, tpot=0.008))
    for i in range(5):  # then long prompts, every one past its TTFT SLO
        controller.observe(FinishedRequest(settled + 2 + 0.1 * i, 600, 60, finished=now - 0.5, ttft=0.5, tpot=0.002))
    window = controller.window(now)
    whole = attainment(window, config.slo_ttft, config.slo_tpot)
    assert whole.ttft == pytest.approx(24 / 29)  # within the noise of 90% for 29 requests: no miss seen
    assert controller.propose_now(pd, window, now) is None  # nothing tells the kind arriving yet
    for t in (now - 1.0, now - 0.6, now - 0.3):
        controller.observe_arrival(Arrival(t, prompt_len=600, max_tokens=60))
    assert [r.prompt_len for r in controller.of_arriving_kind(window, controller.arriving(now))] == [600] * 5
    roles, why, from_memory = controller.propose_now(pd, window, now)
    assert roles == {"a": C, "b": C} and not from_memory
    assert why.startswith("TTFT attainment 0%, TPOT 100% over 5 requests")
    # A blend of both kinds arriving together is judged whole.
    for t in (now - 0.2, now - 0.1):
        controller.observe_arrival(Arrival(t, prompt_len=40, max_tokens=128))
    assert controller.of_arriving_kind(window, controller.arriving(now)) == window


def test_prompts_queued_past_their_ttft_slo_count_as_misses_before_they_finish():
    config = RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, window=3.0, min_requests=4)
    controller = RoleController(None, config)
    controller.settled_at = settled = 1000.0
    pd, now = {"a": P, "b": D}, settled + 4.0
    for i in range(3):  # a few finished, all met: too few to judge
        controller.observe(FinishedRequest(settled + 0.1 * i, 600, 60, finished=now - 1, ttft=0.05, tpot=0.002))
    window = controller.window(now)
    in_flight = [
        InFlight(Arrival(settled - 0.5, 600, 60)),  # arrived before the layout settled: not its doing
        InFlight(Arrival(settled + 1.0, 600, 60), settled + 1.05, settled + 1.05),  # its first token in time
        InFlight(Arrival(now - 0.05, 600, 60)),  # waiting, but not yet past its SLO: not known
        InFlight(Arrival(now - 1.0, 600, 60, RequestSLO(ttft=2.0))),  # its own SLO leaves it time
    ] + [InFlight(Arrival(settled + 2.0 + 0.1 * i, 600, 60)) for i in range(4)]  # queued past 0.1 s
    started = controller.known_in_flight(in_flight, now)
    assert [round(r.ttft, 2) for r in started] == [0.05, 2.0, 1.9, 1.8, 1.7]
    assert all(r.tpot is None for r in started)
    assert controller.propose_now(pd, window, now) is None  # the finished ones alone: too few
    roles, why, _ = controller.propose_now(pd, window, now, started=started)
    assert roles == {"a": C, "b": C}
    assert why.startswith("TTFT attainment 50%, TPOT 100% over 8 requests")
    controller.settled_at = None  # a change under way: nothing in flight is this layout's yet
    assert controller.known_in_flight(in_flight, now) == []


def test_requests_decoding_too_slowly_to_meet_their_tpot_slo_count_as_misses_before_they_finish():
    config = RoleControlConfig("adaptive", slo_ttft=1.0, slo_tpot=0.05, window=3.0, min_requests=4)
    controller = RoleController(None, config)
    controller.settled_at = settled = 1000.0
    cc, now = {"a": C, "b": C}, settled + 10.0

    def decoding(start: float, seconds: float, max_tokens: int = 65, slo: RequestSLO | None = None) -> InFlight:
        """First token 0.1 s after arriving, the latest ``seconds`` after that."""
        return InFlight(Arrival(start, 40, max_tokens, slo or RequestSLO()), start + 0.1, start + 0.1 + seconds)

    in_flight = [
        decoding(settled - 1.0, 4.0),  # arrived before the layout settled: not its doing
        decoding(settled + 1.0, 3.0),  # 3 s: 64 more tokens at once would still make 47 ms a token
        decoding(settled + 1.1, 4.0, slo=RequestSLO(tpot=0.1)),  # its own SLO leaves it room
        decoding(settled + 1.2, 4.0, max_tokens=1),  # one token: no TPOT
    ] + [decoding(settled + 2.0 + 0.1 * i, 3.3 + 0.2 * i) for i in range(4)]  # past 64 x 50 ms already
    started = controller.known_in_flight(in_flight, now)
    assert [r.tpot for r in started[:3]] == [None] * 3
    assert [round(r.tpot, 4) for r in started[3:]] == [0.0516, 0.0547, 0.0578, 0.0609]
    assert controller.propose_now(cc, [], now) is None  # nothing has finished
    roles, why, _ = controller.propose_now(cc, [], now, started=started)
    assert roles == {"a": D, "b": P}
    assert why.startswith("TTFT attainment 100%, TPOT 0% over 7 requests")
    assert why.endswith("prefill interferes with decoding, disaggregating")


def test_a_layout_left_on_a_window_s_evidence_is_remembered_as_falling_short_under_that_load():
    """The requests a window proposal judged, in flight ones too, are remembered for the layout it
    leaves, each once: when that load comes back, memory moves to the layout that held it."""
    config = RoleControlConfig("adaptive", slo_ttft=1.0, slo_tpot=0.05, window=3.0, min_requests=6)
    cc, dp = {"a": C, "b": C}, {"a": D, "b": P}

    def controller_that_saw_misses() -> tuple[RoleController, list[FinishedRequest], float]:
        controller = RoleController(None, config)
        controller.settled_at = settled = controller.last_change
        now = settled + 10.0
        # Chat requests arriving every 0.5 s: 4 finished over their TPOT SLO, 4 in flight behind it.
        for i in range(4):
            controller.observe(FinishedRequest(settled + 1 + 0.5 * i, 40, 65, finished=now - 0.5, ttft=0.1, tpot=0.08))
        in_flight = [InFlight(Arrival(settled + 3 + 0.5 * i, 40, 65), settled + 3.2 + 0.5 * i, now) for i in range(4)]
        window = controller.window(now)
        controller.record(cc, window, now)  # 4 finished: too few to say the window's rate, not yet remembered
        started = controller.known_in_flight(in_flight, now)
        assert all(r.tpot is not None for r in started)  # 4.8-6.3 s for 64 tokens: sure misses
        roles, _, from_memory = controller.propose_now(cc, window, now, started=started)
        assert roles == dp and not from_memory
        return controller, window + started, now

    controller, judged, now = controller_that_saw_misses()
    load = Load.of(judged, controller.cluster_slo)
    assert controller.remembered((C, C), load, now) is None
    controller.record_judged(cc, now)  # the change is carried out
    assert controller.remembered((C, C), load, now) == Share(0, 8)
    controller.record(cc, controller.window(now + 1), now + 1)  # the finished ones are not remembered twice
    assert controller.remembered((C, C), load, now + 1) == Share(0, 8)
    # Later the disaggregated layout held the same load: when it comes back, memory moves to it.
    controller.remember(dp, load, met=12, num_requests=12, now=now + 60)
    roles, why = controller.recall(cc, load, now + 100)
    assert roles == dp and why.startswith("arriving load like one under which 0% of 8 requests met both SLOs")
    # The same without the change's evidence: none served here, and 12 of 12 is not surely 90%.
    unrecorded, _, now = controller_that_saw_misses()
    unrecorded.remember(dp, load, met=12, num_requests=12, now=now + 60)
    assert unrecorded.recall(cc, load, now + 100) is None


def test_a_layout_left_before_it_settled_is_remembered_by_the_requests_since_the_change():
    """A layout at its capacity keeps a queue and may be left (here from memory, for another kind of
    request) before it settles: what it served since the change to it is remembered then, each
    request once and none from before the change; when that load comes back, memory moves to it."""
    config = RoleControlConfig("adaptive", slo_ttft=1.0, slo_tpot=0.05, window=10.0, min_requests=8)
    cc, dp = {"a": C, "b": C}, {"a": D, "b": P}

    def controller_left_unsettled() -> tuple[RoleController, Load, float]:
        controller = RoleController(None, config)
        t0 = controller.last_change
        chat = [Arrival(t0 + 0.5 * i, 40, 65) for i in range(7)]
        load = Load.of(chat)
        controller.remember(cc, load, met=3, num_requests=11, now=t0)  # colocation fell short under it
        controller.layout_changed(t0 + 0.2)  # to 1 decode + 1 prefill, which never settles
        for r in chat:  # the first arrived before the change
            controller.observe(FinishedRequest(**vars(r), finished=r.arrival + 4.0, ttft=0.5, tpot=0.03))
        return controller, load, t0 + 7.5

    controller, load, left = controller_left_unsettled()
    assert controller.settled_at is None and controller.window(left) == []  # no window to record
    controller.record_left(dp, left)  # left for colocation when long prompts came
    controller.record_left(dp, left + 1.0)  # nothing twice
    recorded = [o for o in controller.outcomes if o.layout == (D, P)]
    assert [(o.met, o.num_requests) for o in recorded] == [(6, 6)]
    assert recorded[0].load.similar(load)
    # After a second such stay, the chat load comes back while colocated: memory moves to it.
    controller.remember(dp, recorded[0].load, met=6, num_requests=6, now=left + 30.0)
    roles, why = controller.recall(cc, load, left + 40.0)
    assert roles == dp and why.endswith(
        "27% of 11 requests met both SLOs in this layout and 100% of 12 in decode+prefill"
    )
    # Without the records made on leaving there is nothing to move to.
    unrecorded, load, left = controller_left_unsettled()
    unrecorded.remember(dp, recorded[0].load, met=6, num_requests=6, now=left + 30.0)
    assert unrecorded.recall(cc, load, left + 40.0) is None


def test_tpot_is_judged_by_the_noise_of_the_requests_whose_tpot_is_known():
    started = [FinishedRequest(float(i), 600, 60, finished=10.0, ttft=0.05, tpot=None) for i in range(7)]
    tpots = (0.02, 0.005, 0.005)
    finished = [FinishedRequest(7.0 + i, 600, 60, finished=10.0, ttft=0.05, tpot=t) for i, t in enumerate(tpots)]
    seen = attainment(started + finished, slo_ttft=0.1, slo_tpot=0.01)
    assert (seen.num_requests, seen.num_decoded, seen.tpot) == (10, 3, pytest.approx(2 / 3))
    # 2 of 3 is within the noise of 90% for 3 requests, not for 10
    assert propose({"a": C, "b": C}, seen, 0.9) is None  # judged as 10, it would disaggregate
    assert miss_margin(0.9, 10) < 0.9 - 2 / 3 < miss_margin(0.9, 3)


def test_load_is_the_token_ratio_and_rate_of_a_window():
    load = Load.of([Arrival(t, prompt_len=600, max_tokens=60) for t in (0.0, 0.5, 1.0)])
    assert (load.tokens_ratio, load.rate) == (pytest.approx(10.0), 2.0)
    # A typical request's ratio (the geometric mean): one long prompt among short ones moves it little.
    mixed = Load.of([Arrival(0.0, 640, 64)] + [Arrival(0.1 * t, 40, 128) for t in range(1, 16)])
    assert Load(0.3125, 10.0).similar(mixed)
    assert Load(10.0, 2.0).similar(Load(14.0, 2.9)) and not Load(10.0, 2.0).similar(Load(16.0, 2.0))
    requests = [FinishedRequest(t, 600, 60, finished=t + 1, ttft=0.1, tpot=0.01) for t in (0.0, 0.5, 1.0)]
    slow = attainment(requests, slo_ttft=0.05, slo_tpot=0.02)
    assert (slow.ttft, slow.tpot, slow.both) == (0.0, 1.0, 0.0)


def test_the_arriving_mix_is_of_the_last_few_arrivals_when_few_come_in_its_window():
    config = RoleControlConfig("adaptive", 0.1, 0.01, window=10.0, arrival_window=2.0, min_requests=8)
    controller = RoleController(None, config)
    for i in range(2):  # long prompts at 1 req/s, after a quiet spell...
        controller.observe_arrival(Arrival(100.0 + i, prompt_len=600, max_tokens=60))
    assert controller.arriving(101.5) is None  # too few to say what kind of load is coming
    controller.observe_arrival(Arrival(102.0, prompt_len=600, max_tokens=60))
    early = controller.arriving(102.5)  # three say it, at a rate as noisy as three arrivals make it
    assert early.tokens_ratio == pytest.approx(10.0) and (early.rate, early.arrivals) == (1.0, 3)
    assert early.highest_rate > 1.9 and early.lowest_rate < 0.1
    for i in range(3, 7):
        controller.observe_arrival(Arrival(100.0 + i, prompt_len=600, max_tokens=60))
    for i in range(7, 11):  # ...then short ones: two in the last 2 s, the mix is of the last three
        controller.observe_arrival(Arrival(100.0 + i, prompt_len=40, max_tokens=128))
    load = controller.arriving(110.5)
    assert load.tokens_ratio == pytest.approx(40 / 128) and (load.rate, load.arrivals) == (1.0, 10)


def test_with_one_mix_arrival_a_change_of_kind_is_followed_on_its_first_arrival():
    cluster_slo = RequestSLO(ttft=3.0, tpot=0.05)
    summary_slo = RequestSLO(ttft=1.5, tpot=0.2)  # TTFT tight, TPOT loose: colocation's
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    for fewest, follows in [(3, False), (1, True)]:
        config = RoleControlConfig("adaptive", 3.0, 0.05, memory=600, arrival_window=0.5, mix_arrivals=fewest)
        controller = RoleController(None, config)
        summaries = Load.of([Arrival(t, 600, 60, summary_slo) for t in (0.0, 1.0, 2.0)], cluster_slo)
        controller.remember(pd, summaries.at_rate_of(Load(10.0, 1.0)), met=4, num_requests=20, now=0.0)
        controller.remember(cc, summaries.at_rate_of(Load(10.0, 1.0)), met=20, num_requests=20, now=1.0)
        for t in range(100, 110):  # a phase of chat requests (the cluster's SLOs) at 1 req/s...
            controller.observe_arrival(Arrival(float(t), 600, 60))
        controller.observe_arrival(Arrival(110.0, 600, 60, summary_slo))  # ...then the first summary
        arriving = controller.arriving(110.1)
        assert (arriving.slo_ratio == pytest.approx(summaries.slo_ratio)) is follows
        recalled = controller.recall(pd, arriving, now=110.1)
        assert (recalled is not None and recalled[0] == cc) is follows
    with pytest.raises(ValueError, match="role_control.mix_arrivals must be an integer >= 1, got 0"):
        RoleControlConfig(mix_arrivals=0)
    with pytest.raises(ValueError, match="role_control.mix_arrivals must be an integer >= 1, got 1.5"):
        RoleControlConfig(mix_arrivals=1.5)


def test_requests_of_one_length_but_other_slos_are_another_load():
    # A summarisation class (TTFT tight, TPOT loose) and a chat class of the same lengths.
    summaries = [Arrival(t, 600, 60, RequestSLO(ttft=1.5, tpot=0.2)) for t in (0.0, 0.5, 1.0)]
    chats = [Arrival(t, 600, 60) for t in (0.0, 0.5, 1.0)]  # the cluster's SLOs: 3 s and 0.05 s
    cluster_slo = RequestSLO(ttft=3.0, tpot=0.05)
    summary, chat = Load.of(summaries, cluster_slo), Load.of(chats, cluster_slo)
    assert (summary.slo_ratio, chat.slo_ratio) == (pytest.approx(8.0), 1.0)  # TPOT 8x looser against TTFT
    assert summary.tokens_ratio == chat.tokens_ratio and not summary.similar(chat)
    controller = RoleController(None, RoleControlConfig("adaptive", 3.0, 0.05, memory=60))
    pd, cc = {"a": P, "b": D}, {"a": C, "b": C}
    controller.remember(pd, chat.at_rate_of(Load(10.0, 2.0)), met=5, num_requests=20, now=0.0)
    controller.remember(cc, chat.at_rate_of(Load(10.0, 2.0)), met=19, num_requests=20, now=1.0)
    assert controller.recall(pd, chat.at_rate_of(Load(10.0, 2.0)), now=2.0)[0] == cc
    assert controller.recall(pd, summary.at_rate_of(Load(10.0, 2.0)), now=2.0) is None  # not seen before


def test_role_control_is_checked():
    assert ClusterConfig.from_pools(
        ClusterConfig().engine, {"role_control": {"mode": "adaptive", "slo_ttft": 1, "slo_tpot": 0.1}}
    ).role_control == RoleControlConfig("adaptive", 1, 0.1)
    for options, message in [
        ({"mode": "adaptive"}, "adaptive role control needs both SLOs"),
        ({"mode": "auto"}, "role_control.mode must be one of fixed, adaptive"),
        ({"window": 0}, "role_control.window must be > 0"),
        ({"interval_s": 1}, "unknown role_control option"),
    ]:
        with pytest.raises(ValueError, match=message):
            ClusterConfig.from_pools(ClusterConfig().engine, {"role_control": options})


def test_a_layout_whose_queue_outlasts_a_window_after_its_change_is_judged_from_the_change_on():
    config = RoleControlConfig("adaptive", slo_ttft=0.1, slo_tpot=0.01, window=10.0, min_requests=4)
    controller = RoleController(None, config)
    controller.last_change, controller.settled_at, controller._previous_done_at = 100.0, None, None
    cc = {"a": C, "b": C}
    backlog = [_in_flight(99.0, False)] + [_in_flight(100.5 + i, False) for i in range(6)]  # never drains
    controller.settle(backlog, now=109.0)
    assert controller.settled_at is None  # within a window of the change: the change's transient
    for i in range(6):  # what arrived after the change missed its TTFT (TPOT near its SLO, no room)
        controller.observe(FinishedRequest(100.5 + i, 600, 60, finished=109.5, ttft=0.5, tpot=0.008))
    controller.settle(backlog, now=110.0)
    assert controller.settled_at == 100.0  # a window on, the queue is this layout's
    assert [r.arrival for r in controller.window(110.0)] == [100.5 + i for i in range(6)]
    started = controller.known_in_flight([_in_flight(106.0, False), _in_flight(99.0, False)], now=110.0)
    assert [r.arrival for r in started] == [106.0]  # queued past its TTFT SLO since the change
    roles, _, from_memory = controller.propose_now(cc, controller.window(110.0), 110.0, started=started)
    assert roles == {"a": D, "b": P} and not from_memory  # judged now, not once the queue drains


def test_a_colocated_window_short_of_prefill_disaggregates_only_where_the_forecast_ranks_it_better():
    # The 58M Llama's step times on one thread; 1024-token prompts, 64 out, at 0.67 req/s. Steps cut
    # to a TPOT SLO run near it by design: TTFT missed with TPOT at 75% of its SLO, colocated.
    forecast_from = (StepCost(0.060, 0.00125), ChunkedPrefill(256, 16, tpot_aware=True))
    cc = {"a": C, "b": C}
    for slo, disaggregated_better in ((RequestSLO(3.34, 0.262), False), (RequestSLO(12.5, 0.0645), True)):
        config = RoleControlConfig("adaptive", slo_ttft=3.34, slo_tpot=0.262, min_requests=8, memory=600)
        controller = RoleController(None, config)
        start = controller.settled_at
        for i in range(10):
            controller.observe_arrival(Arrival(start + 1.5 * i, 1024, 64, slo))
            ttft = slo.ttft * (1.3 if i % 3 == 0 else 0.5)  # 6 of 10 met
            controller.observe(
                FinishedRequest(start + 1.5 * i, 1024, 64, slo, finished=start + 15, ttft=ttft, tpot=0.75 * slo.tpot)
            )
        now = start + 15.0
        controller._forecast_mix = controller.arriving(now)  # forecast for this kind already: windows judge
        arriving = controller.arriving(now)
        assert controller.disaggregated_better(cc, arriving, now, forecast_from) is disaggregated_better
        assert controller.disaggregated_better({"a": D, "b": P}, arriving, now, forecast_from) is None
        window = controller.window(now)
        ranked = controller.propose_now(cc, window, now, forecast_from=forecast_from)
        assert (ranked is not None and ranked[0] == {"a": D, "b": P}) == disaggregated_better
        unranked = controller.propose_now(cc, window, now)  # no step times: the TPOT's hint stands
        assert unranked[0] == {"a": D, "b": P} and unranked[1].endswith("prompts wait behind decoding, disaggregating")
