"""A request's own latency objectives, which it may carry in place of the cluster's
(``role_control.slo_ttft`` and ``slo_tpot``)."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.errors import RequestError


@dataclass(frozen=True)
class RequestSLO:
    """A request's own latency objectives, in seconds; None: the cluster's."""

    ttft: float | None = None
    tpot: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # NaN too
                raise RequestError(f"slo_{name} must be > 0 seconds, got {value}")
