"""What the role controller knows of a request: on arrival, while in flight, and once finished."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.slo import RequestSLO


@dataclass
class Arrival:
    arrival: float  # wall-clock time
    prompt_len: int
    max_tokens: int  # the output it asks for: known on arrival, unlike the output's length
    slo: RequestSLO = RequestSLO()


@dataclass
class InFlight:
    """A request in flight as the controller sees it, before it finishes."""

    request: Arrival
    first_token: float | None = None  # wall-clock times of its first and latest tokens: None, none yet
    last_token: float | None = None


@dataclass
class FinishedRequest(Arrival):
    finished: float = 0.0  # wall-clock time of its last token
    ttft: float = 0.0
    tpot: float | None = (
        None  # None: not known yet (in flight); finished, ``time_per_output_token`` (0.0 for one token)
    )
