import asyncio
import json
import os
import random
import re
import time

import jsonschema
import pytest
import torch

from distserve.model_executor.tiny_models import TINY_MODELS, ensure_tiny_model


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """Tiny models are made once per test session, in a directory of the session's own."""
    if "DISTSERVE_CACHE_DIR" not in os.environ:
        os.environ["DISTSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("distserve-cache"))


@pytest.fixture(scope="session")
def reference_model():
    """transformers' own model (its default attention) for a tiny family, loaded once per dtype."""
    from transformers import AutoModelForCausalLM

    models = {}

    def get(name: str, dtype: torch.dtype = torch.float32):
        if (name, dtype) not in models:
            models[name, dtype] = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(name), dtype=dtype).eval()
        return models[name, dtype]

    return get


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``model.generate`` for one prompt, without padding."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def reference_beams(model, prompt: list[int], params, stops: list[int]) -> list[tuple[list[int], float]]:
    """transformers' beam search of ``prompt`` as ``params`` (SamplingParams) ask for it, with
    ``stops`` as its eos tokens: each returned sequence's output tokens (to its first stop token) and
    score, best first."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=params.beam_width,
            num_return_sequences=params.n,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else 0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    results = []
    for row, score in zip(out.sequences, out.sequences_scores):
        tokens = row[len(prompt) :].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        results.append((tokens[:end], float(score)))
    return results


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def assert_engine_idle(engine) -> None:
    """An engine holds nothing: every block free and unreferenced, no request queued, running, held
    or arriving."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks in use"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.requests and not engine.has_unfinished_requests() and not len(engine.kv_hold)
    assert engine.role.ready_to_leave()


IN_USE_FIELDS = ("num_waiting", "num_running", "num_held", "num_pending")


class IndexTierClient:
    """A prefix tier client over a real index in this process, answering as ``TierClient`` does from
    its node's store: a block manager's tier connector runs on it without Ray."""

    def __init__(self, capacity: int) -> None:
        from distserve.kv_tier.index import TierIndex

        self.index = TierIndex(capacity)
        self.full = False  # no slot to lease: steps save nothing, as when every entry is pinned

    def lookup(self, keys: list) -> list[int]:
        return self.index.lookup("engine", keys)

    def plan(self, loads: list, saves: list) -> tuple[list, list]:
        slots = [] if self.full else self.index.lease("engine", len(saves))
        return [(block, slot) for _, slot, block in loads], [(b, slot, key) for (key, b), slot in zip(saves, slots)]

    def settle(self, loads: list, saved: list) -> None:
        self.index.commit("engine", [(slot, key) for _, slot, key in saved])
        self.index.release("engine", [key[0] for key, _, _ in loads])


def in_use(infos) -> list[str]:
    """What instances still hold, a line per instance (none: nothing). The strictest condition, for
    every test: each block free, nothing queued, running, held for decode or arriving, no failure.
    ``infos``: ``InstanceInfo``s, or the gRPC API's."""
    found = []
    for info in infos:
        what = [f"{info.num_blocks - info.num_free_blocks} blocks"] if info.num_free_blocks != info.num_blocks else []
        what += [f"{name}={getattr(info, name)}" for name in IN_USE_FIELDS if getattr(info, name)]
        if info.failure:
            what.append(f"failed: {info.failure}")
        if what:
            found.append(f"{info.name}: {', '.join(what)}")
    return found


def wait_nothing_in_use(read_infos, frontend=None, timeout: float = 10.0) -> None:
    """Poll ``read_infos()`` until ``in_use`` finds nothing (and ``frontend`` admits no request)."""
    deadline = time.monotonic() + timeout
    while True:
        found = in_use(read_infos())
        if frontend is not None and frontend.num_pending:
            found.append(f"frontend: {frontend.num_pending} requests admitted")
        if not found:
            return
        assert time.monotonic() < deadline, "still in use:\n" + "\n".join(found)
        time.sleep(0.02)


async def wait_nothing_in_use_async(cluster, timeout: float = 10.0) -> None:
    """``wait_nothing_in_use`` for an ``AsyncCluster`` on the running loop; its orchestrator tracks no request
    and counts no load or prompt to prefill on any instance."""
    deadline = time.monotonic() + timeout
    while True:
        found = in_use(await cluster.info())
        if cluster.orchestrator.requests:
            found.append(f"orchestrator: {len(cluster.orchestrator.requests)} requests")
        found += [
            f"routing: {s.name} counts {s.load_tokens} tokens of load, {s.prefill_tokens} to prefill"
            for s in cluster.orchestrator.instances
            if s.load_tokens or s.prefill_tokens
        ]
        if not found:
            return
        assert time.monotonic() < deadline, "still in use:\n" + "\n".join(found)
        await asyncio.sleep(0.02)


FAMILIES = TINY_MODELS


def _start_local_ray():
    ray = pytest.importorskip("ray")

    from distserve.engine.ray_runtime import one_gpu_shared_options

    # On a one-GPU machine, the GPU tests' prefill and decode instances share it.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, **one_gpu_shared_options())
    return ray


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the tests that run instances as actors, started once."""
    ray = _start_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_nodes(ray_cluster):
    """A Ray cluster of three nodes on this machine in place of the session's for a module's tests:
    the head and two more, one CPU each, labelled ``distserve.io/node`` 0, 1 and 2. Yields the
    ``ray.cluster_utils.Cluster`` (``remove_node(nodes.labelled["2"])`` loses node 2); the session's
    cluster is back after."""
    from ray.cluster_utils import Cluster

    from distserve.engine.node_groups import NODE_LABEL

    ray_cluster.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "labels": {NODE_LABEL: "0"}})
    try:
        nodes.labelled = {name: nodes.add_node(num_cpus=1, labels={NODE_LABEL: name}) for name in ("1", "2")}
        ray_cluster.init(address=nodes.address, log_to_driver=False)
        yield nodes
    finally:
        ray_cluster.shutdown()
        nodes.shutdown()
        _start_local_ray()


def make_tls_cert(directory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost: (certificate path, key path)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.crt", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


# Structured outputs' specs and the check that an output is in their language.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rank", "open"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "Tell me where", "x" * 40, "abc"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'


def check_structured(kind: str, text: str) -> None:
    """The text is a sentence of its kind's language (tests/test_structured_generation.py's specs)."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text)
    elif kind == "choice":
        assert text in ("yes", "no", "maybe")
    else:
        assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", text)
