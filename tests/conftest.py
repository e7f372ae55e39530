import os
import random

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
    """transformers' own model (its default attention) for a tiny family, loaded once."""
    from transformers import AutoModelForCausalLM

    models = {}

    def get(name: str):
        if name not in models:
            models[name] = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(name)).eval()
        return models[name]

    return get


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``model.generate`` for one prompt, without padding."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def assert_all_blocks_free(llm) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.requests


FAMILIES = TINY_MODELS


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the tests that run instances as actors, started once."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


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
