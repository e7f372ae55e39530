"""The Ray cluster-launcher configs (cluster.yaml, cluster-onprem.yaml) pass Ray's own checks, offline.

`ray up` loads the YAML and, in `ray.autoscaler._private.commands._bootstrap_config`, runs
`prepare_config` (merge with the provider's defaults.yaml, merge setup commands, fill per-type
min/max workers; for `local`, turn head_ip/worker_ips into the single on-prem node type) and
then `validate_config` (Ray's ray-schema.json, which refuses unknown keys, plus the
head_node_type and min/max_workers checks). Both only read files shipped with Ray. What
`ray up` does after that needs the cloud and is not run here: the AWS provider's
`fillout_available_node_types_resources` (boto3 DescribeInstanceTypes) and `bootstrap_config`
(IAM role, key pair, subnets, security group). A guard makes any network connection fail the test.
"""

from __future__ import annotations

import copy
import re
import socket
from pathlib import Path

import jsonschema
import pytest
import yaml
from click import ClickException
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
AWS = ROOT / "cluster.yaml"
ONPREM = ROOT / "cluster-onprem.yaml"
TORCH_PIN = "torch==2.13.0"


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the cluster config checks must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)  # what `ray up` uses


def ray_check(raw: dict) -> dict:
    """The offline part of `ray up`'s bootstrap: prepare, then validate. Returns the prepared config."""
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    return config


def install_index(commands: list[str], pattern: str, what: str) -> int:
    hits = [i for i, c in enumerate(commands) if re.search(r"\bpip install\b", c) and re.search(pattern, c)]
    assert hits, f"no `pip install` of {what} in {commands}"
    return hits[0]


def problems(raw: dict) -> list[str]:
    """What distserve needs from a cluster config beyond Ray's schema; [] when all is well."""
    found = []
    config = prepare_config(copy.deepcopy(raw))
    types = config["available_node_types"]
    if raw["provider"]["type"] != "local":  # on-prem resources are detected by Ray on each machine
        head = types[config["head_node_type"]]
        if head["resources"].get("GPU", 0):
            found.append("the head node type declares GPUs")
        workers = [t for name, t in types.items() if name != config["head_node_type"]]
        if not any(t["resources"].get("GPU", 0) > 0 and t["max_workers"] > 0 for t in workers):
            found.append("no worker node type declares GPUs")
    for key in ("head_setup_commands", "worker_setup_commands"):  # setup_commands merged in by prepare_config
        commands = config[key]
        try:
            torch = install_index(commands, re.escape(TORCH_PIN), TORCH_PIN)
            if torch > install_index(commands, r"~/distserve\b", "the project"):
                found.append(f"{key} install the project before {TORCH_PIN}")
        except AssertionError as e:
            found.append(f"{key}: {e}")
    if raw.get("file_mounts", {}).get("~/distserve") != ".":
        found.append("file_mounts do not copy this checkout to ~/distserve")
    head_start = " ; ".join(config["head_start_ray_commands"])
    if not re.search(r"ray start .*--head\b", head_start):
        found.append("head_start_ray_commands do not start a Ray head")
    if "--dashboard-host=0.0.0.0" in head_start:
        found.append("the Ray dashboard is exposed on every interface")
    if not re.search(r"ray start .*--address=\$RAY_HEAD_IP:6379", " ; ".join(config["worker_start_ray_commands"])):
        found.append("worker_start_ray_commands do not join the head")
    return found


@pytest.mark.parametrize("path", [AWS, ONPREM], ids=lambda p: p.name)
def test_ray_accepts_config(path):
    config = ray_check(load(path))
    assert config["cluster_name"] == "distserve"
    assert problems(load(path)) == []


