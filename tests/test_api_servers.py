"""Several API servers over one cluster (``cluster.api_servers``): every server serves requests
greedy-equal to transformers; a server killed under load loses only its own streams (their KV
freed once its lease passes) and is started again; an instance killed under load with two
servers loses no request of either."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from conftest import random_prompts, reference_greedy, wait_nothing_in_use

from distserve.cluster.api import make_cluster_config
from distserve.entrypoints.client import CallError, Client
from distserve.entrypoints.openai_server import SERVER_HEADER
from distserve.entrypoints.server import BackgroundServer
from distserve.entrypoints.server_config import ServerConfig

MODEL = "tiny-llama"
SERVER_LEASE_S = 2.0


def _server(ray_cluster, api_servers: int) -> BackgroundServer:
    config = make_cluster_config(
        model=MODEL, num_kv_blocks=512, dtype="float32", prefill={}, decode={}, api_servers=api_servers,
        server_lease=SERVER_LEASE_S,
    )  # fmt: skip
    return BackgroundServer(config, ServerConfig(grpc_port=0, http_port=0))


def _complete_over_http(server: BackgroundServer, prompt: list[int], max_tokens: int) -> tuple[int, list[int]]:
    """(the API server that answered, the completion's token ids), on a connection of its own."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        f"{server.http_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
        return int(response.headers[SERVER_HEADER]), answer["choices"][0]["token_ids"]


# Three servers are a slow scenario: two run the same paths (each server its own process and ports).
@pytest.mark.parametrize("api_servers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_api_server_serves_greedy_equal_to_transformers(ray_cluster, reference_model, api_servers):
    prompts = random_prompts([5 + i % 7 for i in range(12 * api_servers)], 1024, seed=api_servers)
    with _server(ray_cluster, api_servers) as server:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: _complete_over_http(server, p, 12), prompts))
        statuses = server.loop.run(server.frontend.server_statuses())
        wait_nothing_in_use(server.info, server.frontend)
        # Whichever server a client reaches lists them all, in its cluster info and on /metrics.
        for _ in range(3 * api_servers):
            with Client(server.grpc_address) as client:
                assert sorted(s.index for s in client.cluster_info().api_servers) == list(range(api_servers))
            with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as response:
                metrics = response.read().decode()
            assert all(f'distserve_api_server_cpu_seconds{{server="{i}"}}' in metrics for i in range(api_servers))
    model = reference_model(MODEL)
    assert [ids for _, ids in answers] == [reference_greedy(model, p, 12) for p in prompts]
    assert {index for index, _ in answers} == set(range(api_servers)), "the kernel spread no connection to some"
    assert sorted(s.index for s in statuses) == list(range(api_servers))
    assert len({s.pid for s in statuses}) == api_servers


def _stream(server: BackgroundServer, prompt: list[int], max_tokens: int) -> tuple[str | None, list[int]]:
    """A gRPC stream: (its error's code name, or None, and its tokens)."""
    tokens: list[int] = []
    try:
        with Client(server.grpc_address) as client:
            for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0):
                tokens += chunk.token_ids
    except CallError as e:
        return e.code().name, tokens
    return None, tokens


def _servers_holding_load(server: BackgroundServer) -> set[str]:
    return {
        server_id
        for entry in server.cluster.orchestrator.instances
        for server_id, load in ray.get(entry.handle.loads.remote()).items()
        if load.load_tokens
    }


