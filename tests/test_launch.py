"""``distserve launch`` as users run it: a process serving gRPC and HTTP that SIGINT drains and
stops, leaving no process or Ray actor of its own behind, also when the signal comes during start-up."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import grpc
import psutil
import pytest
import yaml

from distserve.core.cpu_features import has_bf16_instructions
from distserve.entrypoints.client import Client
from distserve.entrypoints.launch import load_launch_config

STARTUP_TIMEOUT_S = 180
TAG_VARIABLE = "DISTSERVE_TEST_LAUNCH_TAG"


class Launched:
    """A ``distserve launch`` subprocess whose log lines are read on a thread; by default, once it serves.

    Every process it starts (Ray's included) inherits its ``tag`` in the environment, so what it
    leaves behind can be found.
    """

    def __init__(self, *args: str, serving: bool = True) -> None:
        command = [sys.executable, "-m", "distserve.cli", "launch", "--grpc-port", "0", "--http-port", "0", *args]
        self.tag = uuid.uuid4().hex
        env = {**os.environ, TAG_VARIABLE: self.tag}
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        if serving:
            self.grpc_address = self.wait_for(r"gRPC listening on (\S+)").group(1)
            self.http_url = self.wait_for(r"HTTP listening on (\S+)").group(1)

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line)
        self.lines.put("")  # the end: ``rest`` stops here

    def rest(self) -> str:
        """The log from here to the end of the process (call once it has exited)."""
        while line := self.lines.get(timeout=10):
            self.log.append(line)
        return "".join(self.log)

    def left_behind(self) -> list[psutil.Process]:
        """Live processes that carry this launch's tag."""
        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get(TAG_VARIABLE) == self.tag and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except psutil.Error:  # gone meanwhile, or another user's
                pass
        return found

    def wait_for(self, pattern: str, timeout: float = STARTUP_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            self.log.append(line)
            if match := re.search(pattern, line):
                return match
        self.process.kill()
        raise AssertionError(f"no line matching {pattern!r}; log:\n{''.join(self.log)}")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_launch_serves_then_sigint_drains_and_leaves_no_process():
    """One colocated instance on one thread: on a machine of two cores or more, it runs on the
    highest core and the launcher, its Ray and its servers on the others."""
    args = ("--colocated-instances", "1", "--cpu-threads", "1")
    server = Launched("--model", "tiny-llama", "--num-kv-blocks", "64", "--drain-timeout", "60", *args)
    try:
        children = server.descendants()
        raylet = [p for p in children if "raylet" in " ".join(p.cmdline())]
        assert raylet  # a local Ray of its own
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:
            log = "".join(server.log)
            assert f"colocated-0: cores {cores[-1]}, 1 torch thread(s) per worker" in log
            serving = set(cores[:-1])
            assert os.sched_getaffinity(server.process.pid) == serving and set(raylet[0].cpu_affinity()) == serving
            assert any(p.cpu_affinity() == [cores[-1]] for p in children)  # the instance's process
        with urllib.request.urlopen(f"{server.http_url}/health", timeout=10) as response:
            assert response.status == 200
        dtype = "bfloat16" if has_bf16_instructions() else "float32"  # what auto chooses on this CPU, and says
        assert f"dtype: {dtype} (auto: the CPU has" in "".join(server.log)
        with Client(server.grpc_address) as client:
            assert client.complete("Hello", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
            stream = client.generate("A long answer", max_tokens=600, ignore_eos=True)  # a few seconds
            first = next(stream)  # in flight when the signal comes
            server.process.send_signal(signal.SIGINT)
            server.wait_for("SIGINT: draining")
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as refused:
                client.complete("Too late")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 600  # drained, not cut
        assert server.process.wait(timeout=120) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()
    time.sleep(1)
    assert not _alive(children), f"left behind: {[p.cmdline() for p in _alive(children)]}"


def test_launch_on_an_existing_ray_cluster_stops_only_its_actors(ray_cluster, tmp_path):
    from ray._private import state

    def alive_actors() -> set[str]:
        return {k for k, v in state.actors().items() if v["State"] == "ALIVE"}

    before = alive_actors()
    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"model": "tiny-llama"},
                "cache": {"num_kv_blocks": 32},
                "cluster": {"name": "launch-test", "prefill": {"instances": 1}, "decode": {"instances": 1}},
                "server": {"drain_timeout": 5},
            }
        )
    )
    address = ray_cluster.get_runtime_context().gcs_address
    server = Launched("--config", str(config), "--ray-address", address)
    try:
        assert len(alive_actors() - before) >= 2  # its instances (and their workers) on the shared cluster
        with Client(server.grpc_address) as client:
            info = client.cluster_info()
            assert sorted(i.name for i in info.instances) == ["launch-test-decode-0", "launch-test-prefill-0"]
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=120) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()
    deadline = time.monotonic() + 10
    while alive_actors() != before:
        assert time.monotonic() < deadline, f"actors left behind: {alive_actors() - before}"
        time.sleep(0.2)
    assert ray_cluster.is_initialized()  # the shared cluster keeps running


def test_launch_config_precedence(tmp_path):
    config, plan = tmp_path / "config.yaml", tmp_path / "plan.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"model": "tiny-llama"},
                "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
                "server": {"grpc_port": 6000, "api_key": "from-file"},
            }
        )
    )
    plan.write_text(
        yaml.safe_dump(
            {
                "plan": {"goodput_per_gpu": 1.5},  # the planner's notes: logged, not settings
                "cluster": {"prefill": {"instances": 2, "tensor_parallel_size": 2}, "decode": {"instances": 3}},
            }
        )
    )
    cluster, server = load_launch_config(
        str(config), str(plan), {"decode_instances": 4, "block_size": 8, "grpc_port": 7000}
    )
    pools = {p.role: p for p in cluster.pools}
    assert (pools["prefill"].instances, pools["prefill"].options) == (2, {"tensor_parallel_size": 2})
    assert pools["decode"].instances == 4
    assert cluster.engine.cache.block_size == 8
    assert (server.grpc_port, server.api_key) == (7000, "from-file")


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"role": "prefill"}, "leave --role out"),
        ({"colocated_instances": 2, "prefill_instances": 1}, "not both"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"tls_cert": "/nonexistent.pem", "tls_key": "/nonexistent.key"}, "does not exist"),
        ({"max_pending_requests": 0}, "max_pending_requests"),
    ],
)
def test_launch_refuses_bad_settings(flags, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_launch_config(flags=flags)


def test_launch_cli_exits_2_on_bad_settings(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {grpc_prot: 1}\n")
    result = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "launch", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert result.returncode == 2
    assert "unknown key(s) grpc_prot in section 'server'" in result.stderr


# The Ray case is a slow scenario: stopping during the instances' start stops more of what started.
@pytest.mark.parametrize(
    "moment", [pytest.param("starting a local Ray", marks=pytest.mark.slow), r"starting \d+ instances"]
)
def test_sigint_during_start_up_stops_what_started_and_exits_130(moment):
    launched = Launched("--model", "tiny-llama", serving=False)
    try:
        launched.wait_for(moment)
        launched.process.send_signal(signal.SIGINT)
        assert launched.process.wait(timeout=120) == 130
    finally:
        if launched.process.poll() is None:
            launched.process.kill()
    log = launched.rest()
    assert "SIGINT during start-up: stopped before serving" in log
    assert "Traceback" not in log and "Segmentation fault" not in log
    assert "listening on" not in log
    deadline = time.monotonic() + 10
    while left := launched.left_behind():
        assert time.monotonic() < deadline, f"left behind: {[p.cmdline() for p in left]}"
        time.sleep(0.5)