def test_aws_config():
    raw = load(AWS)
    assert raw["provider"]["type"] == "aws" and raw["provider"]["region"]
    config = ray_check(raw)
    head = config["available_node_types"][config["head_node_type"]]
    assert "GPU" not in head["resources"] and head["max_workers"] == 0
    gpu = config["available_node_types"]["gpu_worker"]
    assert gpu["resources"] == {"CPU": 96, "GPU": 8}
    assert gpu["node_config"]["InstanceType"] == "p4d.24xlarge"
    assert 0 < gpu["min_workers"] <= gpu["max_workers"] <= config["max_workers"]
    for node_type in config["available_node_types"].values():
        assert re.fullmatch(r"ami-[0-9a-f]{8,17}", node_type["node_config"]["ImageId"])
    # the head runs the AWS autoscaler, which needs boto3
    assert any("boto3" in c for c in config["head_setup_commands"])


def test_onprem_config_matches_aws_setup_and_start():
    aws, onprem = load(AWS), load(ONPREM)
    assert onprem["provider"]["type"] == "local"
    assert onprem["provider"]["head_ip"] and onprem["provider"]["worker_ips"]
    assert onprem["auth"]["ssh_user"] and onprem["auth"]["ssh_private_key"]
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands", "file_mounts"):
        assert onprem[key] == aws[key], key
    config = ray_check(onprem)
    (node_type,) = config["available_node_types"].values()  # the one on-prem type made from worker_ips
    assert node_type["max_workers"] == len(onprem["provider"]["worker_ips"])


def mutated(path: Path, change) -> dict:
    raw = load(path)
    change(raw)
    return raw


@pytest.mark.parametrize(
    "raw, error",
    [
        pytest.param(
            mutated(AWS, lambda c: c.update(setup_comands=c.pop("setup_commands"))),
            jsonschema.ValidationError,
            id="typo-top-level-key",
        ),
        pytest.param(
            mutated(ONPREM, lambda c: c.update(head_start_ray_command=c.pop("head_start_ray_commands"))),
            jsonschema.ValidationError,
            id="onprem-typo-top-level-key",
        ),
        pytest.param(
            mutated(AWS, lambda c: c["available_node_types"]["gpu_worker"].update(gpus=8)),
            jsonschema.ValidationError,
            id="unknown-node-type-key",
        ),
        pytest.param(
            mutated(AWS, lambda c: c["available_node_types"]["gpu_worker"]["resources"].update(GPU=-1)),
            jsonschema.ValidationError,
            id="negative-gpus",
        ),
        pytest.param(mutated(AWS, lambda c: c.update(head_node_type="gpu")), ValueError, id="unknown-head-type"),
        pytest.param(
            mutated(AWS, lambda c: c["available_node_types"]["gpu_worker"].update(min_workers=99)),
            ValueError,
            id="min-workers-above-max",
        ),
        pytest.param(
            mutated(ONPREM, lambda c: c.update(available_node_types={"gpu": {"resources": {}, "node_config": {}}})),
            ClickException,
            id="onprem-node-types",
        ),
    ],
)
def test_ray_rejects_broken_config(raw, error):
    with pytest.raises(error):
        ray_check(raw)


def move_torch_after_project(c):
    c["setup_commands"] = [x for x in c["setup_commands"] if TORCH_PIN not in x] + [f"pip install {TORCH_PIN}"]


@pytest.mark.parametrize(
    "raw, expected",
    [
        (mutated(AWS, lambda c: c["available_node_types"]["head"]["resources"].update(GPU=8)), "head node type"),
        (mutated(AWS, lambda c: c["available_node_types"]["gpu_worker"]["resources"].pop("GPU")), "declares GPUs"),
        (mutated(AWS, move_torch_after_project), "before torch"),
        (mutated(ONPREM, lambda c: c["setup_commands"].pop(0)), "torch==2.13.0"),
        (mutated(AWS, lambda c: c.update(file_mounts={})), "file_mounts"),
        (mutated(ONPREM, lambda c: c.update(head_start_ray_commands=["ray stop"])), "Ray head"),
        (mutated(AWS, lambda c: c.update(worker_start_ray_commands=["ray stop", "ray start"])), "join the head"),
    ],
)
def test_problems_are_caught(raw, expected):
    found = problems(raw)
    assert any(expected in p for p in found), found
