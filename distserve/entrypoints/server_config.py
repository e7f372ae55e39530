"""Settings of the serving process: where it listens, who may call it and how much it admits.
Each field is a key of the ``server:`` YAML section and a ``distserve launch`` flag."""

from __future__ import annotations

import os
from dataclasses import dataclass

from distserve.core.config import option

API_KEY_ENV = "DISTSERVE_API_KEY"
ADMIN_KEY_ENV = "DISTSERVE_ADMIN_KEY"


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", "address the gRPC and HTTP servers bind (loopback unless told otherwise)")
    grpc_port: int = option(50051, "gRPC port (0 picks a free one)")
    # --port as well, as vLLM spells it
    http_port: int = option(8000, "OpenAI-compatible HTTP and /metrics port (0 picks a free one)", aliases=("--port",))
    api_key: str | None = option(None, f"key clients must send as 'Bearer KEY' (default: ${API_KEY_ENV})")
    admin_key: str | None = option(
        None,
        f"key that calls changing the cluster (SetRoles, distserve roles) must send as 'Bearer KEY', not the "
        f"api_key; unset, they are refused (default: ${ADMIN_KEY_ENV})",
    )
    enable_prompt_tokens_details: bool = option(
        False,
        "report the prompt tokens found cached (usage.prompt_tokens_details.cached_tokens, gRPC "
        "cached_prompt_tokens), as vLLM's flag: they tell a client whether other prompts began as its own",
    )
    tls_cert: str | None = option(None, "PEM certificate chain: serve gRPC and HTTP over TLS (with tls_key)")
    tls_key: str | None = option(None, "PEM private key of tls_cert")
    max_pending_requests: int = option(1024, "requests admitted and not finished; beyond it RESOURCE_EXHAUSTED / 429")
    drain_timeout: float = option(30.0, "seconds SIGINT/SIGTERM lets in-flight requests finish before stopping")
    served_model_name: str | None = option(None, "model name in the OpenAI API (default: the model setting)")
    ray_address: str | None = option(None, "Ray cluster to join ('auto': the one on this node; default: start one)")

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.admin_key is None:
            self.admin_key = os.environ.get(ADMIN_KEY_ENV) or None
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("admin_key must differ from api_key: a client's key would change the cluster")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(f"{name} file '{path}' does not exist")
        if self.max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be at least 1, got {self.max_pending_requests}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def read_tls(self) -> tuple[bytes, bytes]:
        """(certificate chain, private key) as PEM bytes."""
        with open(self.tls_cert, "rb") as cert, open(self.tls_key, "rb") as key:
            return cert.read(), key.read()
