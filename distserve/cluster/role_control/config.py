"""What the role controller is told: whether it may change roles, the SLOs it keeps, and how
often and on how much evidence it decides (``cluster.role_control``)."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.config import is_int

ROLE_CONTROL_MODES = ("fixed", "adaptive")


@dataclass
class RoleControlConfig:
    mode: str = "fixed"  # "fixed": roles change only when an operator sets them; "adaptive": the controller too
    slo_ttft: float | None = None  # seconds; adaptive needs both SLOs
    slo_tpot: float | None = None
    target: float = 0.9  # the share of requests each SLO must hold for
    interval: float = 1.0  # seconds between decisions
    window: float = 10.0  # seconds of finished requests a decision looks at
    min_requests: int = 8  # a window holds at least this many finished requests (reaching back), else no decision
    patience: int = 2  # decisions in a row that must propose the same layout
    min_dwell: float = 5.0  # seconds after a change before the next
    memory: float = 900.0  # seconds a layout's measured attainment is trusted for a similar load
    arrival_window: float = 1.0  # seconds of arrivals that say what load is coming
    # The arriving mix is of at least this many arrivals, however few came in ``arrival_window``.
    # With three, one of another kind among them moves the mix off both kinds, so a lone stray
    # moves nothing; with one, a workload that changes kind is followed on the first arrival of
    # the new kind, and a stray (or a workload of kinds interleaved) moves it too.
    mix_arrivals: int = 3
    # A kind of request that memory says nothing of is met at once by the layout a forecast from the
    # instances' step times favours (``layout_forecast``), before a window shows the misses.
    forecast: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ROLE_CONTROL_MODES:
            raise ValueError(f"role_control.mode must be one of {', '.join(ROLE_CONTROL_MODES)}, got '{self.mode}'")
        if self.mode == "adaptive" and not (self.slo_ttft and self.slo_tpot):
            raise ValueError("adaptive role control needs both SLOs: role_control.slo_ttft and slo_tpot (seconds)")
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"role_control.{name} must be > 0 seconds, got {value}")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"role_control.target must be in (0, 1], got {self.target}")
        for name in ("interval", "window", "arrival_window"):
            if not getattr(self, name) > 0:
                raise ValueError(f"role_control.{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("min_requests", "patience", "mix_arrivals"):
            count = getattr(self, name)
            if not is_int(count) or count < 1:
                raise ValueError(f"role_control.{name} must be an integer >= 1, got {count!r}")
        if self.min_dwell < 0:
            raise ValueError(f"role_control.min_dwell must be >= 0 seconds, got {self.min_dwell}")