def test_a_killed_api_server_loses_only_its_own_streams_and_starts_again(ray_cluster, reference_model):
    prompts = random_prompts([6 + i % 9 for i in range(32)], 1024, seed=68)
    max_tokens = 200
    with _server(ray_cluster, 2) as server:
        first = server.loop.run(server.frontend.server_statuses())
        other = next(s for s in first if s.index == 1)
        with ThreadPoolExecutor(32) as pool:
            streams = [pool.submit(_stream, server, p, max_tokens) for p in prompts]
            deadline = time.monotonic() + 60
            while not any(s.num_pending_requests for s in server.loop.run(server.frontend.server_statuses())[1:]):
                assert time.monotonic() < deadline, "no stream reached the second server"
                time.sleep(0.05)
            # Instances count what each server's requests hold there, which every server routes by.
            while not {"", other.server_id} <= _servers_holding_load(server):
                assert time.monotonic() < deadline, "the instances counted no load of both servers"
                time.sleep(0.05)
            os.kill(other.pid, signal.SIGKILL)
            results = [s.result(timeout=120) for s in streams]
        failed = [r for r in results if r[0] is not None]
        completed = [(p, r[1]) for p, r in zip(prompts, results) if r[0] is None]
        print(f"\n{len(failed)} streams ended with the killed server, {len(completed)} completed")
        assert failed and completed
        assert {code for code, _ in failed} <= {"UNAVAILABLE", "CANCELLED", "INTERNAL", "UNKNOWN"}
        model = reference_model(MODEL)
        assert all(tokens == reference_greedy(model, p, max_tokens) for p, tokens in completed)
        # The instances end the dead server's requests once its lease has passed.
        wait_nothing_in_use(server.info, server.frontend, timeout=SERVER_LEASE_S + 15)
        # It is started again, under a new server id, and serves.
        deadline = time.monotonic() + 90
        while True:
            statuses = server.loop.run(server.frontend.server_statuses())
            again = [s for s in statuses if s.index == 1]
            if again and again[0].pid != other.pid:
                break
            assert time.monotonic() < deadline, "the killed server was not started again"
            time.sleep(0.5)
        assert again[0].server_id != other.server_id and again[0].restarts == 1
        served = set()
        for p in prompts:
            index, ids = _complete_over_http(server, p, 8)
            assert ids == reference_greedy(model, p, 8)
            served.add(index)
        assert served == {0, 1}


def test_an_instance_killed_under_load_with_two_servers_loses_no_request(ray_cluster, reference_model):
    prompts = random_prompts([6 + i % 9 for i in range(24)], 1024, seed=69)
    max_tokens = 120
    with _server(ray_cluster, 2) as server:
        decode = next(s for s in server.cluster.orchestrator.instances if s.role.value == "decode")
        with ThreadPoolExecutor(24) as pool:
            answers = [pool.submit(_complete_over_http, server, p, max_tokens) for p in prompts]
            deadline = time.monotonic() + 60
            while ray.get(decode.handle.info.remote()).num_running < 8:  # under load: many of both servers' there
                assert time.monotonic() < deadline, "the decode instance never ran 8 requests"
                time.sleep(0.05)
            ray.kill(decode.handle)
            results = [a.result(timeout=180) for a in answers]
        model = reference_model(MODEL)
        assert [ids for _, ids in results] == [reference_greedy(model, p, max_tokens) for p in prompts]
        assert {index for index, _ in results} == {0, 1}
        deadline = time.monotonic() + 60
        while decode.name in (names := [s.name for s in server.cluster.orchestrator.instances]):
            assert time.monotonic() < deadline, "the killed instance was not replaced"
            time.sleep(0.1)
        assert any(name.endswith("-r1") for name in names), names
        wait_nothing_in_use(server.info, server.frontend, timeout=30)


def test_a_role_change_asked_of_another_server_is_made_by_the_first(ray_cluster, reference_model):
    """Servers past the first pass role changes to it through the cluster's directory; every
    server follows the new roles and serves on."""
    with _server(ray_cluster, 2) as server:
        orchestrator = server.cluster.orchestrator
        names = [s.name for s in orchestrator.instances]
        records = ray.get(orchestrator.directory.set_roles.remote({name: "colocated" for name in names}, None))
        assert sorted(r.instance for r in records) == sorted(names) and not any(r.error for r in records)
        assert all(s.role.value == "colocated" for s in orchestrator.instances)
        refused = ray.get(orchestrator.directory.set_roles.remote({"no-such-instance": "decode"}, None))
        assert isinstance(refused, Exception) and "no-such-instance" in str(refused)
        prompts = random_prompts([5 + i % 7 for i in range(16)], 1024, seed=70)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: _complete_over_http(server, p, 10), prompts))
        model = reference_model(MODEL)
        assert [ids for _, ids in answers] == [reference_greedy(model, p, 10) for p in prompts]
        assert {index for index, _ in answers} == {0, 1}
        wait_nothing_in_use(server.info, server.frontend)
